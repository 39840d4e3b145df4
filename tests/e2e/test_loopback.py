"""Loopback means loopback: every listener of a one-machine `miles-async run` binds 127.0.0.0/8 or ::1.

A short real run of the CLI; from its start until it exits the test lists, every 0.2 s, the
listening TCP/TCP6 sockets and the bound, unconnected UDP/UDP6 sockets of the CLI's process and
all its descendants (socket inodes from /proc/PID/fd, looked up in /proc/net/{tcp,tcp6,udp,udp6}),
and fails naming each one bound elsewhere (`::`, 0.0.0.0, the machine's own address) with its
process's command line. Listing for the whole run (SFT warm start included) rather than at one
moment also catches listeners that live only for a while (a weight push's group store). The RL
phase must have been listed: at least one listing after `metrics.jsonl` has its first row.

Runs: the default recipe (shm weights); weights by torch.distributed broadcast (a gloo group and a
TCPStore between the pusher and the engine) from two trainer ranks (their process group's TCPStore
and gloo pairs), in one run; and the multi-turn recipe (the TITO session server, the tool sandbox).

Linux only (/proc). `-s` prints every listener found.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from _support_run import SHORT, pids_alive

# About 9 s a run here: the default run is in the fast tier, the other placements are marked slow.
pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").is_file(),
                                reason="lists sockets through Linux's /proc")
RECIPES = Path(__file__).resolve().parents[2] / "recipes"
SCAN_EVERY_S = 0.2
RUN_TIMEOUT_S = 240.0
TCP_LISTEN = "0A"  # the state column of /proc/net/tcp*

CALCULATOR = ["sft.max_steps=10", "sft.probe_every=10", "sft.num_probe=4", "loop.batch_groups=2",
              "scheduler.group_size=2", "scheduler.target_in_flight=8", "buffer.filter=none", "eval.mode=none",
              "task.num_prompts=200"]
RUNS = {
    "default": ("reverse.toml", [*SHORT, "eval.mode=none"]),
    "broadcast_two_ranks": ("reverse.toml", [*SHORT, "eval.mode=none", "weights.transport=broadcast",
                                             "trainer.world_size=2"]),
    "agent_sessions": ("calculator.toml", CALCULATOR),
}


@dataclass(frozen=True, order=True)
class Listener:
    pid: int
    proto: str  # tcp, tcp6, udp, udp6
    address: str
    port: int

    @property
    def on_loopback(self) -> bool:
        ip = ipaddress.ip_address(self.address)
        mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is loopback too
        return ip.is_loopback or (mapped is not None and mapped.is_loopback)

    def __str__(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{self.proto} {host}:{self.port}"


def _address(hex_address: str) -> tuple[str, int]:
    """An address of /proc/net/tcp* ("0100007F:1F90"): 32-bit words in host (little-endian) order."""
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(raw)), int(port, 16)


def _listening_inodes() -> dict[str, tuple[str, str, int]]:
    """inode -> (proto, address, port) of every listening TCP and bound, unconnected UDP socket."""
    found = {}
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        try:
            lines = Path(f"/proc/net/{proto}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
            address, port = _address(local)
            if proto.startswith("tcp") and state != TCP_LISTEN:
                continue
            # UDP: one connected to a peer (a route lookup, a DNS query) takes nothing from others
            if proto.startswith("udp") and (port == 0 or _address(remote)[1] != 0):
                continue
            found[inode] = (proto, address, port)
    return found


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # exited meanwhile
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _command_line(pid: int) -> str:
    try:
        text = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"
    return text if len(text) <= 300 else text[:300] + "..."


def listeners_of(root: int) -> dict[Listener, str]:
    """Every listening socket of process `root` or one of its descendants -> that process's command line."""
    sockets = _listening_inodes()
    found = {}
    for pid in [root, *pids_alive(root)]:
        for inode in _socket_inodes(pid) & sockets.keys():
            found[Listener(pid, *sockets[inode])] = _command_line(pid)
    return found


def _has_rl_step(run_dir: Path) -> bool:
    metrics = run_dir / "metrics.jsonl"
    return metrics.is_file() and metrics.read_text().strip() != ""


def _stop(proc: subprocess.Popen) -> None:
    """Kill what is left of the run, by pid: the CLI's descendants, then the CLI itself."""
    for pid in pids_alive(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.kill()
    proc.wait(timeout=30)


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("run", [run if run == "default" else pytest.param(run, marks=pytest.mark.slow) for run in RUNS])
def test_every_listener_of_a_one_machine_run_is_on_loopback(tmp_path, run):
    recipe, overrides = RUNS[run]
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "miles_async.launch.cli", "run", str(RECIPES / recipe), "--out", str(out),
           "--quiet", *overrides, "loop.num_steps=3"]
    seen: dict[Listener, str] = {}
    num_scans = num_rl_scans = 0
    with open(tmp_path / "stderr.txt", "w+") as stderr:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while proc.poll() is None:
                assert time.monotonic() < deadline, f"the run did not end within {RUN_TIMEOUT_S:g} s"
                in_rl = _has_rl_step(out)  # before the listing: it then lists the RL phase
                seen.update(listeners_of(proc.pid))
                num_scans += 1
                num_rl_scans += in_rl
                time.sleep(SCAN_EVERY_S)
        finally:
            if proc.poll() is None:
                _stop(proc)
        stderr.seek(0)
        log = stderr.read()
    found = [f"  {listener} (pid {listener.pid}: {seen[listener]})" for listener in sorted(seen)]
    print(f"{run}: {num_scans} listings, {num_rl_scans} in the RL phase; {len(seen)} listener(s)", *found,
          sep="\n")  # -s shows them
    assert proc.returncode == 0, log[-3000:]
    assert num_rl_scans > 0, "the run ended before its RL phase could be listed"
    assert seen, "no listener found at all: the engine's HTTP server at least should be there"
    off_loopback = sorted(listener for listener in seen if not listener.on_loopback)
    assert not off_loopback, "listening off loopback in a one-machine run:\n" + "\n".join(
        f"  {listener} (pid {listener.pid}: {seen[listener]})" for listener in off_loopback)
