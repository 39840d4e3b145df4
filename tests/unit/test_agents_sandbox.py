"""LocalSandbox contains what a tool call does and reports it as a failed result; the run goes on.

The hostile commands (fork bombs, memory hogs, endless writers) run under small limits set before
exec, so they cannot hurt the shared machine: 16 processes, 256 MiB, 4 MiB per file, 20 MiB of disk.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import socket
import sys
import tempfile

import pytest

from miles_async.agents.sandbox import (
    CommandResult,
    LocalSandbox,
    Sandbox,
    SandboxError,
    SandboxLimits,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LocalSandbox needs Linux")

SMALL = SandboxLimits(
    timeout_s=5.0, cpu_s=2, memory_mib=256, file_mib=4, disk_mib=20, max_processes=16, output_bytes=4096
)
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _sandboxed(scenario, limits: SandboxLimits = SMALL, **kwargs):
    """Run `scenario(sandbox)` in a fresh sandbox, closed afterwards."""

    async def main():
        sandbox = LocalSandbox(limits=limits, **kwargs)
        try:
            return await scenario(sandbox)
        finally:
            await sandbox.close()

    return asyncio.run(main())


def _all_pids_of_uid(uid: int) -> list[int]:
    """Every process of `uid`, zombies included."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status") as f:
                    uid_line = next(line for line in f if line.startswith("Uid:"))
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(uid_line.split()[1]) == uid:
                pids.append(int(name))
    return pids


@pytest.mark.timeout(30)
def test_local_sandbox_is_a_sandbox_and_limits_are_checked():
    async def scenario(sandbox):
        assert isinstance(sandbox, Sandbox)
        assert os.path.isdir(sandbox.root) and sandbox.info.root == sandbox.root

    _sandboxed(scenario)
    with pytest.raises(ValueError, match="max_processes"):
        SandboxLimits(max_processes=0)


@pytest.mark.timeout(30)
def test_a_normal_command_returns_its_output_and_exit_code():
    async def scenario(sandbox):
        result = await sandbox.run("echo hello; echo oops >&2; pwd; exit 3")
        assert result.exit_code == 3 and not result.ok and result.killed_reason == ""
        assert result.stdout.splitlines() == ["hello", sandbox.root] and result.stderr == "oops\n"
        ok = await sandbox.run(["printf", "%s", "argv"])
        assert ok.ok and ok.stdout == "argv" and not ok.truncated and not ok.timed_out
        missing = await sandbox.run(["no-such-program-xyz"])
        assert missing.exit_code == 127 and "no-such-program-xyz" in missing.stderr
        env = await sandbox.run("env")
        assert f"HOME={sandbox.root}" in env.stdout and "PYTEST_CURRENT_TEST" not in env.stdout

    _sandboxed(scenario)


@pytest.mark.timeout(30)
def test_stdin_reaches_the_command():
    async def scenario(sandbox):
        result = await sandbox.run("tr a-z A-Z", stdin="shout\n")
        assert result.ok and result.stdout == "SHOUT\n"

    _sandboxed(scenario)


@pytest.mark.timeout(30)
def test_files_inside_the_folder_and_refusal_of_paths_that_escape_it():
    async def scenario(sandbox):
        await sandbox.write_file("src/main.py", "print('from file')\n")
        assert await sandbox.read_file("src/main.py") == b"print('from file')\n"
        result = await sandbox.run("python3 src/main.py && echo more >> src/main.py")
        assert result.ok and result.stdout == "from file\n"  # the command may write what we wrote
        assert (await sandbox.read_file("src/main.py")).endswith(b"more\n")
        for bad in ("../x", "/etc/passwd", "src/../../x", ""):
            with pytest.raises(ValueError):
                await sandbox.write_file(bad, "x")
            with pytest.raises(ValueError):
                await sandbox.read_file(bad)
        # a symlink planted by a command does not lead the sandbox's own file access outside
        assert (await sandbox.run("ln -s /etc out")).ok
        with pytest.raises(ValueError, match="outside"):
            await sandbox.read_file("out/passwd")
        with pytest.raises(ValueError, match="outside"):
            await sandbox.write_file("out/evil", "x")

    _sandboxed(scenario)


