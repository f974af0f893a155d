"""The shape of the code, held: layers, no import circle, every public module says what it exports
(and others import only that), no module over 400 lines, one owner of per-transaction state."""

from __future__ import annotations

import ast
import importlib
import os
from collections.abc import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("ckptstore", "client", "server")


def modules() -> Iterator[tuple[str, str]]:
    """(dotted name, path) of every module of the three packages (migrations aside)."""
    for package in PACKAGES:
        for directory, _, files in os.walk(os.path.join(ROOT, package)):
            if "migrations" in directory.split(os.sep) or "__pycache__" in directory:
                continue
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(directory, name)
                    dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                    yield dotted, path


def tree(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as handle:
        return ast.parse(handle.read())


def runtime_imports(module: ast.Module) -> Iterator[ast.ImportFrom | ast.Import]:
    """Imports that run when the module is imported: module level, outside `if TYPE_CHECKING:`."""
    for node in module.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.Try):
            yield from (n for n in node.body if isinstance(n, (ast.Import, ast.ImportFrom)))


def ours(name: str | None) -> bool:
    return name is not None and name.split(".", 1)[0] in PACKAGES


def exported(module: ast.Module, name: str = "") -> set[str] | None:
    for node in module.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            assert isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None
            try:
                return set(ast.literal_eval(node.value))
            except ValueError:  # built from another module's list (`*errors.__all__`): ask the module
                return set(importlib.import_module(name).__all__)
    return None


ALL = dict(modules())
TREES = {name: tree(path) for name, path in ALL.items()}


def test_no_module_imports_another_that_imports_it_back():
    graph: dict[str, set[str]] = {name: set() for name in ALL}
    for name, module in TREES.items():
        for node in runtime_imports(module):
            if isinstance(node, ast.ImportFrom):  # `from package import submodule` imports the submodule
                submodules = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in ALL]
                targets = submodules or [node.module]
            else:
                targets = [a.name for a in node.names]
            for target in targets:
                if ours(target) and target in ALL and target != name:
                    graph[name].add(target)
    cycles = []
    state: dict[str, int] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                cycles.append(trail[trail.index(target) :] + [target])
            elif target not in state:
                visit(target, trail + [target])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, f"import circles: {cycles}"


def test_every_module_declares_its_exports_and_others_import_only_those():
    missing = [
        name for name, module in TREES.items() if exported(module, name) is None and not name.endswith("__main__")
    ]
    assert not missing, f"modules without __all__: {missing}"
    strays = []
    for name, module in TREES.items():
        for node in ast.walk(module):
            if isinstance(node, ast.ImportFrom) and ours(node.module) and node.module in TREES:
                names = exported(TREES[node.module], node.module) or set()
                submodules = {n.rsplit(".", 1)[-1] for n in ALL if n.startswith(node.module + ".")}
                strays += [
                    f"{name} imports {node.module}.{a.name}"
                    for a in node.names
                    if a.name not in names and a.name not in submodules and a.name != "*"
                ]
    assert not strays, strays


def test_no_module_is_over_400_lines():
    with_lines = {name: sum(1 for _ in open(path, encoding="utf-8")) for name, path in ALL.items()}
    assert not {name: n for name, n in with_lines.items() if n > 400}


def test_only_the_transaction_module_touches_session_info():
    touching = [
        name
        for name, module in TREES.items()
        for node in ast.walk(module)
        if isinstance(node, ast.Attribute)
        and node.attr == "info"
        and name != "server.transaction"
        and isinstance(node.value, ast.Name)
        and "session" in node.value.id
    ]
    assert not touching, f"session.info outside server/transaction.py: {touching}"


def test_the_core_and_the_two_sides_import_only_down_the_layers():
    allowed = {"ckptstore": {"ckptstore"}, "client": {"client", "ckptstore"}, "server": {"server", "ckptstore"}}
    wrong = [
        f"{name} imports {target}"
        for name, module in TREES.items()
        for node in ast.walk(module)
        if isinstance(node, ast.ImportFrom)
        and ours(target := node.module or "")
        and target.split(".", 1)[0] not in allowed[name.split(".", 1)[0]]
    ]
    assert not wrong, wrong
