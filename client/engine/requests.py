"""Checkpoint requests on a node: "save now", asked of the whole job (`ckptstore checkpoint-now`, `POST
/v1/jobs/{job}/checkpoint-requests`), taken at the training's next step.

A daemon thread follows the job's `checkpoint.requested` events on the service's event stream (one
long-lived connection: training never asks the service per step). It first reads the job's newest
request, so that one made while this process started is not missed, then follows the stream after it.
The training side only reads a flag (`pending`); the save that follows clears it (`done`).
"""

from __future__ import annotations

import logging
import sys
import threading

from ckptstore.client.service.rest import ServiceClient
from ckptstore.errors import CkptStoreError

__all__ = ["CheckpointRequests"]

log = logging.getLogger("ckptstore.client")
REQUESTED = "checkpoint.requested"


class CheckpointRequests:
    """Follows one job's checkpoint requests for one node, on a client of its own."""

    def __init__(self, client: ServiceClient, job: str, node: str):
        self._client, self.job, self.node = client, job, node
        self._pending = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="ckptstore-requests", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> bool:
        """Whether a request waits for this node's next save."""
        return self._pending.is_set()

    def done(self) -> None:
        """A save began: the request is answered (its commit shows in the request's `pending`)."""
        self._pending.clear()

    def close(self) -> None:
        self._closed.set()
        self._client.close()  # ends the stream the thread reads

    def _follow(self) -> None:
        try:
            latest = self._client.latest_checkpoint_request(self.job)
            if latest is not None and self.node in latest.pending:
                self._asked(latest.reason)
            after = 0 if latest is None else latest.id
            for event in self._client.events(self.job, after=after, types=[REQUESTED]):
                if self._closed.is_set():
                    return
                if self.node in event.data.get("nodes", {self.node: None}):
                    self._asked(event.data.get("reason"))
        except (CkptStoreError, RuntimeError, OSError) as exc:  # RuntimeError: the client closed under it
            if not self._closed.is_set():
                log.warning("%s/%s: checkpoint requests are not followed (%s)", self.job, self.node, exc)

    def _asked(self, reason: str | None) -> None:
        why = f" ({reason})" if reason else ""
        print(
            f"ckptstore: {self.job}/{self.node}: checkpoint requested{why}: saving at the next step",
            file=sys.stderr,
            flush=True,
        )
        self._pending.set()
