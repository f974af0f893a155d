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
        print(json.dumps(measure(args.measure, args.reps)))
        return
    for tree in [ROOT, *args.tree]:
        command = [sys.executable, script, "--measure", tree, "--reps", str(args.reps)]
        result = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
        print(f"{tree}: {show(result)}")
