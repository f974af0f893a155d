"""The `ckptstore` command line: one entry point, a subcommand per task (docs/cli.md).

Exit codes: 0 ok, 1 failure (including corruption found and differences found by `reindex --check`),
2 usage (bad arguments or names), 3 not found. Every read takes `--json`; progress bars appear
on a terminal only. What each subcommand does: client/cli/commands.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from ckptstore.client.cli.checkpoint_commands import cmd_copy, cmd_diff, cmd_inspect, cmd_prestage
from ckptstore.client.cli.commands import (
    EXIT_FAILURE,
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    NothingFound,
    cmd_checkpoint_now,
    cmd_epochs,
    cmd_gc,
    cmd_jobs,
    cmd_last_good,
    cmd_reindex,
    cmd_verify,
    cmd_watch,
)

__all__ = ["main", "build_parser", "serve", "DEFAULT_URL"]

DEFAULT_URL = "http://127.0.0.1:8080"
SUMMARIES = {  # what each subcommand does, as `ckptstore --help` lists it
    "jobs": "list jobs with their last good epoch and resume position; `jobs declare` declares one",
    "epochs": "list a job's checkpoint records: node, position, attempt, state",
    "last-good": "the last good epoch and resume position of a job",
    "verify": "check every shard and tensor checksum of every node; mark corrupt records; exit 1 on corruption",
    "gc": "execute the job's retention plan for all nodes, plus uncommitted leftovers and superseded attempts",
    "reindex": "rebuild the service's records and attempt counters from the manifests under a storage root",
    "copy": "copy a checkpoint or a whole job to another root, verified on arrival",
    "watch": "follow the service's events as they happen (reconnects on its own)",
    "diff": "compare two checkpoints' fingerprints: what changed between the runs that wrote them (exit 1 if anything)",
    "checkpoint-now": "ask every running node of a job to save at its next step (before a drain); --wait for their commits",
    "prestage": "copy the checkpoint a node would resume from into a local tier, verified (an init container's step)",
    "inspect": "show a checkpoint's manifest: tensors, shapes, dtypes, sizes",
}


def serve(serve_args: list[str]) -> int:
    """Hand over to `python -P -m ckptstore.server` (its own interpreter: the client never imports server code).
    `-P` keeps the working folder off `sys.path`, so a `ckptstore.py` or `server.py` of the user's cannot
    stand in for ours."""
    os.execv(sys.executable, [sys.executable, "-P", "-m", "ckptstore.server", *serve_args])
    return EXIT_FAILURE  # not reached


# -- parser ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckptstore",
        description="Checkpoint store for ML training: run the service, query it, verify, gc, reindex, copy.",
        epilog="Exit codes: 0 ok, 1 failure, 2 usage, 3 not found. Docs: docs/cli.md.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    service = argparse.ArgumentParser(add_help=False)
    service.add_argument(
        "--url",
        default=os.environ.get("CKPTSTORE_URL", DEFAULT_URL),
        help=f"service URL (default: $CKPTSTORE_URL or {DEFAULT_URL})",
    )
    service.add_argument("--token", default=None, help="bearer token (default: $CKPTSTORE_TOKEN)")
    output = argparse.ArgumentParser(add_help=False)
    output.add_argument("--json", action="store_true", help="print JSON instead of text")

    def add(name: str, run: Callable[[argparse.Namespace], int], *, offline: bool = False) -> argparse.ArgumentParser:
        """A subcommand (its summary from SUMMARIES); it takes the service's options unless it works on
        storage alone (`offline`)."""
        parents = [output] if offline else [service, output]
        command = commands.add_parser(name, help=SUMMARIES[name], description=SUMMARIES[name], parents=parents)
        command.set_defaults(run=run)
        return command

    serve_command = commands.add_parser(
        "serve",
        help="run the metadata service (flags mirror CKPTSTORE_*; see `ckptstore serve --help`)",
        add_help=False,
    )
    serve_command.add_argument("serve_args", nargs=argparse.REMAINDER)
    serve_command.set_defaults(run=lambda args: serve(args.serve_args))

    jobs = add("jobs", cmd_jobs)
    jobs.add_argument("--limit", type=int, default=100, help="jobs per page (default 100)")
    jobs.add_argument("--offset", type=int, default=0, help="jobs to skip")
    declare = jobs.add_subparsers(dest="action", metavar="[declare]").add_parser(
        "declare", help="declare or update a job: its expected nodes, storage, retention", parents=[service, output]
    )
    declare.add_argument("job")
    declare.add_argument("--nodes", required=True, help="comma-separated node names, or a count N (node-0 … node-N-1)")
    declare.add_argument("--storage-root", default=None, help="durable storage root (default: the service's)")
    declare.add_argument("--local-root", default=None, help="the nodes' local tier (a path on each node)")
    declare.add_argument("--keep-last", type=int, default=None, help="retention: newest positions kept")

    epochs = add("epochs", cmd_epochs)
    epochs.add_argument("job")
    epochs.add_argument("--node", default=None, help="only this node")

    last_good = add("last-good", cmd_last_good)
    last_good.add_argument("job")
    last_good.add_argument("--max-epoch", type=int, default=None, help="the last good epoch at or below this one")

    verify = add("verify", cmd_verify)
    verify.add_argument("job")
    verify.add_argument("epoch", nargs="?", type=int, default=None, help="only this epoch (default: all)")
    verify.add_argument(
        "--tier",
        choices=["durable", "local"],
        default="durable",
        help="which copies: durable (default), or local (run it on the node that holds them)",
    )

    gc = add("gc", cmd_gc)
    gc.add_argument("job")
    gc.add_argument("--dry-run", action="store_true", help="list what would be deleted, delete nothing")

    reindex = add("reindex", cmd_reindex)
    reindex.add_argument("root", help="storage root, e.g. s3://ckpt/runs or /data/checkpoints")
    reindex.add_argument("--check", action="store_true", help="report differences, write nothing; exit 1 if any")

    copy = add("copy", cmd_copy, offline=True)
    copy.add_argument("src", help="<root>/<job> or <root>/<job>/<node>/<position>/<attempt>")
    copy.add_argument("dst", help="destination root (the same keys are used below it)")

    watch = add("watch", cmd_watch)
    watch.add_argument("job", nargs="?", default=None, help="only this job's events (default: every job's)")
    watch.add_argument("--since", type=int, default=None, help="start after this event id (default: from now on)")
    watch.add_argument("--types", default=None, help="comma-separated event types, e.g. position.good,copy.marked")
    watch.add_argument("--count", type=_positive, default=None, help="stop after this many events (1 or more)")

    diff = add("diff", cmd_diff)
    diff.add_argument("job")
    diff.add_argument("a", help="a position (EPOCH or EPOCH:BATCH) or a checkpoint location")
    diff.add_argument("b", help="the other one, the same way")
    diff.add_argument("--node", default=None, help="whose copies (default: the job's only node, or any)")

    checkpoint_now = add("checkpoint-now", cmd_checkpoint_now)
    checkpoint_now.add_argument("job")
    checkpoint_now.add_argument("--wait", action="store_true", help="return once every node committed (exit 1 if not)")
    checkpoint_now.add_argument("--timeout", type=float, default=300.0, help="seconds --wait waits (default 300)")
    checkpoint_now.add_argument("--reason", default=None, help="said on every node's log line and in the event")

    prestage = add("prestage", cmd_prestage)
    prestage.add_argument("job")
    prestage.add_argument(
        "--node", default=None, help="whose copy (default: this process's node, as training names it)"
    )
    prestage.add_argument("--to", required=True, help="the local tier root the training then uses (local_storage=)")

    inspect = add("inspect", cmd_inspect, offline=True)
    inspect.add_argument("uri", help="checkpoint location, e.g. s3://ckpt/runs/mnist/worker-0/0000000005/3")
    return parser


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _one_line(exc: ValueError) -> str:
    """A usage error in one line (a pydantic validation error names its first problem, not a dump)."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        return f"invalid {getattr(exc, 'title', 'value')}: {where + ': ' if where else ''}{first.get('msg', '')}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    # Imported here, not at the top: `ckptstore serve` hands over to a new interpreter without them.
    from ckptstore.errors import (
        CheckpointNotFoundError,
        CkptStoreError,
        RequestRejectedError,
        ServiceUnavailableError,
    )

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # everything after `serve`, --help included, is the service's
        return serve(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (CheckpointNotFoundError, NothingFound) as exc:
        print(f"not found: {exc}", file=sys.stderr)
        return EXIT_NOT_FOUND
    except ServiceUnavailableError as exc:
        print(f"error: the service at {args.url} cannot be used: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except RequestRejectedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE if exc.status in (400, 422) else EXIT_FAILURE
    except ValueError as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except (CkptStoreError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
