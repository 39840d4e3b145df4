"""Progress: a rich live table on a terminal; off one, a compact plain line on stderr, rate-limited."""

from __future__ import annotations

import io
import sys

import pytest

from miles_async.observe import Progress


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_non_tty_prints_a_compact_line_to_stderr(capsys):
    clock = FakeClock()
    with Progress(total_steps=100, interval_s=10.0, window=2, clock=clock) as progress:
        progress.update({"step": 1, "wall_s": 83.0, "reward_mean": 0.5, "samples_per_s": 35.24,
                         "staleness_mean": 0.75, "staleness_max": 2, "eval_score": 0.55})
        clock.now_s = 1.0
        progress.update({"step": 2, "reward_mean": 0.25})  # within interval_s: held back
        out, err = capsys.readouterr()
        assert out == ""
        assert err.splitlines() == [
            "step 1/100 | reward 0.500 (mean1 0.500) | 35.2 samples/s | stale 0.8/2 | eval 0.550 | 0:01:23"]
        clock.now_s = 11.0
        progress.update({"step": 3, "reward_mean": 1.0})
        assert capsys.readouterr().err.startswith("step 3/100 | reward 1.000 (mean2 0.625)")
        clock.now_s = 12.0
        progress.update({"step": 4})
    # the last row, held back by the interval, is printed on exit; eval score is remembered
    assert capsys.readouterr().err.splitlines() == [
        "step 4/100 | reward - (mean2 0.625) | - samples/s | stale -/- | eval 0.550 | 0:00:12"]


def test_update_without_optional_keys(capsys):
    with Progress(enabled=False, interval_s=0.0, clock=FakeClock()) as progress:
        progress.update({})
        progress.update({"step": 5, "reward_mean": float("nan")})
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "step - | reward - | - samples/s | stale -/- | eval - | 0:00:00"
    assert lines[1].startswith("step 5 | reward - |")
    assert len(lines) == 2


def test_stops_cleanly_on_keyboard_interrupt(capsys):
    clock = FakeClock()
    with pytest.raises(KeyboardInterrupt), Progress(interval_s=60.0, clock=clock) as progress:
        progress.update({"step": 1})
        progress.update({"step": 2})
        raise KeyboardInterrupt
    assert [line.split(" |")[0] for line in capsys.readouterr().err.splitlines()] == ["step 1", "step 2"]


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_the_live_view_starts_and_stops_on_interrupt(monkeypatch, capsys):
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    with pytest.raises(KeyboardInterrupt), Progress(total_steps=3, clock=FakeClock()) as progress:
        assert progress._live is not None
        progress.update({"step": 1, "reward_mean": 0.5, "samples_per_s": 12.0})
        raise KeyboardInterrupt
    assert progress._live is None
    assert sys.stdout is terminal  # rich gave stdout back
    text = terminal.getvalue()
    assert "1/3" in text and "0.500" in text and "samples/s" in text
    assert capsys.readouterr().err == ""  # no plain lines on a terminal
