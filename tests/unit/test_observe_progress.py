"""Progress: a rich live table on a terminal; off one, a compact plain line on stderr, rate-limited;
the phase (SFT / RL), the ETA, start-up statuses and the moving average's window said plainly."""

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
        progress.update({"step": 1, "perf/wall_s": 83.0, "rollout/reward_mean": 0.5, "perf/samples_per_s": 35.24,
                         "train/staleness_mean": 0.75, "train/staleness_max": 2, "eval/score": 0.55})
        clock.now_s = 1.0
        progress.update({"step": 2, "rollout/reward_mean": 0.25})  # within interval_s: held back
        out, err = capsys.readouterr()
        assert out == ""
        assert err.splitlines() == [
            ("[RL] step 1/100 | reward 0.500 (avg of last 1: 0.500) | 35.2 samples/s | stale 0.8/2 | eval 0.550 "
            "| 0:01:23 | ETA -")]
        clock.now_s = 11.0
        progress.update({"step": 3, "rollout/reward_mean": 1.0})
        assert capsys.readouterr().err.startswith("[RL] step 3/100 | reward 1.000 (avg of last 2: 0.625)")
        clock.now_s = 12.0
        progress.update({"step": 4})
    # the last row, held back by the interval, is printed on exit; eval score is remembered
    assert capsys.readouterr().err.splitlines() == [
        ("[RL] step 4/100 | reward - (avg of last 2: 0.625) | - samples/s | stale -/- | eval 0.550 | 0:00:12 "
        "| ETA 0:08:48")]  # steps 2-4 took 11 s: 5.5 s a step (window 2), 96 steps left: 528 s


def test_update_without_optional_keys(capsys):
    with Progress(enabled=False, interval_s=0.0, clock=FakeClock()) as progress:
        progress.update({})
        progress.update({"step": 5, "rollout/reward_mean": float("nan")})
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "[RL] step - | reward - | - samples/s | stale -/- | eval - | 0:00:00 | ETA -"
    assert lines[1].startswith("[RL] step 5 | reward - |")
    assert len(lines) == 2


def test_the_eta_follows_the_recent_pace_and_a_new_phase_starts_it_over():
    clock = FakeClock()
    progress = Progress(total_steps=10, window=3, enabled=False, silent=True, clock=clock)
    assert progress.eta_s() is None  # no step yet
    for step, at_s in [(1, 0.0), (2, 10.0), (3, 20.0), (4, 22.0), (5, 24.0), (6, 26.0)]:
        clock.now_s = at_s
        progress.update({"step": step})
    assert progress.eta_s() == pytest.approx(2.0 * 4)  # the last 3 steps took 2 s each; 4 steps left
    progress.set_phase("RL", 100)
    assert progress.eta_s() is None  # a new phase: its own pace
    clock.now_s = 30.0
    progress.update({"step": 1})
    clock.now_s = 33.0
    progress.update({"step": 2})
    assert progress.eta_s() == pytest.approx(3.0 * 98)


def test_the_sft_phase_shows_the_loss_and_the_fields_it_has(capsys):
    clock = FakeClock()
    with Progress(phase="setup", interval_s=0.0, window=20, clock=clock) as progress:
        progress.status("loading the model: starting 2 engine(s) and 1 trainer rank(s)")
        with progress.in_phase("SFT", 300):
            progress.update({"step": 1, "train/loss": 2.0, "perf/wall_s": 1.0})
            clock.now_s = 2.0
            progress.update({"step": 2, "train/loss": 1.0, "perf/wall_s": 3.0, "eval/score": 0.125})
        progress.set_phase("RL", 50)
        progress.status("evaluating step 0 (before training)")
    assert capsys.readouterr().err.splitlines() == [
        "[setup] loading the model: starting 2 engine(s) and 1 trainer rank(s)",
        "[SFT] step 1/300 | loss 2.000 (avg of last 1: 2.000) | 0:00:01 | ETA -",
        "[SFT] step 2/300 | loss 1.000 (avg of last 2: 1.500) | eval 0.125 | 0:00:03 | ETA 0:09:56",
        "[RL] evaluating step 0 (before training)",
    ]


def test_sft_mode_rows_show_tokens_per_s_epoch_and_the_held_out_loss(capsys):
    with Progress(10, phase="SFT", interval_s=0.0, clock=FakeClock()) as progress:
        progress.update({"step": 5, "train/loss": 0.5, "perf/tokens_per_s": 12345.6, "train/epoch": 0.5,
                         "eval/heldout_loss": 0.75, "perf/wall_s": 30.0})
    assert capsys.readouterr().err.splitlines() == [
        ("[SFT] step 5/10 | loss 0.500 (avg of last 1: 0.500) | 12,346 tokens/s | epoch 0.50 | held-out loss 0.7500 "
        "| 0:00:30 | ETA -")]


def test_silent_prints_nothing(capsys):
    with Progress(5, silent=True, interval_s=0.0, clock=FakeClock()) as progress:
        progress.status("starting")
        progress.update({"step": 1, "rollout/reward_mean": 0.5})
    assert capsys.readouterr().err == ""


def test_stops_cleanly_on_keyboard_interrupt(capsys):
    clock = FakeClock()
    with pytest.raises(KeyboardInterrupt), Progress(interval_s=60.0, clock=clock) as progress:
        progress.update({"step": 1})
        progress.update({"step": 2})
        raise KeyboardInterrupt
    assert [line.split(" |")[0] for line in capsys.readouterr().err.splitlines()] == ["[RL] step 1", "[RL] step 2"]


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_the_live_view_starts_and_stops_on_interrupt(monkeypatch, capsys):
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    with pytest.raises(KeyboardInterrupt), Progress(total_steps=3, phase="setup", clock=FakeClock()) as progress:
        assert progress._live is not None
        progress.status("starting 1 engine(s)")
        assert "starting 1 engine(s)" in terminal.getvalue()  # the status line, before any row
        progress.set_phase("RL", 3)
        progress.update({"step": 1, "rollout/reward_mean": 0.5, "perf/samples_per_s": 12.0})
        raise KeyboardInterrupt
    assert progress._live is None
    assert sys.stdout is terminal  # rich gave stdout back
    text = terminal.getvalue()
    assert "1/3" in text and "avg of last 1" in text and "samples/s" in text and "ETA" in text
    assert "RL step" in text
    assert capsys.readouterr().err == ""  # no plain lines on a terminal
