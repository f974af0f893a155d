"""A node's blob server in a process of its own, standing in for a peer (run as a subprocess):

    python -m tests.peer_server --root LOCAL_ROOT --service URL --job J --node NODE [--die-in-blob]

Serves LOCAL_ROOT as `ckptstore.client.peers` does, registers it as NODE's, prints `READY <url>`, and
serves until killed; --die-in-blob: SIGKILLs itself halfway through sending the first tensor blob
asked for (a peer that dies mid-transfer)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import threading


def die_mid_transfer() -> None:
    send = socket.socket.sendfile

    def sendfile(self, file, offset=0, count=None):  # type: ignore[no-untyped-def]
        if file.name.endswith(".safetensors") and count:
            send(self, file, offset, count // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        return send(self, file, offset, count)

    socket.socket.sendfile = sendfile  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--root", "--service", "--job", "--node"):
        parser.add_argument(name, required=True)
    parser.add_argument("--die-in-blob", action="store_true")
    args = parser.parse_args()
    if args.die_in_blob:
        die_mid_transfer()

    from ckptstore.client import ServiceClient
    from ckptstore.client.peers.blob_server import BlobServer

    server = BlobServer(args.root, args.job, host="127.0.0.1")
    with ServiceClient(args.service) as client:
        client.register_blob_server(args.job, args.node, server.url, server.token)
    print(f"READY {server.url}", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
