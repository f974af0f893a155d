"""A measurement run once per source tree, each in a fresh process — this tree, and any `--tree` (a
`git archive` of an older commit) — for a before/after in one run."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main_per_tree(
    script: str,
    doc: str,
    measure: Callable[[str, int], dict[str, Any]],
    show: Callable[[dict[str, Any]], str],
    reps: int,
) -> None:
    """The command line of a per-tree bench: `--reps`, `--tree PATH ...`; `measure(tree, reps)` runs in
    a child process per tree (which puts the tree first on its path), `show` prints its result."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--tree", nargs="*", default=[], help="also measure these source trees")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # one tree, in this process (JSON out)
    args = parser.parse_args()
    if args.measure:
        measured = _from_tree(args.measure)
        result = measure(args.measure, args.reps)
        imported = sys.modules["ckptstore"].__file__ or ""
        if not os.path.abspath(imported).startswith(measured + os.sep):
            raise SystemExit(f"measured {imported}, not the tree {measured}")
        print(json.dumps(result))
        return
    for tree in [ROOT, *args.tree]:
        command = [sys.executable, script, "--measure", tree, "--reps", str(args.reps)]
        result = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
        print(f"{tree}: {show(result)}")


def _from_tree(tree: str) -> str:
    """Put `tree` first on the path and forget the project's modules the script imported from this
    checkout (a bench helper importing ckptstore at module level would otherwise measure this tree
    under the other's name)."""
    tree = os.path.abspath(tree)
    sys.path.insert(0, tree)
    for name in [m for m in sys.modules if m.split(".")[0] in ("ckptstore", "client", "server")]:
        del sys.modules[name]
    return tree
