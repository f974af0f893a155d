"""The `ckptstore` command line. Exit codes: 0 ok, 1 failure, 2 usage, 3 not found."""

from __future__ import annotations

import argparse
import json
import os
import sys

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_NOT_FOUND = 0, 1, 2, 3


def _split_checkpoint_uri(uri: str) -> tuple[str, str, str, int, int | None, str]:
    """`<root>/<job>/<node>/<position>/<attempt>` → (root, job, node, epoch, batch, attempt)."""
    from ckptstore.layout import parse_position_dirname

    parts = uri.rstrip("/").rsplit("/", 4)
    if len(parts) != 5 or (position := parse_position_dirname(parts[3])) is None:
        raise ValueError(f"{uri!r} is not a checkpoint location <root>/<job>/<node>/<epoch>[.b<batch>]/<attempt>")
    root, job, node, _, attempt = parts
    return root, job, node, position.epoch, position.batch, attempt


def cmd_inspect(args: argparse.Namespace) -> int:
    from ckptstore import Store

    root, job, node, epoch, batch, attempt = _split_checkpoint_uri(args.uri)
    manifest = Store(root).manifest(job, node, epoch, batch=batch, attempt=attempt)
    if args.json:
        print(json.dumps(json.loads(manifest.to_json()), indent=2))
        return EXIT_OK
    print(f"{job}/{node} {manifest.position} attempt {manifest.attempt} step {manifest.step}")
    print(f"{len(manifest.tensors)} tensors in {len(manifest.shards)} shards, {manifest.total_bytes} bytes")
    for tensor in manifest.tensors:
        print(f"  {tensor.name:40s} {tensor.dtype:5s} {list(tensor.shape)!s:20s} {tensor.nbytes} B")
    if manifest.metadata:
        print(f"metadata: {json.dumps(manifest.metadata)}")
    return EXIT_OK


def cmd_serve(args: argparse.Namespace) -> int:
    # The service runs in its own interpreter: the client never imports server code.
    os.execv(sys.executable, [sys.executable, "-m", "server", *args.serve_args])
    return EXIT_FAILURE  # not reached


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckptstore", description="Checkpoint store for ML training.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the metadata service (see `ckptstore serve --help`)", add_help=False)
    serve.add_argument("serve_args", nargs=argparse.REMAINDER)
    serve.set_defaults(run=cmd_serve)
    inspect = commands.add_parser("inspect", help="show a checkpoint's manifest: tensors, shapes, dtypes, sizes")
    inspect.add_argument("uri", help="checkpoint location, e.g. s3://ckpt/runs/mnist/worker-0/0000000005/3")
    inspect.add_argument("--json", action="store_true", help="print the manifest as JSON")
    inspect.set_defaults(run=cmd_inspect)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Imported here, not at the top: `ckptstore serve` hands over to a new interpreter without them.
    from ckptstore import CheckpointNotFoundError, CkptStoreError

    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except CheckpointNotFoundError as exc:
        print(f"not found: {exc}", file=sys.stderr)
        return EXIT_NOT_FOUND
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (CkptStoreError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
