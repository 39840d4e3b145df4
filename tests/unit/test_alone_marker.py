"""tests/conftest.py's `alone` marker, in a real pytest-xdist session of two workers (a pytest
subprocess over generated test files that use a copy of that conftest): the `alone` test runs
while no test of the other worker does, and the other tests still run two at a time."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parent.parent / "conftest.py"

TIMED = '''
import json, os, time
import pytest

def timed(name, seconds):
    start = time.monotonic()
    time.sleep(seconds)
    with open(os.environ["TIMES"], "a") as f:
        f.write(json.dumps([name, start, time.monotonic()]) + "\\n")
'''


@pytest.mark.timeout(120)
def test_an_alone_test_runs_beside_no_other_under_xdist(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copy(CONFTEST, suite / "conftest.py")
    (suite / "test_other.py").write_text(TIMED + "".join(
        f"def test_other_{i}():\n    timed('other_{i}', 0.4)\n" for i in range(6)))
    (suite / "test_mixed.py").write_text(TIMED + (
        "def test_first():\n    timed('first', 0.4)\n"
        "@pytest.mark.alone\ndef test_alone():\n    timed('alone', 0.6)\n"
        "def test_last():\n    timed('last', 0.4)\n"))
    times = tmp_path / "times.jsonl"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                           "loadfile", "--rootdir", str(suite), "-c", "/dev/null", f"--basetemp={tmp_path / 'bt'}",
                           str(suite)], check=False, capture_output=True, text=True, timeout=100, cwd=suite,
                          env={**os.environ, "TIMES": str(times)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    spans = {name: (start, end) for name, start, end in map(json.loads, times.read_text().splitlines())}
    assert len(spans) == 9
    start, end = spans.pop("alone")
    beside = [name for name, (s, e) in spans.items() if s < end and e > start]
    assert beside == [], beside  # nothing overlapped the alone test
    others = [spans[f"other_{i}"] for i in range(6)]  # 2.4 s in all, on one worker
    assert any(s < e2 and e > s2 for s, e in others for s2, e2 in (spans["first"], spans["last"]))  # two at a time
