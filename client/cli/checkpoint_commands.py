"""The CLI commands that read checkpoints themselves, on storage: `copy`, `inspect`, `diff` and
`prestage` (the last two ask the service only where a copy of a position is)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ckptstore.client.cli.commands import (
    EXIT_FAILURE,
    EXIT_OK,
    NothingFound,
    output,
    printable,
    progress_bar,
    service_client,
)

__all__ = ["cmd_copy", "cmd_inspect", "cmd_diff", "cmd_prestage"]


def cmd_copy(args: argparse.Namespace) -> int:
    from ckptstore.client.service.operations import copy

    with progress_bar(0, "copy") as progress:
        results = copy(args.src, args.dst, progress=progress)
    copied = [(c, c.destination) for c in results if c.destination is not None]
    failed = [c for c in results if c.destination is None]
    output(
        args,
        [
            {"source": c.source, "destination": d and d.location, "bytes": d and d.bytes, "error": c.error}
            for c, d in [(c, c.destination) for c in results]
        ],
        lambda: (
            [f"{c.source} -> {d.location} (verified)" for c, d in copied]
            + [f"{c.source} NOT COPIED: {c.error}" for c in failed]
            + [
                f"{len(copied)} checkpoints copied, {sum(d.bytes for _, d in copied)} bytes"
                + (f"; {len(failed)} not copied (their source does not verify)" if failed else "")
            ]
        ),
    )
    return EXIT_FAILURE if failed else EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    from ckptstore import Store
    from ckptstore.client.service.operations import split_location
    from ckptstore.errors import CorruptCheckpointError

    root, job, copy = split_location(args.uri)
    if copy is None:
        raise ValueError(f"{args.uri!r} is not a checkpoint location <root>/<job>/<node>/<position>/<attempt>")
    try:
        manifest = Store(root).manifest(copy)
    except CorruptCheckpointError as exc:  # a manifest that does not verify: that copy is not committed
        raise NothingFound(f"{args.uri} is not committed: {exc}") from None

    def text() -> list[str]:
        lines = [
            f"{job}/{copy.node} position {manifest.position} attempt {manifest.attempt} step {manifest.step}",
            f"{len(manifest.tensors)} tensors in {len(manifest.shards)} shards, {manifest.total_bytes} bytes, "
            f"created {manifest.created_at}",
        ]
        lines += [f"  {t.name:40s} {t.dtype:5s} {list(t.shape)!s:20s} {t.nbytes} B" for t in manifest.tensors]
        if manifest.metadata:
            lines.append(f"metadata: {json.dumps(manifest.metadata)}")
        return lines

    output(args, json.loads(manifest.to_json()), text)
    return EXIT_OK


def _fingerprint_at(args: argparse.Namespace, where: str) -> tuple[str, dict[str, Any]]:
    """The fingerprint of a copy: `where` is a checkpoint location, or a position of `args.job`
    (`EPOCH` or `EPOCH:BATCH`) whose newest durable committed copy the service knows (of `--node`)."""
    from ckptstore import Position, Store
    from ckptstore.client.service.operations import iter_records, split_location
    from ckptstore.fingerprint import FINGERPRINT_KEY

    if "/" not in where:
        epoch, _, batch = where.partition(":")
        position = Position(int(epoch), int(batch) if batch else None)
        with service_client(args) as client:
            records = [
                r
                for r in iter_records(client, args.job, node=args.node, epoch=position.epoch, state="committed")
                if r.key.position == position and r.tier == "durable"
            ]
        if not records:
            raise NothingFound(f"{args.job} has no committed durable copy at {position}")
        where = max(records, key=lambda r: r.created_at).location
    root, _, copy = split_location(where)
    if copy is None:
        raise ValueError(f"{where!r} is not a position (EPOCH or EPOCH:BATCH) nor a checkpoint location")
    fingerprint = Store(root).manifest(copy).metadata.get(FINGERPRINT_KEY)
    if not isinstance(fingerprint, dict):
        raise NothingFound(f"{where} has no fingerprint (written before ckptstore recorded them)")
    return where, fingerprint


def cmd_diff(args: argparse.Namespace) -> int:
    from ckptstore.fingerprint import differences

    (a, saved), (b, live) = _fingerprint_at(args, args.a), _fingerprint_at(args, args.b)
    found = differences(saved, live)
    output(
        args,
        {"a": a, "b": b, "differences": found},
        lambda: (
            [f"{printable(a)} -> {printable(b)}: {'the same run' if not found else f'{len(found)} difference(s)'}"]
            + [f"  - {printable(d)}" for d in found]
        ),
    )
    return EXIT_FAILURE if found else EXIT_OK


def cmd_prestage(args: argparse.Namespace) -> int:
    """Stage the copy a node would resume from into a local tier root (an init container's job)."""
    from ckptstore.client.engine.identity import resolve_identity
    from ckptstore.client.service.operations import prestage

    node = resolve_identity(args.node).checkpoint_node
    with service_client(args) as client, progress_bar(0, "prestage") as progress:
        staged = prestage(client, args.job, node, args.to, progress=progress)
    if staged is None:
        output(
            args,
            {"job": args.job, "node": node, "staged": None},
            lambda: [f"{args.job}/{node}: nothing to stage: the job has no resume position yet"],
        )
        return EXIT_OK
    ref = staged.destination
    assert ref is not None
    output(
        args,
        {"job": args.job, "node": node, "source": staged.source, "staged": ref.location, "bytes": ref.bytes},
        lambda: [f"{args.job}/{node}: {staged.source} -> {ref.location} ({ref.bytes} bytes, verified)"],
    )
    return EXIT_OK
