"""The shape of the code, held: one installed namespace, layers, no import circle (`TYPE_CHECKING`
imports counted), every public module says what it exports (and others import only that), folders
that read as a table of contents, modules sized by their concept, one owner of per-transaction state.

Size rule: a module over 400 lines gets a look (reported, not failed); past 800 it holds two concepts
and fails; modules packed right under the old 400-line cap (395–400) are counted, at most 3, so the
old cap does not go on shaping code. A split names its concept: a folder's `__init__` says what it holds.
"""

from __future__ import annotations

import ast
import importlib
import os
import warnings
from collections.abc import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Repository folder → installed package (the wheel maps them; ckptstore/client and ckptstore/server are
# links to the repository's client/ and server/ folders, so every tool sees one name per module).
FOLDERS = {"ckptstore": "ckptstore", "client": "ckptstore.client", "server": "ckptstore.server"}
MAX_MODULES_PER_FOLDER = 20
LOOK_AT_LINES, MAX_LINES = 400, 800


def modules() -> Iterator[tuple[str, str]]:
    """(dotted name, path) of every module of the three folders (migrations aside)."""
    for folder, package in FOLDERS.items():
        base = os.path.join(ROOT, folder)
        for directory, dirs, files in os.walk(base):
            dirs[:] = [
                d
                for d in dirs
                if d not in ("__pycache__", "migrations") and not os.path.islink(os.path.join(directory, d))
            ]
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(directory, name)
                    relative = os.path.relpath(path, base)[:-3].replace(os.sep, ".").removesuffix("__init__")
                    yield f"{package}.{relative}".rstrip("."), path


def tree(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as handle:
        return ast.parse(handle.read())


def imports(module: ast.Module) -> Iterator[ast.ImportFrom | ast.Import]:
    """Imports at module level, `try:` and `if TYPE_CHECKING:` blocks included: a circle a type
    checker needs is still a circle in the design."""
    for node in module.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.Try, ast.If)):
            yield from (n for n in node.body if isinstance(n, (ast.Import, ast.ImportFrom)))


def ours(name: str | None) -> bool:
    return name is not None and name.split(".", 1)[0] == "ckptstore"


def layer(name: str) -> str:
    """`client`, `server` or `core`: which side of the layers a dotted module name is on."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ("client", "server") else "core"


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


def test_the_repository_folders_are_one_installed_namespace():
    for folder, package in FOLDERS.items():
        module = importlib.import_module(package)
        assert os.path.realpath(os.path.dirname(module.__file__ or "")) == os.path.join(ROOT, folder)
    assert "client" not in ALL and "server" not in ALL and len(ALL) > 100


def test_no_module_imports_another_that_imports_it_back():
    graph: dict[str, set[str]] = {name: set() for name in ALL}
    for name, module in TREES.items():
        for node in imports(module):
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


def test_folders_read_as_a_table_of_contents():
    crowded = {}
    for folder in {os.path.dirname(path) for path in ALL.values()}:
        count = sum(1 for name in os.listdir(folder) if name.endswith(".py") and name != "__init__.py")
        if count > MAX_MODULES_PER_FOLDER:
            crowded[os.path.relpath(folder, ROOT)] = count
    assert not crowded, f"folders with more than {MAX_MODULES_PER_FOLDER} modules: {crowded}"
    unexplained = [
        name for name, module in TREES.items() if ALL[name].endswith("__init__.py") and not ast.get_docstring(module)
    ]
    assert not unexplained, f"packages whose __init__ does not say what they hold: {unexplained}"


def test_modules_are_sized_by_their_concept():
    with_lines = {name: sum(1 for _ in open(path, encoding="utf-8")) for name, path in ALL.items()}
    assert not {name: n for name, n in with_lines.items() if n > MAX_LINES}, "split by concept"
    packed = {name: n for name, n in with_lines.items() if 395 <= n <= 400}
    assert len(packed) <= 3, f"modules packed under the old 400-line cap: {packed}"
    long = {name: n for name, n in with_lines.items() if n > LOOK_AT_LINES}
    if long:
        warnings.warn(f"modules over {LOOK_AT_LINES} lines (do they hold one concept?): {long}", stacklevel=1)


def test_only_the_transaction_module_touches_session_info():
    touching = [
        name
        for name, module in TREES.items()
        for node in ast.walk(module)
        if isinstance(node, ast.Attribute)
        and node.attr == "info"
        and name != "ckptstore.server.db.transaction"
        and isinstance(node.value, ast.Name)
        and "session" in node.value.id
    ]
    assert not touching, f"session.info outside server/db/transaction.py: {touching}"


def test_the_core_and_the_two_sides_import_only_down_the_layers():
    allowed = {"core": {"core"}, "client": {"client", "core"}, "server": {"server", "core"}}
    wrong = [
        f"{name} imports {target}"
        for name, module in TREES.items()
        for node in ast.walk(module)
        if isinstance(node, (ast.ImportFrom, ast.Import))
        for target in ([node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names])
        if ours(target) and layer(target) not in allowed[layer(name)]
    ]
    assert not wrong, wrong
