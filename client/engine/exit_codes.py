"""Exit codes a scheduler can act on: a training process that ckptstore refused ends with a code of its
own, not the 1 of any crash, so a Kubernetes `podFailurePolicy`, a JobSet `failurePolicy` or a Slurm
epilog can fail the job instead of restarting it into the same refusal (docs/operations.md):

    78  ConfigurationError    a set-up that can never work (missing bucket, a node outside the job, …)
    79  ResumeRefusedError    intact copies exist but none qualifies: a restart would retrain silently
    80  ResumeDriftError      resume_check="raise" and the resumed run is not the saved one
    81  FencedError           a newer attempt of this node runs: this process is a zombie

Every adapter installs the hook when it is created. It wraps `sys.excepthook`: the traceback is printed
as before, and only when the unhandled exception is one of these (or was raised from one) does the
process then run its exit handlers and end with the code. Any other exception ends it as Python does.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from types import TracebackType

from ckptstore.errors import ConfigurationError, FencedError, ResumeDriftError, ResumeRefusedError

__all__ = ["EXIT_CODES", "exit_code_of", "install_exit_codes"]

EXIT_CODES: dict[type[BaseException], int] = {
    ConfigurationError: 78,
    ResumeRefusedError: 79,
    ResumeDriftError: 80,
    FencedError: 81,
}
_installed = threading.Lock()
_previous: list[object] = []


def exit_code_of(exc: BaseException | None) -> int | None:
    """The exit code of a refusal: `exc`'s, or that of the exception it was raised from (frameworks
    re-raise a callback's error wrapped); None for anything else."""
    seen = 0
    while exc is not None and seen < 8:
        for kind, code in EXIT_CODES.items():
            if isinstance(exc, kind):
                return code
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def install_exit_codes() -> None:
    """Make an unhandled refusal end the process with its code (once per process; chains the hook
    that was there)."""
    with _installed:
        if _previous:
            return
        _previous.append(sys.excepthook)
        sys.excepthook = _hook


def _hook(kind: type[BaseException], exc: BaseException, traceback: TracebackType | None) -> None:
    previous = _previous[0]
    assert callable(previous)
    previous(kind, exc, traceback)
    code = exit_code_of(exc)
    if code is None:
        return
    atexit._run_exitfuncs()  # what the interpreter would run on its way out (saves' reports, logging)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
