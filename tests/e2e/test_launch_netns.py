"""`miles-async launch` across network namespaces: node 1 in a namespace of its own, joined to node
0 (the host's namespace) by a veth pair, so the two really talk over a network link, and the
fault "its link goes down" is `ip link set ... down`.

Creating namespaces needs root (CAP_NET_ADMIN) and the `ip` tool; where that is not allowed the
tests skip, and test_launch.py (distinct loopback addresses) covers the same behaviour."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from _support_launch import (
    RECIPE,
    SECRET,
    finish,
    first_versions,
    joined_at,
    session_pids,
    stop_run,
    wait_engine,
    wait_steps,
)
from _support_run import SHORT

NODE0, NODE1 = "10.77.1.1", "10.77.1.2"


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@pytest.fixture
def namespace() -> Iterator[tuple[str, str]]:
    """A namespace holding node 1's end of a veth pair: NODE1 there, NODE0 on the host's end."""
    if shutil.which("ip") is None:
        pytest.skip("no `ip` tool: the loopback tests (test_launch.py) cover multi-node launch")
    name, tag = f"mtest{uuid.uuid4().hex[:6]}", uuid.uuid4().hex[:5]
    host_end, ns_end = f"vh{tag}", f"vn{tag}"
    made = ip("netns", "add", name, check=False)
    if made.returncode != 0:
        pytest.skip(f"network namespaces are not allowed here ({made.stderr.strip()}): the loopback tests cover it")
    try:
        ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
        ip("link", "set", ns_end, "netns", name)
        ip("addr", "add", f"{NODE0}/24", "dev", host_end)
        ip("link", "set", host_end, "up")
        ip("netns", "exec", name, "ip", "addr", "add", f"{NODE1}/24", "dev", ns_end)
        ip("netns", "exec", name, "ip", "link", "set", ns_end, "up")
        ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        yield name, host_end
    finally:
        ip("link", "del", host_end, check=False)
        ip("netns", "del", name, check=False)


def launcher(rank: int, port: int, out: Path, namespace: tuple[str, str], *extra: str) -> subprocess.Popen:
    host = NODE0 if rank == 0 else NODE1
    args = [sys.executable, "-m", "miles_async.launch.cli", "launch", "--nnodes", "2", "--node-rank", str(rank),
            "--master-addr", NODE0, "--master-port", str(port), "--host", host, "--rdzv-timeout-s", "60",
            "--quiet", str(RECIPE), *extra]
    if rank == 0:
        args += ["--out", str(out)]
    else:
        args = ["ip", "netns", "exec", namespace[0], *args]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "MILES_ASYNC_SECRET": SECRET})


ARGS = [*SHORT, "loop.num_steps=100000", "eval.mode=none", "rollout.num_engines=2", "placement.engines=[0,1]",
        "weights.transport=broadcast", "--heartbeat-timeout-s", "3"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_node_1_in_its_own_namespace_survives_its_link_going_down(tmp_path: Path,
                                                                   namespace: tuple[str, str]) -> None:
    out = tmp_path / "run"
    port = 29400 + os.getpid() % 500
    procs = [launcher(0, port, out, namespace, *ARGS), launcher(1, port, out, namespace, *ARGS)]
    wait_steps(out, 4, 180, procs)
    host_end = namespace[1]
    ip("link", "set", host_end, "down")  # node 1 is cut off
    time.sleep(6)
    ip("link", "set", host_end, "up")
    ip("addr", "replace", f"{NODE0}/24", "dev", host_end)
    wait_engine(out, "engine-2", 180, procs)
    stop_run(procs[0])
    (rc0, out0, err0), (rc1, _, err1) = finish(procs, 240)
    assert rc0 == 130 and rc1 == 0, err0[-3000:] + "\n--- node 1 ---\n" + err1[-2000:]
    assert json.loads(out0.strip().splitlines()[-1])["interrupted"]
    assert "engine engine-1 is gone" in err0 and "node 1 (10.77.1.2) is back" in err0
    version = joined_at(err0, "engine-2")
    assert first_versions(out)["engine-2"] >= version > 0
    for p in procs:
        assert session_pids(p.pid) == [], "a process of the run outlived it"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_ranks_on_both_sides_of_the_link_train_together(tmp_path: Path, namespace: tuple[str, str]) -> None:
    """Rank 1 in the namespace: its gloo connections must use the veth address (its node's), not
    whatever the hostname resolves to there."""
    out = tmp_path / "run"
    port = 29900 + os.getpid() % 500
    args = [*SHORT, "loop.num_steps=3", "eval.mode=none", "placement.engines=[1]", "weights.transport=stream",
            "trainer.world_size=2", "placement.trainer=[0,1]"]
    procs = [launcher(0, port, out, namespace, *args), launcher(1, port, out, namespace, *args)]
    (rc0, out0, err0), (rc1, _, err1) = finish(procs, 240)
    assert rc0 == 0 and rc1 == 0, err0[-3000:] + "\n--- node 1 ---\n" + err1[-2000:]
    assert json.loads(out0.strip().splitlines()[-1])["num_steps"] == 3
    for p in procs:
        assert session_pids(p.pid) == [], "a process of the run outlived it"
