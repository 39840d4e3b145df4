"""The live view of a run in the terminal: phase, step, reward or loss, throughput, eval, elapsed, ETA.

On a terminal it is a small rich table redrawn in place, with a status line under it. When stdout
is not a terminal (CI, a log file, `nohup`) or `enabled=False`, it prints one compact plain line
to stderr instead, at most every `interval_s` seconds, plus the last row on exit, so logs stay
short and greppable:

    [setup] loading the model and starting 2 engines
    [SFT] step 40/300 | loss 1.204 (avg of last 20: 1.310) | eval 0.120 | 0:00:41 | ETA 0:04:27
    [RL] evaluating step 0
    [RL] step 12/100 | reward 0.412 (avg of last 20: 0.380) | 35.2 samples/s | stale 0.8/2 | eval 0.550 | 0:01:23 | ETA 0:10:04

The phase is "SFT" (the warm start, `miles-async sft`) or "RL", set with `set_phase` (or for a
`with` block, `in_phase`); before the first phase, "setup". `status(text)` says what the run is doing between steps (loading the model,
starting engines, evaluating, saving a checkpoint): printed at once off a terminal, shown under
the table on one, cleared by the next row. The ETA is the mean time per step over the last
`window` steps of the phase times the steps left.

Feed it the metrics rows the controller writes (names in `observe.names`); any key may be absent.

    with Progress(total_steps=100) as progress:
        progress.status("starting engines")
        for row in rows:
            progress.update(row)
"""

from __future__ import annotations

import collections
import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterator
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["Progress"]

# (label, metrics key, format) of each phase's fields after the step and its headline with its
# moving average. Fields marked optional show only once their key was seen in the phase.
_HEADLINE = {"RL": ("reward", "rollout/reward_mean"), "SFT": ("loss", "train/loss")}
_FIELDS: dict[str, list[tuple[str, str, str, bool]]] = {
    "RL": [("samples/s", "perf/samples_per_s", ".1f", False), ("eval", "eval/score", ".3f", False)],
    "SFT": [("tokens/s", "perf/tokens_per_s", ",.0f", True), ("epoch", "train/epoch", ".2f", True),
            ("held-out loss", "eval/heldout_loss", ".4f", True), ("eval", "eval/score", ".3f", True)],
}
# Fields that persist between rows (an eval is not in every row): the latest value seen is shown.
_STICKY = ("eval/score", "eval/heldout_loss")


def _number(row: dict[str, Any], key: str) -> float | None:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return None
    return float(value)


def _clock_text(seconds: float) -> str:
    whole = int(max(seconds, 0.0))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