@pytest.mark.timeout(30)
def test_an_endless_loop_times_out_and_the_sandbox_goes_on():
    async def scenario(sandbox):
        result = await sandbox.run("while true; do :; done", timeout_s=0.5)
        assert result.timed_out and result.killed_reason == "timeout" and not result.ok
        assert 0.5 <= result.duration_s < 4.0
        assert (await sandbox.run("echo alive")).stdout == "alive\n"

    _sandboxed(scenario)


@pytest.mark.timeout(30)
def test_cpu_limit_kills_a_busy_process():
    async def scenario(sandbox):
        result = await sandbox.run(["python3", "-c", "while True: pass"], timeout_s=10)
        assert result.killed_reason == "cpu" and not result.timed_out and result.duration_s < 6

    _sandboxed(scenario, SandboxLimits(timeout_s=10, cpu_s=1, memory_mib=256, max_processes=16))


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "bomb",
    [
        ["bash", "-c", ":(){ :|:& };:"],
        "f(){ f|f& }; f",
        ["python3", "-c", "import os\nwhile True:\n    os.fork()"],
    ],
    ids=["bash", "sh", "python"],
)
def test_a_fork_bomb_is_contained_and_leaves_nothing_behind(bomb):
    if not IS_ROOT:
        pytest.skip("RLIMIT_NPROC only bounds a sandbox of its own uid, which needs root")

    async def scenario(sandbox):
        result = await sandbox.run(bomb, timeout_s=2.0)
        assert result.killed_reason == "processes" and not result.ok, result
        assert _all_pids_of_uid(sandbox.uid) == []  # no process, not even a zombie, is left
        after = await sandbox.run("echo fine")  # the process table is free again at once
        assert after.ok and after.stdout == "fine\n"

    _sandboxed(scenario)


@pytest.mark.timeout(30)
def test_writing_forever_hits_the_file_size_limit():
    async def scenario(sandbox):
        endless = await sandbox.run(
            ["python3", "-c", "f = open('big', 'wb')\nwhile True: f.write(b'x' * 65536)"]
        )
        assert endless.killed_reason == "file_size" and "File too large" in endless.stderr
        dd = await sandbox.run("dd if=/dev/zero of=big2 bs=1M count=100")
        assert dd.killed_reason == "file_size"
        assert os.path.getsize(os.path.join(sandbox.root, "big")) <= SMALL.file_mib * 1024 * 1024

    _sandboxed(scenario)


@pytest.mark.timeout(30)
def test_many_small_files_hit_the_disk_limit():
    async def scenario(sandbox):
        result = await sandbox.run("i=0; while true; do i=$((i+1)); head -c 1000000 /dev/zero > f$i; done")
        assert result.killed_reason == "disk" and not result.timed_out

    _sandboxed(scenario)


@pytest.mark.timeout(30)
def test_a_memory_hog_fails_with_memory():
    async def scenario(sandbox):
        big = await sandbox.run(["python3", "-c", "x = bytearray(1 << 30)"])
        assert big.killed_reason == "memory" and "MemoryError" in big.stderr
        growing = await sandbox.run(["python3", "-c", "x = []\nwhile True: x.append(bytearray(10**7))"])
        assert growing.killed_reason == "memory"

    _sandboxed(scenario)


@pytest.mark.timeout(30)
def test_huge_output_is_capped_and_the_command_killed():
    async def scenario(sandbox):
        result = await sandbox.run("yes")
        assert result.killed_reason == "output" and result.truncated and not result.ok
        assert len(result.stdout) == SMALL.output_bytes and result.duration_s < 4

    _sandboxed(scenario)


