"""When a training loop's `save()` saves: the cadence a manager (and the Keras callback) follows.

- `save_every=None` (the managers' default): every call saves — the loop says when;
- an int N: a call whose batch crosses a multiple of N since the last save of the epoch, and every
  end of epoch (Keras' `save_freq=N`: `steps_per_execution` may step over the multiple itself);
- `"epoch"`: ends of epochs only (Keras' default);
- `"continuous"`: whenever the previous save is off the loop's hands (committed on its first tier),
  so the loop may call `save()` every batch and a new save starts as soon as one can;
- `"auto"`: the interval the service recommends for the job (Young/Daly, `GET …/advice`), asked at
  start and every `ADVICE_REFRESH_S`, and every epoch's end (the last one is the final model). The
  recommendation is bounded below so that saving costs at most `MAX_OVERHEAD` of the time, and
  above by `save_every_seconds` when that is given: never slower than the user's own minimum;
- `save_every_seconds=S`: a call made S seconds or more after the last save began (beside N, or
  "epoch": either one makes a save due).

With a timed cadence the loop may call `save()` every batch: the manager decides, and `save()`
returns whether it saved.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Literal

from ckptstore import Position
from ckptstore.errors import CkptStoreError
from ckptstore.wire.schema import Advice

__all__ = ["SaveCadence", "SaveEvery", "MAX_OVERHEAD", "ADVICE_REFRESH_S"]

log = logging.getLogger("ckptstore.client")
SaveEvery = int | Literal["epoch", "auto", "continuous"] | None
MAX_OVERHEAD = 0.05  # the most of training's time "auto" lets saves block it
ADVICE_REFRESH_S = 300.0


class SaveCadence:
    """Says whether a save at a position is due (see the module docstring)."""

    def __init__(self, every: SaveEvery = None, every_seconds: float | None = None) -> None:
        if every not in (None, "epoch", "auto", "continuous") and (
            isinstance(every, bool) or not isinstance(every, int) or every < 1
        ):
            raise ValueError(
                f"save_every (Keras: save_freq) must be a positive integer, 'epoch', 'auto' or 'continuous', got {every!r}"
            )
        if every_seconds is not None and (
            isinstance(every_seconds, bool) or not isinstance(every_seconds, int | float) or not every_seconds > 0
        ):
            raise ValueError(f"save_every_seconds must be a positive number of seconds, got {every_seconds!r}")
        if every == "continuous" and every_seconds is not None:
            raise ValueError("save_every='continuous' saves as soon as it can: it takes no save_every_seconds")
        self.every, self.every_seconds = every, every_seconds
        self.advice: Advice | None = None  # the service's last recommendation ("auto")
        self._last_at = time.monotonic()  # when the last save began (or the clock started)
        self._last: Position | None = None  # the position of the last save (the resumed one at start)
        self._asked_at: float | None = None
        self._asking = threading.Lock()

    @property
    def timed(self) -> bool:
        """Whether a decision depends on the clock or on the writer, so that processes that save
        together must agree on it (the integer and epoch cadences are the same everywhere)."""
        return self.every in ("auto", "continuous") or self.every_seconds is not None

    def restart(self, resumed: Position | None) -> None:
        """The loop starts (at `resumed`, when it resumed): the clock of timed saves starts now."""
        self._last_at = time.monotonic()
        self._last = resumed

    def due(self, position: Position, *, writing: bool) -> bool:
        """Whether a save at `position` is due now (`writing`: a save is still in flight)."""
        every = self.every
        if every is None and self.every_seconds is None:
            return True
        if every == "continuous":
            return not writing
        if position.batch is None and (every in ("epoch", "auto") or isinstance(every, int)):
            return True  # every epoch's end: under "auto" too, so the newest epoch — the final model — is kept
        if isinstance(every, int) and position.batch is not None and position.batch >= self._next_multiple(position):
            return True
        return self._timer_due()

    def _next_multiple(self, position: Position) -> int:
        assert isinstance(self.every, int)
        last = self._last
        done = (last.batch or 0) if last is not None and last.epoch == position.epoch else 0
        return (done // self.every + 1) * self.every

    def _timer_due(self) -> bool:
        interval = self.interval_seconds()
        return interval is not None and time.monotonic() - self._last_at >= interval

    def saved(self, position: Position) -> None:
        """A save at `position` was due and began (or was skipped behind a failing one: the next is
        then due a whole interval later, not at once)."""
        self._last_at, self._last = time.monotonic(), position

    def _recommended(self) -> float | None:
        return None if self.advice is None else self.advice.interval_seconds

    def interval_seconds(self) -> float | None:
        """The seconds between timed saves now (None: no timed saves)."""
        if self.every != "auto":
            return self.every_seconds
        recommended = self._recommended()
        if recommended is None:
            return self.every_seconds
        assert self.advice is not None
        bounded = max(recommended, (self.advice.save_cost_seconds or 0.0) / MAX_OVERHEAD)
        return bounded if self.every_seconds is None else min(bounded, self.every_seconds)

    def refresh(self, ask: Callable[[], Advice], *, where: str) -> None:
        """Under "auto", ask the service for the job's advice on a daemon thread, when it was not asked in
        the last ADVICE_REFRESH_S (training never waits for it); a new interval is said on stderr."""
        now = time.monotonic()
        if self.every != "auto" or (self._asked_at is not None and now - self._asked_at < ADVICE_REFRESH_S):
            return
        self._asked_at = now
        threading.Thread(target=self._follow, args=(ask, where), name="ckptstore-advice", daemon=True).start()

    def _follow(self, ask: Callable[[], Advice], where: str) -> None:
        with self._asking:
            try:
                advice = ask()
            except CkptStoreError as exc:
                log.info("save_every='auto': no advice from the service (%s); the interval stays", exc)
                return
            before = self.interval_seconds()
            self.advice = advice
            after = self.interval_seconds()
            if advice.interval_seconds is not None and after != before:
                print(
                    f"ckptstore: {where}: save_every='auto' saves every {after:.1f} s (Young/Daly "
                    f"√(2 · {advice.save_cost_seconds:.3g} s save · {advice.mtbf_seconds:.0f} s between failures) "
                    f"= {advice.interval_seconds:.1f} s, from {advice.failures} failures, bounded to "
                    f"[cost / {MAX_OVERHEAD:g}, save_every_seconds])",
                    file=sys.stderr,
                    flush=True,
                )