class Progress:
    """Live progress of a run; `update(row)` once per train step. A context manager.

    total_steps: shown as `step/total` (and the ETA) when given.
    phase: "RL" or "SFT" (the fields shown depend on it); "setup" until a phase starts.
    enabled: False forces the plain-line mode even on a terminal.
    silent: print nothing at all (a quiet run); rows are still taken.
    interval_s: the least time between two plain lines.
    window: how many steps the moving average and the ETA cover.
    stream: where plain lines go (default: sys.stderr at the time of printing).
    clock: monotonic seconds; injectable so tests need not sleep.
    """

    def __init__(self, total_steps: int | None = None, *, phase: str = "RL", enabled: bool = True,
                 silent: bool = False, interval_s: float = 10.0, window: int = 20, stream: IO[str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if window < 1:
            raise ValueError(f"Progress(window={window}): the moving average needs a window of at least 1")
        self.enabled = enabled
        self.silent = silent
        self.interval_s = interval_s
        self.window = window
        self._stream = stream
        self._clock = clock
        self._started_s = clock()
        self._last_print_s: float | None = None
        self._unprinted = False
        self._live: Any = None  # rich.live.Live while the live view runs
        self.set_phase(phase, total_steps)

    def set_phase(self, phase: str, total_steps: int | None = None) -> None:
        """Start phase `phase` ("SFT", "RL") of `total_steps` steps: the averages and the ETA start over."""
        self.phase = phase
        self.total_steps = total_steps
        self._headline: collections.deque[float] = collections.deque(maxlen=self.window)
        self._step_times: collections.deque[tuple[float, float]] = collections.deque(maxlen=self.window + 1)
        self._row: dict[str, Any] = {}
        self._sticky: dict[str, float] = {}
        self._seen: set[str] = set()
        self._status = ""
        self._refresh()

    @contextlib.contextmanager
    def in_phase(self, phase: str, total_steps: int | None = None) -> Iterator[Self]:
        """`set_phase` for a `with` block; at its end the phase's last row is printed if it was
        held back by the interval."""
        self.set_phase(phase, total_steps)
        try:
            yield self
        finally:
            self.flush()

    def flush(self) -> None:
        """Print the last row now if the interval held it back (plain lines only)."""
        if self._live is None and self._unprinted:
            self._print(self.line())

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> Self:
        if self.enabled and not self.silent and sys.stdout.isatty() and self._live is None:
            from rich.live import Live  # only the live view needs rich

            # get_renderable: redrawn 4 times a second, so elapsed and ETA tick between steps
            self._live = Live(get_renderable=self._renderable, refresh_per_second=4, transient=False)
            self._live.start()
        return self

    def stop(self) -> None:
        """Stop the live view, or print the last row not yet printed. Safe to call twice."""
        live, self._live = self._live, None
        if live is not None:
            live.stop()
        else:
            self.flush()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        # Also on KeyboardInterrupt: the terminal gets its cursor back before the traceback. A
        # clean end leaves the last row without the status; a failure leaves what it was doing.
        if exc_type is None and self._live is not None:
            self._status = ""
            self._refresh()
        self.stop()

    # --- updates ---------------------------------------------------------------------------------

    def status(self, text: str) -> None:
        """What the run is doing now (module docstring)."""
        self._status = text
        if self._live is not None:
            self._refresh()
        elif text:
            self._print(f"[{self.phase}] {text}", rate_limited=False)

    def update(self, row: dict[str, Any]) -> None:
        headline = _number(row, _HEADLINE.get(self.phase, ("", ""))[1])
        if headline is not None:
            self._headline.append(headline)
        step = _number(row, "step")
        if step is not None:
            self._step_times.append((self._clock(), step))
        for key in _STICKY:
            value = _number(row, key)
            if value is not None:
                self._sticky[key] = value
        self._seen |= {key for key in row if _number(row, key) is not None}
        self._row = row
        self._status = ""
        if self._live is not None:
            self._refresh()
            return
        now = self._clock()
        if self._last_print_s is None or now - self._last_print_s >= self.interval_s:
            self._print(self.line())
        else:
            self._unprinted = True

    def line(self) -> str:
        """The compact one-line summary of the latest row."""
        parts: list[str] = []
        for name, value in self._fields():
            if name == "step":
                parts.append(f"[{self.phase}] step {value}")
            elif name.startswith("avg of last"):
                parts[-1] += f" ({name}: {value})"
            elif name == "elapsed":
                parts.append(value)
            elif name in ("samples/s", "tokens/s"):
                parts.append(f"{value} {name}")
            else:
                parts.append(f"{name} {value}")
        return " | ".join(parts)

    def eta_s(self) -> float | None:
        """Seconds to the phase's last step at the recent pace; None without a total or two steps."""
        if self.total_steps is None or len(self._step_times) < 2:
            return None
        (t0, s0), (t1, s1) = self._step_times[0], self._step_times[-1]
        if s1 <= s0:
            return None
        return (t1 - t0) / (s1 - s0) * max(self.total_steps - s1, 0.0)

    # --- rendering -------------------------------------------------------------------------------

    def _fields(self) -> list[tuple[str, str]]:
        row = self._row

        def fmt(value: float | None, spec: str) -> str:
            return "-" if value is None else format(value, spec)

        step = fmt(_number(row, "step"), ".0f")
        if self.total_steps is not None:
            step = f"{step}/{self.total_steps}"
        fields = [("step", step)]
        if self.phase in _HEADLINE:
            label, key = _HEADLINE[self.phase]
            fields.append((label, fmt(_number(row, key), ".3f")))
            if self._headline:  # its own field: a column of the live table, "(avg ...)" in the line
                fields.append((f"avg of last {len(self._headline)}",
                               f"{sum(self._headline) / len(self._headline):.3f}"))
        for label, key, spec, optional in _FIELDS.get(self.phase, []):
            if optional and key not in self._seen:
                continue
            value = self._sticky.get(key) if key in _STICKY else _number(row, key)
            fields.append((label, fmt(value, spec)))
            if self.phase == "RL" and label == "samples/s":
                stale_mean, stale_max = _number(row, "train/staleness_mean"), _number(row, "train/staleness_max")
                fields.append(("stale", f"{fmt(stale_mean, '.1f')}/{fmt(stale_max, '.0f')}"))
        elapsed_s = _number(row, "perf/wall_s")
        if elapsed_s is None:
            elapsed_s = self._clock() - self._started_s
        eta_s = self.eta_s()
        fields += [("elapsed", _clock_text(elapsed_s)), ("ETA", "-" if eta_s is None else _clock_text(eta_s))]
        return fields

    def _print(self, text: str, *, rate_limited: bool = True) -> None:
        if self.silent:
            return
        stream = self._stream if self._stream is not None else sys.stderr
        print(text, file=stream, flush=True)
        if rate_limited:
            self._last_print_s = self._clock()
            self._unprinted = False

    def _refresh(self) -> None:
        if self._live is not None:
            self._live.refresh()

    def _renderable(self) -> Any:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        parts: list[Any] = []
        if self._row:
            table = Table(box=None, padding=(0, 1), show_edge=False)
            fields = self._fields()
            for name, _ in fields:  # the step's column is headed by the phase: "RL step"
                table.add_column(f"{self.phase} step" if name == "step" else name, no_wrap=True,
                                 justify="left" if name in ("elapsed", "ETA") else "right")
            table.add_row(*(value for _, value in fields))
            parts.append(table)
        if self._status or not self._row:
            parts.append(Text(f"[{self.phase}] {self._status or 'starting'}", style="dim"))
        return Group(*parts)