@pytest.mark.timeout(30)
def test_writes_outside_the_folder_fail_or_are_found_and_removed():
    if not IS_ROOT:
        pytest.skip("commands run under a uid of their own only when the sandbox runs as root")
    victims = ["/etc/sandbox-was-here", "/root/sandbox-was-here", os.path.join(REPO, "sandbox-was-here")]

    async def scenario(sandbox):
        for victim in victims:
            result = await sandbox.run(f"echo x > {victim}")
            assert result.exit_code != 0 and "ermission denied" in result.stderr, result
            assert not os.path.exists(victim)
        # world-writable folders are the only place left: what lands there is reported and removed
        escape = await sandbox.run("echo x > /tmp/sandbox-escape-$$ && mkdir -p /dev/shm/sandbox-dir-$$/a")
        assert escape.killed_reason == "escape" and not escape.ok and len(escape.escaped_paths) == 2
        assert not any(os.path.exists(p) for p in escape.escaped_paths)

    _sandboxed(scenario)


@pytest.mark.timeout(30)
def test_the_network_is_blocked_when_isolation_is_available():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    connect = ["python3", "-c", f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)"]

    async def blocked(sandbox):
        if not sandbox.info.network_isolated:
            pytest.skip(f"no network namespace here: {sandbox.info.notes}")
        result = await sandbox.run(connect)
        assert result.exit_code != 0 and "unreachable" in result.stderr.lower(), result

    async def allowed(sandbox):
        assert not sandbox.info.network_isolated
        result = await sandbox.run(connect)
        assert result.ok, result  # the same command reaches the port when the network is allowed

    try:
        _sandboxed(blocked)
        _sandboxed(allowed, SandboxLimits(memory_mib=256, max_processes=16, network=True))
    finally:
        server.close()


@pytest.mark.timeout(30)
def test_sandboxes_in_parallel_are_independent():
    async def main():
        sandboxes = [LocalSandbox(limits=SMALL) for _ in range(3)]
        try:
            assert len({s.root for s in sandboxes}) == 3 and len({s.uid for s in sandboxes}) == 3
            for i, sandbox in enumerate(sandboxes):
                await sandbox.write_file("name.txt", f"box{i}")
            results = await asyncio.gather(
                sandboxes[0].run("sleep 60", timeout_s=1.0),
                sandboxes[1].run("sleep 0.2; cat name.txt; ls"),
                sandboxes[2].run(["bash", "-c", ":(){ :|:& };:"], timeout_s=1.0),
            )
            assert results[0].killed_reason == "timeout"
            assert results[1].ok and results[1].stdout.startswith("box1") and "name.txt" in results[1].stdout
            if IS_ROOT:
                assert results[2].killed_reason == "processes"
            # the other two were not hurt by the timeout or the fork bomb
            assert [(await s.run("cat name.txt")).stdout for s in sandboxes] == ["box0", "box1", "box2"]
            return results
        finally:
            for sandbox in sandboxes:
                await sandbox.close()

    results = asyncio.run(main())
    assert all(isinstance(r, CommandResult) for r in results)


@pytest.mark.timeout(30)
def test_close_kills_leftovers_and_removes_the_folder():
    async def main():
        sandbox = LocalSandbox(limits=SMALL)
        await sandbox.write_file("a/b.txt", "x")
        root = sandbox.root
        await sandbox.close()
        assert not os.path.exists(root)
        if IS_ROOT:
            assert _all_pids_of_uid(sandbox.uid) == []
        with pytest.raises(SandboxError, match="closed"):
            await sandbox.run("true")
        await sandbox.close()  # twice is fine

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_a_given_root_is_kept_unless_asked():
    async def main(tmp):
        sandbox = LocalSandbox(tmp / "box", limits=SMALL)
        assert (await sandbox.run("echo kept > f && cat f")).stdout == "kept\n"
        await sandbox.close()
        return (tmp / "box" / "f").read_text()

    with tempfile.TemporaryDirectory() as tmp:
        assert asyncio.run(main(pathlib.Path(tmp))) == "kept\n"
