"""The import statements of the package's own source, read without running it.

Two things need them: the workflow, whose jobs take the package files they run
as inputs (``workflow/rules/common.smk``'s ``stage()``), and the preflight's
``smoke_imports``, which runs every import line the stages write. Stages import
lazily inside the functions a job runs, so statements are found at any depth
unless ``module_level_only``; relative imports are resolved to absolute ones.
"""

from __future__ import annotations

import ast
from pathlib import Path

IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError"}


def _optional(node: ast.Try) -> bool:
    """A ``try`` whose handler catches ImportError: what it imports may be missing by design."""
    names = []
    for handler in node.handlers:
        kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        names += [k.id for k in kinds if isinstance(k, ast.Name)]
    return bool(IMPORT_ERRORS & set(names))


def import_statements(path: Path, package_root: Path, module_level_only: bool = False, optional: bool = True) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of the module at ``path`` (``package_root`` holds its top-level package), in source
    order, relative ones made absolute, ``from __future__`` left out. ``module_level_only``: not those inside
    functions or lambdas (what importing the module runs); ``optional=False``: not those guarded by an
    ``except ImportError``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return _collect(tree.body, _package_of(path, package_root), module_level_only, optional)


def function_import_statements(path: Path, package_root: Path, function: str) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that calling the top-level ``function`` of the module at ``path`` runs: its own, at
    any depth, and those of the module's other top-level functions it calls by name (``cli.py``'s subcommands
    name the stage modules a job runs this way)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    functions = {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    if function not in functions:
        raise ValueError(f"{path} has no top-level function {function!r}")
    todo, reached = [function], set()
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            calls = [n.func.id for n in ast.walk(functions[name]) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
            todo += [called for called in calls if called in functions]
    found = _collect([functions[name] for name in reached], _package_of(path, package_root), module_level_only=False, optional=True)
    return sorted(found, key=lambda n: n.lineno)


def _package_of(path: Path, package_root: Path) -> list[str]:
    return list(path.relative_to(package_root).with_suffix("").parts)


def _collect(nodes: list[ast.AST], package: list[str], module_level_only: bool, optional: bool) -> list[ast.Import | ast.ImportFrom]:
    found, stack = [], list(nodes)
    while stack:
        node = stack.pop()
        if module_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if not optional and isinstance(node, ast.Try) and _optional(node):
            stack.extend(node.handlers + node.orelse + node.finalbody)
            continue
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            if node.level:
                module = ".".join(package[: -node.level] + ([node.module] if node.module else []))
                node = ast.copy_location(ast.ImportFrom(module=module, names=node.names, level=0), node)
            found.append(node)
        elif isinstance(node, ast.Import):
            found.append(node)
        else:
            stack.extend(ast.iter_child_nodes(node))
    return sorted(found, key=lambda n: n.lineno)


def imported_modules(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The dotted names an import statement may load: ``from a import b`` loads ``a``, and ``a.b`` if a module."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    return [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
