"""The fused package and its tools import nothing from benchmarks/ (which imports them): what times
kernels lives in benchmarks/, what develops them in fused/tools."""

import ast
import pathlib

FUSED = pathlib.Path(__file__).resolve().parents[2] / "fused"


def imported_modules(path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module


def test_fused_imports_nothing_from_benchmarks():
    sources = sorted(FUSED.rglob("*.py"))
    assert any(path.parent.name == "tools" for path in sources)
    offending = [f"{path.relative_to(FUSED.parent)}: {module}" for path in sources for module in imported_modules(path)
                 if module == "benchmarks" or module.startswith("benchmarks.")]
    assert offending == []
