"""What users import, pinned: the documented import paths, `ckptstore.__all__`, each adapter's signature
(`job`, `storage`, `service`, `local_storage` spelled out, not hidden in `**options`), and the rule that
marks everything else internal — docs import only from the public modules, and every import line of
README.md and docs/ runs.

The rule (ckptstore/__init__.py says it too): the public modules are `ckptstore`, `ckptstore.errors`,
`ckptstore.client` and the adapters in PUBLIC below; every other module — the core's `format/`,
`storage/`, `wire/`, the client's `engine/`, `service/`, `cli/`, the whole service — is internal: its
names may change between releases.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys

import pytest

import ckptstore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PUBLIC = {
    "ckptstore": None,  # its __all__, pinned below
    "ckptstore.errors": None,
    "ckptstore.client": ["ServiceClient"],
    "ckptstore.client.keras": ["BackupAndRestore"],
    "ckptstore.client.tensorflow": ["CheckpointManager"],
    "ckptstore.client.torch": ["CheckpointManager", "ResumableSampler"],
    "ckptstore.client.torch.dcp": ["CkptstoreWriter", "CkptstoreReader"],
    "ckptstore.client.jax": ["CheckpointManager"],
    "ckptstore.client.hf": ["BackupAndRestore"],
    "ckptstore.client.lightning": ["BackupAndRestore"],
}
ADAPTERS = [
    (module, name)
    for module, names in PUBLIC.items()
    for name in names or []
    if name in ("BackupAndRestore", "CheckpointManager")
]
NEEDS = {"keras": "keras", "tensorflow": "tensorflow", "torch": "torch", "jax": "optax", "hf": "transformers"}
NEEDS["lightning"] = "lightning"


def _importable(module: str):
    framework = module.split(".")[2] if module.count(".") >= 2 else None
    if framework in NEEDS:
        pytest.importorskip(NEEDS[framework], reason=f"the extra for {module} is not installed")
    return importlib.import_module(module)


def test_the_core_exports_exactly_its_documented_names():
    assert sorted(ckptstore.__all__) == sorted(
        [
            "Store",
            "Position",
            "CopyKey",
            "Manifest",
            "CheckpointRef",
            "CheckpointInfo",
            "LoadedCheckpoint",
            "VerifyReport",
            "Problem",
            "AccessReport",
            *ckptstore.errors.__all__,
        ]
    )
    assert {"CkptStoreError", "ResumeRefusedError", "ResumeDriftError", "ConfigurationError"} <= set(
        ckptstore.errors.__all__
    )
    for name in ckptstore.__all__:
        assert getattr(ckptstore, name) is not None


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_every_documented_import_path_imports(module):
    imported = _importable(module)
    for name in PUBLIC[module] or []:
        assert inspect.isclass(getattr(imported, name)), f"{module}.{name}"


@pytest.mark.parametrize("module, name", ADAPTERS, ids=[f"{m}.{n}" for m, n in ADAPTERS])
def test_every_adapter_spells_out_where_and_what_it_checkpoints(module, name):
    parameters = inspect.signature(getattr(_importable(module), name)).parameters
    for option in ("job", "storage", "service", "local_storage"):
        assert option in parameters, f"{module}.{name} hides {option} in **options"
        assert parameters[option].kind is inspect.Parameter.KEYWORD_ONLY or name == "BackupAndRestore"
    documented = inspect.getdoc(getattr(_importable(module), name)) or ""
    assert documented, f"{module}.{name} has no docstring for help()"


def _doc_files() -> list[str]:
    docs = os.path.join(ROOT, "docs")
    return [os.path.join(ROOT, "README.md")] + sorted(
        os.path.join(docs, name) for name in os.listdir(docs) if name.endswith(".md")
    )


def _import_lines() -> list[tuple[str, str]]:
    """(doc, line) for every `from ckptstore… import …` / `import ckptstore…` line in README.md and docs/."""
    found = []
    pattern = re.compile(r"^\s*(from\s+ckptstore[\w.]*\s+import\s+[^#\n]+|import\s+ckptstore[\w.]*)", re.M)
    for path in _doc_files():
        with open(path, encoding="utf-8") as handle:
            for match in pattern.finditer(handle.read()):
                found.append((os.path.relpath(path, ROOT), match.group(1).strip().rstrip("(").strip()))
    return sorted(set(found))


def test_docs_import_only_from_the_public_modules():
    lines = _import_lines()
    assert len(lines) >= 10, lines
    internal = [(doc, line) for doc, line in lines if line.split()[1] not in PUBLIC]
    assert not internal, f"docs that import internal modules: {internal}"


def test_every_import_line_of_the_docs_runs():
    """All of them in one fresh interpreter (the frameworks are imported once)."""
    lines = [line for _, line in _import_lines()]
    for line in lines:
        module = line.split()[1]
        framework = module.split(".")[2] if module.count(".") >= 2 else None
        if framework in NEEDS:
            pytest.importorskip(NEEDS[framework])
    program = "\n".join(lines) + "\nprint('imported', len(" + repr(lines) + "))"
    result = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0 and "imported" in result.stdout, result.stderr[-3000:]


def test_a_users_own_client_and_server_modules_shadow_nothing(tmp_path):
    """README's Keras import and `ckptstore serve --help` from a folder holding the user's own client.py,
    server.py (which would exit 7 if run or imported) and a client/ package."""
    pytest.importorskip("keras")
    (tmp_path / "client.py").write_text("raise SystemExit(7)\n")
    (tmp_path / "server.py").write_text("raise SystemExit(7)\n")
    (tmp_path / "client").mkdir()
    (tmp_path / "client" / "__init__.py").write_text("raise SystemExit(7)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "from ckptstore.client.keras import BackupAndRestore; print(BackupAndRestore.__module__)",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0 and "ckptstore.client.keras" in result.stdout, result.stderr[-2000:]
    theirs = subprocess.run([sys.executable, "-c", "import client"], cwd=tmp_path, env=env, timeout=60)
    assert theirs.returncode == 7
    cli = os.path.join(os.path.dirname(sys.executable), "ckptstore")
    served = subprocess.run(
        [cli, "serve", "--help"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert served.returncode == 0 and "--db-url" in served.stdout, (served.returncode, served.stderr[-2000:])


def test_the_repository_folders_cannot_be_imported_under_a_second_name():
    result = subprocess.run(
        [sys.executable, "-c", "import client"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0 and "import ckptstore.client, not client" in result.stderr
    result = subprocess.run(
        [sys.executable, "-c", "import server.app"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0 and "import ckptstore.server, not server" in result.stderr
