"""The package's shape, read from its source: no import cycles (lazy imports included), one class per name, and
decoding and training in parts a newcomer reads top to bottom."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

from dflash.source_imports import import_statements, imported_modules

PACKAGE = Path(__file__).resolve().parents[1] / "dflash"
ROOT = PACKAGE.parent


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Per module, the package's modules its import statements name, at any depth (a module's package ``__init__``
    runs first too, but the package's ``__init__`` files import nothing of it)."""
    known = modules()
    graph = {}
    for name, path in known.items():
        named = {m for node in import_statements(path, ROOT) for m in imported_modules(node)}
        graph[name] = {m for m in named if m in known and m != name}
    return graph


def test_the_package_has_no_import_cycles():
    graph, state, cycles = import_graph(), {}, []

    def visit(name: str, trail: list[str]) -> None:
        state[name] = "open"
        for child in sorted(graph[name]):
            if state.get(child) == "open":
                cycles.append(trail[trail.index(child) :] + [child])
            elif child not in state:
                visit(child, trail + [child])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_the_package_init_files_import_nothing_of_it():
    for path in PACKAGE.rglob("__init__.py"):
        named = {m for node in import_statements(path, ROOT, module_level_only=True) for m in imported_modules(node)}
        assert not {m for m in named if m.startswith("dflash")}, path


def test_no_two_classes_share_a_name():
    names = Counter()
    for path in modules().values():
        names.update(node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef))
    assert [name for name, count in names.items() if count > 1] == []


def functions(path: Path) -> list[ast.FunctionDef]:
    return [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)]


def parameters(function: ast.FunctionDef) -> list[str]:
    args = function.args
    named = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    return [a for a in named if a not in ("self", "cls")] + [a.arg for a in (args.vararg, args.kwarg) if a is not None]


def test_decoding_reads_top_to_bottom():
    for path in (PACKAGE / "decoding").glob("*.py"):
        assert len(path.read_text().splitlines()) <= 300, path.name
        for function in functions(path):
            assert len(parameters(function)) <= 8, f"{path.name}: {function.name}({', '.join(parameters(function))})"
    (loop,) = [f for f in functions(PACKAGE / "decoding" / "generate.py") if f.name == "speculative_generate"]
    assert loop.end_lineno - loop.lineno + 1 <= 60


def test_the_training_loop_fits_a_sitting():
    assert len((PACKAGE / "train.py").read_text().splitlines()) <= 350
