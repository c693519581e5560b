"""Find import cycles between the modules of the `ferrum` package (issue 18: none may remain).

Every `import ferrum.x` / `from ferrum.x import y` / relative import anywhere in a module counts,
including the ones inside functions (a lazy import hides a cycle from Python, not from a
reader). An edge a -> b means module a imports module b (or a name from package b's
`__init__`). Prints each strongly connected group of two or more modules; exit status 1 if any.

    python tools/import_cycles.py [ROOT]
"""
from __future__ import annotations

import ast
import pathlib
import sys


def module_name(root: pathlib.Path, path: pathlib.Path) -> str:
    """ferrum/a/b.py -> "ferrum.a.b"; ferrum/a/__init__.py -> "ferrum.a"."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """{module: the ferrum modules it imports}, over every .py file under root."""
    files = {module_name(root, p): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                # `from pkg import mod` imports the submodule pkg.mod when there is one
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in files:   # import ferrum.a.b.c (an attribute) -> ferrum.a.b
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    # one frame per module on the search path; put the limit back after, as test_layout runs
    # this inside pytest's process (a limit left at 10,000 let json.loads parse 5,000 nested
    # brackets in later tests that expect it to refuse them)
    old_limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old_limit, 10000))
    try:
        for v in graph:
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(old_limit)
    return found


def main() -> int:
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parents[1] / "ferrum")
    groups = cycles(import_graph(root))
    for g in groups:
        print("cycle:", " <-> ".join(g))
    print(f"{len(groups)} import cycles in {root}")
    return 1 if groups else 0


if __name__ == "__main__":
    sys.exit(main())
