"""Helpers of the multi-node launch tests: ports, waits, the processes a launcher left, trace reads."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "reverse.toml"
SECRET = "b" * 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def session_pids(sid: int, wait_s: float = 15.0) -> list[int]:
    """Every live process of the session a launcher started (its descendants, however re-parented),
    after giving the ones already told to stop `wait_s` to exit."""
    deadline = time.monotonic() + wait_s
    while True:
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                pids.append(int(stat.parent.name))
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(0.2)


def finish(procs: list[subprocess.Popen], timeout_s: float) -> list[tuple[int, str, str]]:
    deadline = time.monotonic() + timeout_s
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                os.killpg(q.pid, 9)
            raise
        outs.append((p.returncode, out, err))
    return outs


def wait_steps(out: Path, steps: int, timeout_s: float, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        metrics = out / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            return
        if any(p.poll() is not None for p in procs):
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, 9)
            said = "\n".join(f"launcher {i} (rc {q.returncode}): {q.communicate()[1][-1500:]}"
                             for i, q in enumerate(procs))
            raise AssertionError(f"a launcher ended early:\n{said}")
        time.sleep(0.2)
    raise AssertionError(f"{steps} steps not done within {timeout_s:g}s")


def first_versions(out: Path) -> dict[str, int]:
    """Per engine, the weight version of its first sample (by submit time)."""
    first: dict[str, tuple[float, int]] = {}
    for line in (out / "trace.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["kind"] == "sample" and (r["engine"] not in first or r["submit_s"] < first[r["engine"]][0]):
            first[r["engine"]] = (r["submit_s"], r["versions"][0])
    return {engine: version for engine, (_, version) in first.items()}


def joined_at(err: str, engine: str) -> int:
    line = next(line for line in err.splitlines() if f"joined: {engine} serves from weight version" in line)
    return int(line.rsplit(" ", 1)[1])


def wait_engine(out: Path, engine: str, timeout_s: float, procs: list[subprocess.Popen]) -> None:
    """Until the run's trace holds a sample of `engine` (it joined and served): its engine records
    ("serving" comes before any sample) do not count."""
    deadline = time.monotonic() + timeout_s
    needle = f'"engine":"{engine}"'
    while time.monotonic() < deadline:
        trace = out / "trace.jsonl"
        lines = trace.read_text().splitlines() if trace.exists() else []
        if any(needle in line and json.loads(line)["kind"] == "sample" for line in lines if line.endswith("}")):
            return
        if procs[0].poll() is not None:
            raise AssertionError(f"node 0 ended (status {procs[0].returncode}) before {engine} served")
        time.sleep(0.2)
    raise AssertionError(f"{engine} served no sample within {timeout_s:g}s")


def stop_run(node0: subprocess.Popen) -> None:
    """Ctrl-C on node 0: the run stops after its step, saves a checkpoint, and tells the nodes."""
    os.kill(node0.pid, 2)
