"""Guards of the code layout (issue 18): no import cycles between ferrum's modules, and the
public API stays documented."""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_import_cycles():
    tool = _tool("import_cycles")
    graph = tool.import_graph(ROOT / "ferrum")
    assert "ferrum.engine.scheduler" in graph["ferrum.engine.llm_engine"]   # the graph is real
    assert tool.cycles(graph) == []


def test_import_cycle_finder_finds_a_cycle():
    tool = _tool("import_cycles")
    assert tool.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_public_definitions_documented():
    tool = _tool("count_docstrings")
    defs = list(tool.public_definitions(ROOT / "ferrum"))
    documented = sum(1 for *_, has_doc in defs if has_doc)
    assert documented / len(defs) >= 0.9, f"{documented} of {len(defs)} documented"
