"""What each `ckptstore` subcommand does and prints (the parser and exit codes: client/cli/main.py).

Reads go through the service; storage operations work on real storage. Text for people, `--json`
for scripts; progress bars on a terminal only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

__all__ = [
    "EXIT_OK",
    "EXIT_FAILURE",
    "EXIT_USAGE",
    "EXIT_NOT_FOUND",
    "NothingFound",
    "cmd_jobs",
    "cmd_declare",
    "cmd_epochs",
    "cmd_last_good",
    "cmd_verify",
    "cmd_gc",
    "cmd_reindex",
    "cmd_watch",
    "cmd_checkpoint_now",
    "printable",
    "output",
    "progress_bar",
    "service_client",
]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_NOT_FOUND = 0, 1, 2, 3


class NothingFound(Exception):
    """A read found nothing to show (exit code 3)."""


# -- output helpers ----------------------------------------------------------------------------


def printable(text: str) -> str:
    """`text` with every control or format character escaped (`\\x1b`, `\\u202e`): job data shown on a
    terminal (a mark's reason, a health error — a job token can write both) must not drive the terminal."""
    return "".join(c if c.isprintable() or c == " " else c.encode("unicode_escape").decode("ascii") for c in text)


def output(args: argparse.Namespace, data: Any, text: Callable[[], list[str]]) -> None:
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        for line in text():
            print(printable(line))


def _when(timestamp: float | None) -> str:
    if timestamp is None:
        return "-"
    return datetime.fromtimestamp(timestamp, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _position(epoch: int | None, batch: int | None = None) -> str:
    if epoch is None:
        return "-"
    return f"{epoch}" if batch is None else f"{epoch}.b{batch}"


@contextmanager
def progress_bar(total: int, what: str) -> Iterator[Callable[[int], object]]:
    """A byte progress bar on stderr when it is a terminal; a no-op callback otherwise."""
    if not sys.stderr.isatty():
        yield lambda n: None
        return
    from tqdm import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, desc=what, file=sys.stderr, leave=False) as bar:
        yield bar.update


def service_client(args: argparse.Namespace):
    from ckptstore.client.service.rest import ServiceClient

    return ServiceClient(args.url, token=args.token)


# -- reads through the service -----------------------------------------------------------------


def cmd_jobs(args: argparse.Namespace) -> int:
    if args.action == "declare":
        return cmd_declare(args)
    with service_client(args) as client:
        jobs = client.list_jobs(limit=args.limit, offset=args.offset)
    rows = [j.model_dump(mode="json") for j in jobs]
    output(
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


def cmd_declare(args: argparse.Namespace) -> int:
    nodes = [f"node-{i}" for i in range(int(args.nodes))] if args.nodes.isdigit() else args.nodes.split(",")
    retention = None if args.keep_last is None else {"keep_last": args.keep_last}
    with service_client(args) as client:
        info = client.put_job(
            args.job, nodes, storage_root=args.storage_root, local_root=args.local_root, retention=retention
        )
    hint = (
        "; a training process is node-i when RANK=i, JOB_COMPLETION_INDEX=i or CKPTSTORE_NODE=node-i"
        if args.nodes.isdigit()
        else ""
    )
    output(
        args,
        info.model_dump(mode="json"),
        lambda: [f"{info.job}: nodes {', '.join(info.nodes)}; storage {info.storage_root}{hint}"],
    )
    return EXIT_OK


def cmd_epochs(args: argparse.Namespace) -> int:
    from ckptstore.client.service.operations import iter_records

    with service_client(args) as client:
        client.get_job(args.job)  # 404 → exit 3 even when the job has no checkpoint yet
        records = list(iter_records(client, args.job, node=args.node))
    output(
        args,
        [r.model_dump(mode="json") for r in records],
        lambda: (
            [f"{'NODE':16} {'POSITION':>12} {'ATTEMPT':>12} {'TIER':8} {'STATE':10} {'BYTES':>14}  CREATED  REASON"]
            + [
                f"{r.node:16} {_position(r.epoch, r.batch):>12} {r.attempt:>12} {r.tier:8} {r.state:10} "
                f"{r.bytes:14}  {_when(r.created_at)}  {r.reason or ''}".rstrip()
                for r in records
            ]
        ),
    )
    return EXIT_OK


def cmd_last_good(args: argparse.Namespace) -> int:
    with service_client(args) as client:
        answer = client.last_good_epoch(args.job, max_epoch=args.max_epoch)

    def text() -> list[str]:
        resume = answer.resume
        lines = [
            f"last good epoch: {_position(answer.epoch)}",
            f"durable epoch:   {_position(answer.durable_epoch)}",
            f"resume from:     {_position(resume.epoch, resume.batch) if resume else '-'}",
        ]
        for node, where in answer.nodes.items():
            tiers = ", ".join(f"{c.tier} {c.state}" for c in where.copies)
            lines.append(f"  {node}: {where.location}" + (f" ({tiers})" if tiers else ""))
        lines += [
            f"  not good: {_position(n.epoch, n.batch)} (missing: {', '.join(n.missing) or '-'}; "
            f"corrupt: {', '.join(n.corrupt) or '-'}; deleted: {', '.join(n.deleted) or '-'})"
            for n in answer.not_good
        ]
        return lines

    output(args, answer.model_dump(mode="json"), text)
    if answer.epoch is not None or answer.resume is not None:
        return EXIT_OK
    if _deleted_on_purpose(args):  # a finished job, not one without a good position yet
        print(f"{args.job}: every checkpoint was deleted on purpose (a finished fit, retention)", file=sys.stderr)
        return EXIT_OK
    return EXIT_NOT_FOUND


def _deleted_on_purpose(args: argparse.Namespace) -> bool:
    """Whether the job had checkpoints and all of them were deleted by retention, gc or a finished fit."""
    from ckptstore.client.service.operations import iter_records
    from ckptstore.wire.schema import DELETED_ON_PURPOSE

    with service_client(args) as client:
        records = list(iter_records(client, args.job))
    return bool(records) and all(r.state == "deleted" and r.cause in DELETED_ON_PURPOSE for r in records)


# -- operations on storage ---------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace) -> int:
    from ckptstore.client.service.operations import iter_records, verify_job

    with service_client(args) as client:
        records = list(iter_records(client, args.job, epoch=args.epoch, state="committed"))
        with progress_bar(sum(r.bytes for r in records), "verify") as progress:
            checked = verify_job(client, args.job, records, tier=args.tier, progress=progress)
    if not checked:
        at = "" if args.epoch is None else f" at epoch {args.epoch}"
        raise NothingFound(f"no committed {args.tier} copy of {args.job}{at}")
    rows = [
        {
            "node": c.record.node,
            "epoch": c.record.epoch,
            "batch": c.record.batch,
            "attempt": c.record.attempt,
            "tier": c.record.tier,
            "location": c.report.location,
            "ok": c.report.ok,
            "state": c.report.state,
            "bytes_checked": c.report.bytes_checked,
            "problems": [p.__dict__ for p in c.report.problems],
            "marked": c.marked,
        }
        for c in checked
    ]

    def text() -> list[str]:
        lines = []
        for c in checked:
            state = "ok" if c.report.ok else f"{c.report.state.upper()} (marked in the service)"
            lines.append(
                f"{c.record.node:16} {_position(c.record.epoch, c.record.batch):>12} {c.record.attempt:>12}  {state}"
            )
            lines += [f"    {p.kind}: {p.detail}" for p in c.report.problems]
        states = [c.report.state for c in checked]
        lines.append(
            f"{len(checked)} {args.tier} copies verified, {states.count('corrupt')} corrupt, "
            f"{states.count('missing')} missing"
        )
        return lines

    output(args, rows, text)
    return EXIT_FAILURE if any(not c.report.ok for c in checked) else EXIT_OK


def cmd_gc(args: argparse.Namespace) -> int:
    from ckptstore.client.service.operations import apply_retention

    with service_client(args) as client:
        deletions = apply_retention(client, args.job, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    output(
        args,
        [d.model_dump(mode="json") | {"position": _position(d.epoch, d.batch)} for d in deletions],
        lambda: (
            [f"{verb} {d.location} ({d.reason})" for d in deletions] + [f"{len(deletions)} checkpoint attempts {verb}"]
        ),
    )
    return EXIT_OK


def cmd_reindex(args: argparse.Namespace) -> int:
    from ckptstore.client.service.operations import reindex

    with service_client(args) as client:
        results = reindex(client, args.root, check=args.check)
    rows = [
        {
            "job": r.job,
            "created": r.created,
            "missing_in_service": [c.location for c in r.missing_in_service],
            "missing_on_storage": [c.location for c in r.missing_on_storage],
            "counters_behind": {n: {"service": s, "storage": t} for n, (s, t) in r.counters_behind.items()},
            "refused": r.refused,
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
            lines += [f"  refused (an attempt id no counter can follow): {location}" for location in r.refused]
        return lines or [f"no job under {args.root}"]

    output(args, rows, text)
    differences = any(r.differences for r in results)
    return EXIT_FAILURE if args.check and differences else EXIT_OK


# -- events ------------------------------------------------------------------------------------


def _event_line(event: Any) -> str:
    """One readable line: when, id, type, where, and the payload as key=value."""
    where = [f"job={event.job}"] if event.job else []
    where += [f"node={event.node}"] if event.node else []
    if event.position is not None:
        where.append(f"position={_position(event.position.epoch, event.position.batch)}")
    details = [
        f"{key}={json.dumps(value) if isinstance(value, (dict, list)) else value}" for key, value in event.data.items()
    ]
    return "  ".join(
        [_when(event.time), f"#{event.id}", f"{event.type:20}", " ".join(where), " ".join(details)]
    ).rstrip()


def cmd_watch(args: argparse.Namespace) -> int:
    types = [t.strip() for t in args.types.split(",") if t.strip()] if args.types else None
    seen = 0
    with service_client(args) as client:
        client.ping()  # a service that never answers is one line and exit 1, not silence
        try:
            for event in client.events(args.job, after=args.since, types=types):
                print(event.model_dump_json() if args.json else printable(_event_line(event)), flush=True)
                seen += 1
                if args.count is not None and seen >= args.count:
                    break
        except KeyboardInterrupt:
            pass
    return EXIT_OK


def cmd_checkpoint_now(args: argparse.Namespace) -> int:
    """Ask every running node of the job to save at its next step; with --wait, until each committed."""
    with service_client(args) as client:
        request = client.request_checkpoint(args.job, reason=args.reason)
        deadline = time.monotonic() + args.timeout
        while args.wait and request.pending and time.monotonic() < deadline:
            time.sleep(0.5)
            request = client.latest_checkpoint_request(args.job) or request

    def text() -> list[str]:
        made = "an earlier request, still pending" if request.coalesced else "requested"
        lines = [f"checkpoint {made} (request {request.id}) for {len(request.nodes)} node(s) of {args.job}"]
        if args.wait:
            done = [node for node in request.nodes if node not in request.pending]
            lines.append(f"committed since: {', '.join(done) or '-'}")
            if request.pending:
                lines.append(f"not committed after {args.timeout:g} s: {', '.join(request.pending)}")
        return lines

    output(args, request.model_dump(mode="json"), text)
    return EXIT_FAILURE if args.wait and request.pending else EXIT_OK
