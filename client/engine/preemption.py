"""SIGTERM as a preemption notice: note it, let the trainer checkpoint at the next batch boundary
within a time budget, then exit the way SIGTERM would have."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

__all__ = ["PreemptionNotice"]


class PreemptionNotice:
    """Installs a SIGTERM handler (main thread only) that records when the notice arrived."""

    def __init__(self, budget_s: float = 30.0):
        self.budget_s = budget_s
        self.received_at: float | None = None
        self._previous: Any = None
        self._installed = False

    def install(self) -> None:
        if not self._installed and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True

    def _handle(self, signum: int, frame: Any) -> None:
        self.received_at = time.monotonic()

    @property
    def pending(self) -> bool:
        return self.received_at is not None

    @property
    def within_budget(self) -> bool:
        return self.received_at is not None and time.monotonic() - self.received_at < self.budget_s

    def uninstall(self) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False

    def exit(self) -> None:
        """Restore the previous handler and deliver SIGTERM again: the process ends as it would have."""
        self.uninstall()
        os.kill(os.getpid(), signal.SIGTERM)
