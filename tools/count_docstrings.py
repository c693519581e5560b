"""Count the public definitions of the `ferrum` package with and without a docstring.

Public: a module-level function or class, or a method of a public class, whose name does not
start with "_" (the issue-18 measure). Prints "<documented> of <total> public definitions
documented (<percent>%)"; with --missing, also lists the undocumented ones as path:line name.

    python tools/count_docstrings.py [--missing] [ROOT]
"""
from __future__ import annotations

import ast
import pathlib
import sys


def public_definitions(root: pathlib.Path):
    """Yield (path, line, qualified name, has docstring) for every public definition."""
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if node.name.startswith("_"):
                continue
            yield path, node.lineno, node.name, ast.get_docstring(node) is not None
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if (isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                            and not item.name.startswith("_")):
                        yield (path, item.lineno, f"{node.name}.{item.name}",
                               ast.get_docstring(item) is not None)


def main(argv: list[str]) -> None:
    show = "--missing" in argv
    args = [a for a in argv if a != "--missing"]
    root = pathlib.Path(args[0] if args else "ferrum")
    defs = list(public_definitions(root))
    documented = sum(d[3] for d in defs)
    if show:
        for path, line, name, has_doc in defs:
            if not has_doc:
                print(f"{path}:{line} {name}")
    print(f"{documented} of {len(defs)} public definitions documented "
          f"({100 * documented / max(1, len(defs)):.1f}%)")


if __name__ == "__main__":
    main(sys.argv[1:])
