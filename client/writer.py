"""A background writer: at most one save in flight; its error surfaces on the next call."""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["BackgroundWriter"]


class BackgroundWriter:
    """Runs one job at a time on a daemon thread. `submit` waits for the previous job first."""

    def __init__(self, name: str = "ckptstore-writer"):
        self._name = name
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, job: Callable[[], None]) -> None:
        self.wait()

        def run() -> None:
            try:
                job()
            except BaseException as exc:  # kept for the caller: re-raised by wait()
                self._error = exc

        self._thread = threading.Thread(target=run, name=self._name, daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Block until the save in flight is done; raise its error, if any, once."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
