"""The live view of a run in the terminal: step, reward, throughput, staleness, eval, elapsed.

On a terminal it is a small rich table redrawn in place. When stdout is not a terminal (CI, a
log file, `nohup`) or `enabled=False`, it prints one compact plain line to stderr instead, at
most every `interval_s` seconds, plus the last row on exit, so logs stay short and greppable:

    step 12/100 | reward 0.412 (mean20 0.380) | 35.2 samples/s | stale 0.8/2 | eval 0.550 | 0:01:23

Feed it the metrics rows the controller writes (keys in `observe.logs`); any key may be absent.

    with Progress(total_steps=100) as progress:
        for row in rows:
            progress.update(row)
"""

from __future__ import annotations

import collections
import math
import sys
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["Progress"]


def _number(row: dict[str, Any], key: str) -> float | None:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return None
    return float(value)


def _elapsed(seconds: float) -> str:
    whole = int(seconds)
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


class Progress:
    """Live progress of a run; `update(row)` once per train step. A context manager.

    total_steps: shown as `step/total` when given.
    enabled: False forces the plain-line mode even on a terminal.
    interval_s: the least time between two plain lines.
    window: how many steps the reward's moving mean covers.
    stream: where plain lines go (default: sys.stderr at the time of printing).
    clock: monotonic seconds; injectable so tests need not sleep.
    """

    def __init__(self, total_steps: int | None = None, *, enabled: bool = True, interval_s: float = 10.0,
                 window: int = 20, stream: IO[str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if window < 1:
            raise ValueError(f"Progress(window={window}): the moving mean needs a window of at least 1")
        self.total_steps = total_steps
        self.enabled = enabled
        self.interval_s = interval_s
        self.window = window
        self._stream = stream
        self._clock = clock
        self._started_s = clock()
        self._rewards: collections.deque[float] = collections.deque(maxlen=window)
        self._state: dict[str, float | None] = {}
        self._eval_score: float | None = None
        self._last_print_s: float | None = None
        self._unprinted = False
        self._live: Any = None  # rich.live.Live while the live view runs

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> Self:
        if self.enabled and sys.stdout.isatty() and self._live is None:
            from rich.live import Live  # only the live view needs rich

            self._live = Live(self._table(), refresh_per_second=4, transient=False)
            self._live.start()
        return self

    def stop(self) -> None:
        """Stop the live view, or print the last row not yet printed. Safe to call twice."""
        live, self._live = self._live, None
        if live is not None:
            live.stop()
        elif self._unprinted:
            self._print_line()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        # Also on KeyboardInterrupt: the terminal gets its cursor back before the traceback.
        self.stop()

    # --- updates ---------------------------------------------------------------------------------

    def update(self, row: dict[str, Any]) -> None:
        reward = _number(row, "reward_mean")
        if reward is not None:
            self._rewards.append(reward)
        eval_score = _number(row, "eval_score")
        if eval_score is not None:
            self._eval_score = eval_score
        self._state = {key: _number(row, key) for key in
                       ("step", "wall_s", "reward_mean", "samples_per_s", "staleness_mean", "staleness_max")}
        if self._live is not None:
            self._live.update(self._table())
            return
        now = self._clock()
        if self._last_print_s is None or now - self._last_print_s >= self.interval_s:
            self._print_line()
        else:
            self._unprinted = True

    def line(self) -> str:
        """The compact one-line summary of the latest row."""
        return " | ".join(f"{name} {value}" if name in ("step", "reward", "stale", "eval") else value
                          for name, value in self._fields())

    # --- rendering -------------------------------------------------------------------------------

    def _fields(self) -> list[tuple[str, str]]:
        s = self._state

        def fmt(value: float | None, spec: str) -> str:
            return "-" if value is None else format(value, spec)

        step = fmt(s.get("step"), ".0f")
        if self.total_steps is not None:
            step = f"{step}/{self.total_steps}"
        reward = fmt(s.get("reward_mean"), ".3f")
        if self._rewards:
            reward += f" (mean{len(self._rewards)} {sum(self._rewards) / len(self._rewards):.3f})"
        elapsed_s = s.get("wall_s")
        if elapsed_s is None:
            elapsed_s = self._clock() - self._started_s
        return [
            ("step", step),
            ("reward", reward),
            ("samples/s", f"{fmt(s.get('samples_per_s'), '.1f')} samples/s"),
            ("stale", f"{fmt(s.get('staleness_mean'), '.1f')}/{fmt(s.get('staleness_max'), '.0f')}"),
            ("eval", fmt(self._eval_score, ".3f")),
            ("elapsed", _elapsed(elapsed_s)),
        ]

    def _print_line(self) -> None:
        stream = self._stream if self._stream is not None else sys.stderr
        print(self.line(), file=stream, flush=True)
        self._last_print_s = self._clock()
        self._unprinted = False

    def _table(self) -> Any:
        from rich.table import Table

        table = Table(box=None, padding=(0, 2), show_edge=False)
        fields = self._fields()
        for name, _ in fields:
            table.add_column(name, justify="right" if name != "elapsed" else "left")
        table.add_row(*(value.removesuffix(" samples/s") for _, value in fields))
        return table
