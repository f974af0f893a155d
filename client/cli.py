"""The `ckptstore` command line: one entry point, a subcommand per task (docs/cli.md).

Exit codes: 0 ok, 1 failure (including corruption found and differences found by `reindex --check`),
2 usage (bad arguments or names), 3 not found. Every read takes `--json`; progress bars appear
on a terminal only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_NOT_FOUND = 0, 1, 2, 3
DEFAULT_URL = "http://127.0.0.1:8080"


class NothingFound(Exception):
    """A read found nothing to show (exit code 3)."""


# -- output helpers ----------------------------------------------------------------------------


def _emit(args: argparse.Namespace, data: Any, text: Callable[[], list[str]]) -> None:
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        for line in text():
            print(line)


def _when(timestamp: float | None) -> str:
    if timestamp is None:
        return "-"
    return datetime.fromtimestamp(timestamp, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _position(epoch: int | None, batch: int | None = None) -> str:
    if epoch is None:
        return "-"
    return f"{epoch}" if batch is None else f"{epoch}.b{batch}"


@contextmanager
def _progress(total: int, what: str):
    """A byte progress bar on stderr when it is a terminal; a no-op callback otherwise."""
    if not sys.stderr.isatty():
        yield lambda n: None
        return
    from tqdm import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, desc=what, file=sys.stderr, leave=False) as bar:
        yield bar.update


def _client(args: argparse.Namespace):
    from client.service import ServiceClient

    return ServiceClient(args.url, token=args.token)


# -- reads through the service -----------------------------------------------------------------


def cmd_jobs(args: argparse.Namespace) -> int:
    with _client(args) as client:
        jobs = client.list_jobs(limit=args.limit, offset=args.offset)
    rows = [j.model_dump(mode="json") for j in jobs]
    _emit(
        args,
        rows,
        lambda: (
            [f"{'JOB':24} {'NODES':>5} {'LAST GOOD':>9} {'RESUME':>10}  STORAGE"]
            + [
                f"{j.job:24} {len(j.nodes):5} {_position(j.last_good_epoch):>9} "
                f"{_position(j.resume.epoch, j.resume.batch) if j.resume else '-':>10}  {j.storage_root}"
                for j in jobs
            ]
        ),
    )
    return EXIT_OK


def cmd_epochs(args: argparse.Namespace) -> int:
    from client.operations import iter_records

    with _client(args) as client:
        client.get_job(args.job)  # 404 → exit 3 even when the job has no checkpoint yet
        records = list(iter_records(client, args.job, node=args.node))
    _emit(
        args,
        [r.model_dump(mode="json") for r in records],
        lambda: (
            [f"{'NODE':16} {'POSITION':>12} {'ATTEMPT':>12} {'STATE':10} {'BYTES':>14}  CREATED"]
            + [
                f"{r.node:16} {_position(r.epoch, r.batch):>12} {r.attempt:>12} {r.state:10} {r.bytes:14}  "
                f"{_when(r.created_at)}"
                for r in records
            ]
        ),
    )
    return EXIT_OK


def cmd_last_good(args: argparse.Namespace) -> int:
    with _client(args) as client:
        answer = client.last_good_epoch(args.job, max_epoch=args.max_epoch)

    def text() -> list[str]:
        resume = answer.resume
        lines = [
            f"last good epoch: {_position(answer.epoch)}",
            f"resume from:     {_position(resume.epoch, resume.batch) if resume else '-'}",
        ]
        lines += [f"  {node}: {where.location}" for node, where in answer.nodes.items()]
        lines += [
            f"  not good: {_position(n.epoch, n.batch)} (missing: {', '.join(n.missing) or '-'}; "
            f"corrupt: {', '.join(n.corrupt) or '-'})"
            for n in answer.not_good
        ]
        return lines

    _emit(args, answer.model_dump(mode="json"), text)
    return EXIT_OK if answer.epoch is not None or answer.resume is not None else EXIT_NOT_FOUND


# -- operations on storage ---------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace) -> int:
    from client.operations import iter_records, verify_job

    with _client(args) as client:
        records = list(iter_records(client, args.job, epoch=args.epoch, state="committed"))
        with _progress(sum(r.bytes for r in records), "verify") as progress:
            checked = verify_job(client, args.job, records, progress=progress)
    if not checked:
        at = "" if args.epoch is None else f" at epoch {args.epoch}"
        raise NothingFound(f"no committed checkpoint of {args.job}{at}")
    rows = [
        {
            "node": c.record.node,
            "epoch": c.record.epoch,
            "batch": c.record.batch,
            "attempt": c.record.attempt,
            "location": c.report.location,
            "ok": c.report.ok,
            "bytes_checked": c.report.bytes_checked,
            "problems": [p.__dict__ for p in c.report.problems],
            "marked_corrupt": c.marked_corrupt,
        }
        for c in checked
    ]

    def text() -> list[str]:
        lines = []
        for c in checked:
            state = "ok" if c.report.ok else "CORRUPT (marked in the service)"
            lines.append(
                f"{c.record.node:16} {_position(c.record.epoch, c.record.batch):>12} {c.record.attempt:>12}  {state}"
            )
            lines += [f"    {p.kind}: {p.detail}" for p in c.report.problems]
        bad = sum(not c.report.ok for c in checked)
        lines.append(f"{len(checked)} checkpoints verified, {bad} corrupt")
        return lines

    _emit(args, rows, text)
    return EXIT_FAILURE if any(not c.report.ok for c in checked) else EXIT_OK


def cmd_gc(args: argparse.Namespace) -> int:
    from client.operations import collect_garbage

    with _client(args) as client:
        removals = collect_garbage(client, args.job, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    _emit(
        args,
        [r.__dict__ | {"position": _position(r.position.epoch, r.position.batch)} for r in removals],
        lambda: (
            [f"{verb} {r.location} ({r.reason})" for r in removals] + [f"{len(removals)} checkpoint attempts {verb}"]
        ),
    )
    return EXIT_OK


def cmd_reindex(args: argparse.Namespace) -> int:
    from client.operations import reindex

    with _client(args) as client:
        results = reindex(client, args.root, check=args.check)
    rows = [
        {
            "job": r.job,
            "created": r.created,
            "missing_in_service": [c.location for c in r.missing_in_service],
            "missing_on_storage": [c.location for c in r.missing_on_storage],
            "counters_behind": {n: {"service": s, "storage": t} for n, (s, t) in r.counters_behind.items()},
            "applied": r.applied,
        }
        for r in results
    ]

    def text() -> list[str]:
        lines = []
        for r in results:
            done = "" if args.check or not r.differences else " (fixed)"
            lines.append(f"{r.job}: {r.differences} difference(s){done}")
            if r.created:
                lines.append("  job unknown to the service")
            lines += [f"  not in the service: {c.location}" for c in r.missing_in_service]
            lines += [f"  in the service but not on storage (left as is): {c.location}" for c in r.missing_on_storage]
            lines += [f"  attempt counter of {n}: service {s}, storage {t}" for n, (s, t) in r.counters_behind.items()]
        return lines or [f"no job under {args.root}"]

    _emit(args, rows, text)
    differences = any(r.differences for r in results)
    return EXIT_FAILURE if args.check and differences else EXIT_OK


def cmd_copy(args: argparse.Namespace) -> int:
    from client.operations import copy

    with _progress(0, "copy") as progress:
        copied = copy(args.src, args.dst, progress=progress)
    _emit(
        args,
        [{"source": c.source, "destination": c.destination.location, "bytes": c.destination.bytes} for c in copied],
        lambda: (
            [f"{c.source} -> {c.destination.location} (verified)" for c in copied]
            + [f"{len(copied)} checkpoints copied, {sum(c.destination.bytes for c in copied)} bytes"]
        ),
    )
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    from ckptstore import Store
    from client.operations import split_location

    root, job, one = split_location(args.uri)
    if one is None:
        raise ValueError(f"{args.uri!r} is not a checkpoint location <root>/<job>/<node>/<position>/<attempt>")
    node, position, attempt = one
    manifest = Store(root).manifest(job, node, position.epoch, batch=position.batch, attempt=attempt)

    def text() -> list[str]:
        lines = [
            f"{job}/{node} position {manifest.position} attempt {manifest.attempt} step {manifest.step}",
            f"{len(manifest.tensors)} tensors in {len(manifest.shards)} shards, {manifest.total_bytes} bytes, "
            f"created {manifest.created_at}",
        ]
        lines += [f"  {t.name:40s} {t.dtype:5s} {list(t.shape)!s:20s} {t.nbytes} B" for t in manifest.tensors]
        if manifest.metadata:
            lines.append(f"metadata: {json.dumps(manifest.metadata)}")
        return lines

    _emit(args, json.loads(manifest.to_json()), text)
    return EXIT_OK


def serve(serve_args: list[str]) -> int:
    """Hand over to `python -m server` (its own interpreter: the client never imports server code)."""
    os.execv(sys.executable, [sys.executable, "-m", "server", *serve_args])
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

    def add(name: str, run: Callable[[argparse.Namespace], int], help: str, *parents: argparse.ArgumentParser):
        command = commands.add_parser(name, help=help, description=help, parents=list(parents))
        command.set_defaults(run=run)
        return command

    serve_command = commands.add_parser(
        "serve",
        help="run the metadata service (flags mirror CKPTSTORE_*; see `ckptstore serve --help`)",
        add_help=False,
    )
    serve_command.add_argument("serve_args", nargs=argparse.REMAINDER)
    serve_command.set_defaults(run=lambda args: serve(args.serve_args))

    jobs = add("jobs", cmd_jobs, "list jobs with their last good epoch and resume position", service, output)
    jobs.add_argument("--limit", type=int, default=100, help="jobs per page (default 100)")
    jobs.add_argument("--offset", type=int, default=0, help="jobs to skip")

    epochs = add(
        "epochs", cmd_epochs, "list a job's checkpoint records: node, position, attempt, state", service, output
    )
    epochs.add_argument("job")
    epochs.add_argument("--node", default=None, help="only this node")

    last_good = add("last-good", cmd_last_good, "the last good epoch and resume position of a job", service, output)
    last_good.add_argument("job")
    last_good.add_argument("--max-epoch", type=int, default=None, help="the last good epoch at or below this one")

    verify = add(
        "verify",
        cmd_verify,
        "check every shard and tensor checksum of every node; mark corrupt records; exit 1 on corruption",
        service,
        output,
    )
    verify.add_argument("job")
    verify.add_argument("epoch", nargs="?", type=int, default=None, help="only this epoch (default: all)")

    gc = add(
        "gc",
        cmd_gc,
        "execute the job's retention plan for all nodes, plus uncommitted leftovers and superseded attempts",
        service,
        output,
    )
    gc.add_argument("job")
    gc.add_argument("--dry-run", action="store_true", help="list what would be deleted, delete nothing")

    reindex = add(
        "reindex",
        cmd_reindex,
        "rebuild the service's records and attempt counters from the manifests under a storage root",
        service,
        output,
    )
    reindex.add_argument("root", help="storage root, e.g. s3://ckpt/runs or /data/checkpoints")
    reindex.add_argument("--check", action="store_true", help="report differences, write nothing; exit 1 if any")

    copy = add("copy", cmd_copy, "copy a checkpoint or a whole job to another root, verified on arrival", output)
    copy.add_argument("src", help="<root>/<job> or <root>/<job>/<node>/<position>/<attempt>")
    copy.add_argument("dst", help="destination root (the same keys are used below it)")

    inspect = add("inspect", cmd_inspect, "show a checkpoint's manifest: tensors, shapes, dtypes, sizes", output)
    inspect.add_argument("uri", help="checkpoint location, e.g. s3://ckpt/runs/mnist/worker-0/0000000005/3")
    return parser


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
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (CkptStoreError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
