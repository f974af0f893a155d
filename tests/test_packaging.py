"""The wheel, built from the repository as a clean clone has it: one top-level package, `ckptstore`,
typed (`py.typed`), carrying the client, the service, its templates, static files and migrations."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_wheel_installs_one_typed_top_level_package(tmp_path):
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    source = tmp_path / "source"
    for relative in filter(None, tracked.decode().split("\0")):  # a clean clone's files, links kept as links
        origin, copy = os.path.join(ROOT, relative), source / relative
        copy.parent.mkdir(parents=True, exist_ok=True)
        if os.path.islink(origin):
            os.symlink(os.readlink(origin), copy)
        elif os.path.exists(origin):
            shutil.copy2(origin, copy)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), "."],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = tmp_path.glob("ckptstore-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/", 1)[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"ckptstore"}, top
    for expected in (
        "ckptstore/py.typed",
        "ckptstore/store.py",
        "ckptstore/client/keras.py",
        "ckptstore/client/engine/node.py",
        "ckptstore/server/__main__.py",
        "ckptstore/server/ui/templates/base.html",
        "ckptstore/server/ui/static/app.css",
        "ckptstore/server/db/migrations/env.py",
    ):
        assert expected in names, expected
    assert any(name.startswith("ckptstore/server/db/migrations/versions/0001") for name in names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "ckptstore = ckptstore.client.cli.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
