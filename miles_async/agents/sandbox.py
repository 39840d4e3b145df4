"""Sandboxes for the tools of multi-turn agents: one per task, commands contained, failures reported.

A tool call that loops forever, forks without end, fills the disk, eats memory, floods its output or
writes outside its folder comes back as a failed `CommandResult` (`ok` false, `killed_reason` says
why) and the run goes on; the sandbox never raises for what the command did, only for its own faults
(`SandboxError`) and for bad input (`ValueError`).

`Sandbox` is the seam: `LocalSandbox` runs commands as subprocesses on this machine; remote sandboxes
(E2B, Daytona, Modal style) implement the same four coroutines as plug-ins.

How `LocalSandbox` contains a command (Linux; see `SandboxInfo` for what this machine allowed):

- its own folder (`tempfile.mkdtemp` unless given), the command's cwd, HOME and TMPDIR; a minimal
  environment (PATH, HOME, TMPDIR, LANG and what the caller passes), nothing inherited.
- rlimits set in the child before exec: RLIMIT_CPU (SIGXCPU -> "cpu"), RLIMIT_AS (allocation fails ->
  "memory"), RLIMIT_FSIZE (SIGXFSZ/EFBIG -> "file_size"), RLIMIT_NPROC ("processes"), RLIMIT_CORE 0.
- when we are root: the command runs under a fresh uid/gid of its own (the folder is chowned to it),
  with no supplementary groups and PR_SET_NO_NEW_PRIVS. That is what makes RLIMIT_NPROC mean "this
  sandbox's processes" (root ignores it, and for a shared uid it counts every process of that user);
  it makes most of the filesystem read-only to the command (permission errors); and it lets the
  sandbox find every process of the command, even daemonised ones, and kill them all at once
  (kill(-1) sent as that uid, which the kernel applies atomically against forks).
- writes outside the folder: the only places a fresh uid can write are world-writable folders
  (/tmp, /var/tmp, /dev/shm, /run/lock). After each command their top level is scanned for entries
  owned by the sandbox's uid (reliable, as the uid is the sandbox's alone); they are removed and the
  result fails with "escape", naming them in `escaped_paths`.
- no network: the child calls unshare(CLONE_NEWNET) (CLONE_NEWUSER|CLONE_NEWNET when not root), so it
  sees only a loopback interface that is down. Unix sockets on the filesystem are not covered by
  network namespaces; they are covered by file permissions only.
- wall-clock timeout (-> "timeout"), output capped per stream while reading (-> "output", kill), the
  folder's total size polled during the command (-> "disk", kill). A command ends when all of its
  processes have (a small root-side reaper, `_REAPER_SOURCE`, reaps them all, orphans included), so
  `server &` runs until the timeout; nothing started in the background outlives the `run` call.
- without root, the network namespace comes with a user namespace, in which the command sees
  itself as uid 65534 (nobody); on disk it still acts as the caller's user.

Not contained: reads (the command can read whatever is world-readable), wall-clock use of the GPU,
SysV IPC. Without root: no separate uid, so RLIMIT_NPROC is set to the user's current process count
plus `max_processes` (approximate), writes outside the folder are limited only by the user's own
permissions and are not detected, and daemonised processes that leave the process group may survive.
The disk cap is polled, so a command can exceed it by what it writes in one poll interval; the
per-file cap (RLIMIT_FSIZE) is hard. RLIMIT_AS counts address space, not resident memory: runtimes
that reserve large virtual areas (the JVM, Go) need a larger `memory_mib`.

Try it: `python -c "import asyncio; from miles_async.agents.sandbox import LocalSandbox;
asyncio.run(LocalSandbox().run('echo hi'))"`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import json
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

KilledReason = Literal["", "timeout", "cpu", "memory", "file_size", "disk", "processes", "output", "escape"]

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
# Fresh uids are drawn from here: far above any account in /etc/passwd, below 2**31 (some tools
# still treat uids as signed 32-bit).
_UID_BASE = 1_000_000_000
_UID_SPAN = 1_000_000_000
_WORLD_WRITABLE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
_SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
_READ_CHUNK_BYTES = 64 * 1024
_DISK_POLL_S = 0.25
_DISK_MAX_ENTRIES = 100_000  # past this many files the folder counts as full (inode flooding)
_KILL_GRACE_S = 2.0


class SandboxError(RuntimeError):
    """The sandbox itself failed (could not start a command, could not clean up, used after close)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxLimits:
    """What one command may use. Sizes in MiB, times in seconds."""

    timeout_s: float = 30.0  # wall clock, per command
    cpu_s: int = 30  # CPU seconds, per process (RLIMIT_CPU)
    memory_mib: int = 1024  # address space, per process (RLIMIT_AS)
    file_mib: int = 64  # largest file a process may write (RLIMIT_FSIZE)
    disk_mib: int = 512  # the whole folder, polled during the command
    max_processes: int = 64  # processes and threads of the sandbox at once (RLIMIT_NPROC)
    output_bytes: int = 64 * 1024  # kept per stream; more kills the command
    network: bool = False  # False: the command gets a network namespace of its own, if allowed

    def __post_init__(self) -> None:
        for name in (
            "timeout_s",
            "cpu_s",
            "memory_mib",
            "file_mib",
            "disk_mib",
            "max_processes",
            "output_bytes",
        ):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class CommandResult:
    """What a command did. `exit_code` is negative (-signal) when a signal ended it."""

    exit_code: int
    stdout: str
    stderr: str
    truncated: bool = False  # stdout or stderr was cut at `output_bytes`
    timed_out: bool = False
    killed_reason: KilledReason = ""
    duration_s: float = 0.0
    escaped_paths: tuple[str, ...] = ()  # written outside the folder, found and removed

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.killed_reason


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxInfo:
    """What containment this machine allowed, said honestly rather than assumed."""

    root: str
    uid: int  # the uid commands run as
    separate_uid: bool  # a uid of the sandbox's own (needs root)
    network_isolated: bool  # commands run in a network namespace of their own
    notes: tuple[str, ...] = ()  # why something is not contained here


@runtime_checkable
class Sandbox(Protocol):
    """A place to run one task's tool calls. Remote sandboxes implement the same coroutines."""

    async def run(
        self, command: str | list[str], *, stdin: str | None = None, timeout_s: float | None = None
    ) -> CommandResult: ...

    async def write_file(self, path: str, data: str | bytes) -> None: ...

    async def read_file(self, path: str) -> bytes: ...

    async def close(self) -> None: ...


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _unshare_flags(separate_uid: bool) -> int:
    # Without root, a user namespace is what grants the right to make a network namespace.
    return _CLONE_NEWNET if separate_uid else _CLONE_NEWUSER | _CLONE_NEWNET


@functools.cache
def _probe_network_isolation(flags: int) -> tuple[bool, str]:
    """Whether a child may unshare its network namespace here; tried once per process."""
    if not sys.platform.startswith("linux"):
        return False, f"network isolation needs Linux namespaces; this is {sys.platform}"
    unshare = _libc().unshare

    def pre() -> None:
        if unshare(flags) != 0:
            raise OSError(ctypes.get_errno(), "unshare")

    try:
        subprocess.run(["true"], preexec_fn=pre, check=True, timeout=30, env={"PATH": _SANDBOX_PATH})
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"unshare(0x{flags:x}) was refused here ({exc}); commands can reach the network"
    return True, ""


# The reaper: the process the sandbox actually starts, as the caller's user, in a new session. It
# makes itself a child subreaper, forks the command and, in the child only, unshares the network,
# sets the rlimits and drops to the sandbox's uid before exec. It then reaps every descendant,
# orphans included, until none is left, and exits as the command did. Without it, the orphans of a
# fork bomb are reparented to PID 1, which may reap them late (this container's does, seconds
# later), and their zombies keep counting against RLIMIT_NPROC, failing the sandbox's next command.
# Because it stays the caller's uid, killing "every process of the sandbox's uid" spares it, so the
# zombies are reaped at once. It closes its own copies of the pipes, so EOF means the command's
# processes have all closed theirs. Exit 125 with the marker on stderr: the set-up failed (our fault).
_SETUP_FAILED = "miles-sandbox-setup-failed:"
_REAPER_SOURCE = r"""
import ctypes, json, os, resource, signal, sys
import warnings  # noqa: F401  os.execvp imports it, and after setuid the stdlib may be unreadable
cfg, argv = json.loads(sys.argv[1]), sys.argv[2:]
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: die with the sandbox's owner
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
pid = os.fork()
if pid == 0:
    try:
        if cfg["unshare"] and libc.unshare(cfg["unshare"]) != 0:
            raise OSError(ctypes.get_errno(), "unshare")
        for which, soft, hard in cfg["rlimits"]:
            resource.setrlimit(which, (soft, hard))
        if cfg["uid"] is not None:
            os.setgroups([])
            os.setgid(cfg["uid"])
            os.setuid(cfg["uid"])
        libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: setuid binaries (su, sudo) gain nothing
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG again: setuid cleared it
    except OSError as exc:
        os.write(2, f"@SETUP_FAILED@ {exc}\n".encode())
        os._exit(125)
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        os.write(2, f"{argv[0]}: {exc}\n".encode())
        os._exit(127 if isinstance(exc, FileNotFoundError) else 126)
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
status = 0
while True:
    try:
        child, child_status = os.waitpid(-1, 0)
    except ChildProcessError:
        break
    if child == pid:
        status = child_status
code = os.waitstatus_to_exitcode(status)
if code < 0:
    if -code not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
os._exit(code & 255)
""".replace("@SETUP_FAILED@", _SETUP_FAILED)


def _pids_of_uid(uid: int) -> list[int]:
    """Live (not zombie) processes whose real uid is `uid`, from /proc."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                status = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue  # it ended while we looked
        fields = dict(line.split(b":", 1) for line in status.splitlines() if b":" in line)
        if int(fields[b"Uid"].split()[0]) == uid and not fields[b"State"].strip().startswith(b"Z"):
            pids.append(int(name))
    return pids


def _pids_of_group(pgid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat_fields = f.read().rsplit(b")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(stat_fields[2]) == pgid and stat_fields[0] != b"Z":
            pids.append(int(name))
    return pids


def _tree_bytes(root: str) -> int | None:
    """Bytes the folder holds on disk; None when it holds more than _DISK_MAX_ENTRIES entries."""
    total, num_entries, stack = 0, 0, [root]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
        for entry in entries:
            num_entries += 1
            if num_entries > _DISK_MAX_ENTRIES:
                return None
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            total += st.st_blocks * 512
            if entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)
    return total


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)  # best effort: what is left is reported, not fatal
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


_STDERR_MARKERS: tuple[tuple[KilledReason, tuple[str, ...]], ...] = (
    ("memory", ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory")),
    ("file_size", ("File too large",)),
)
# Fork failures fail the tool call even when the shell that saw them exited 0.
_FORK_FAILED_MARKERS = (
    "fork: Resource temporarily unavailable",  # bash
    "fork: retry: Resource temporarily unavailable",  # bash
    "Cannot fork",  # dash
    "BlockingIOError: [Errno 11] Resource temporarily unavailable",  # python os.fork
)


def _classify(exit_code: int, stderr: str, via_shell: bool) -> KilledReason:
    """Why a command that ended by itself failed, when a limit explains it."""
    if any(marker in stderr for marker in _FORK_FAILED_MARKERS):
        return "processes"
    if exit_code == 0:
        return ""
    signum = -exit_code if exit_code < 0 else 0
    if via_shell and 128 < exit_code < 128 + 65:  # the shell reports a child's signal as 128 + n
        signum = exit_code - 128
    if signum == signal.SIGXCPU:
        return "cpu"
    if signum == signal.SIGXFSZ:
        return "file_size"
    for reason, markers in _STDERR_MARKERS:
        if any(marker in stderr for marker in markers):
            return reason
    return ""


class _CappedBuffer:
    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = cap_bytes
        self.chunks: list[bytes] = []
        self.num_bytes = 0
        self.truncated = False

    def add(self, chunk: bytes) -> bool:
        """Keep what fits; False once the cap is passed."""
        room = self.cap_bytes - self.num_bytes
        if room > 0:
            self.chunks.append(chunk[:room])
            self.num_bytes += min(room, len(chunk))
        if len(chunk) > room:
            self.truncated = True
        return not self.truncated

    def text(self) -> str:
        return b"".join(self.chunks).decode("utf-8", errors="replace")


class LocalSandbox:
    """A sandbox on this machine: its own folder, its own uid when root, limits on every command.

    Commands of one sandbox run one at a time (a second `run` waits), since a finished command takes
    every process of the sandbox with it. `close()` kills what is left and removes the folder when
    the sandbox made it (a given `root` is kept unless `remove_root=True`).
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        limits: SandboxLimits | None = None,
        *,
        env: dict[str, str] | None = None,
        remove_root: bool | None = None,
    ) -> None:
        if not sys.platform.startswith("linux"):
            raise SandboxError(
                f"LocalSandbox needs Linux (rlimits, /proc, namespaces); this is {sys.platform}. "
                "Use a remote Sandbox implementation instead."
            )
        self.limits = limits or SandboxLimits()
        made_root = root is None
        self.root = os.path.realpath(tempfile.mkdtemp(prefix="miles-sandbox-") if root is None else root)
        os.makedirs(self.root, exist_ok=True)
        self._remove_root = made_root if remove_root is None else remove_root
        self._closed = False
        self._lock = asyncio.Lock()
        notes: list[str] = []

        separate_uid = os.geteuid() == 0
        if separate_uid:
            self.uid = _UID_BASE + secrets.randbelow(_UID_SPAN)
            while _pids_of_uid(self.uid):  # vanishingly rare; a uid in use would share the limits
                self.uid = _UID_BASE + secrets.randbelow(_UID_SPAN)
            os.chown(self.root, self.uid, self.uid)
            os.chmod(self.root, 0o700)
        else:
            self.uid = os.getuid()
            notes.append(
                "not root: commands run as this user, so RLIMIT_NPROC is approximate, writes outside "
                "the folder are limited only by this user's permissions and are not detected"
            )
        self._separate_uid = separate_uid

        network_isolated = False
        if not self.limits.network:
            network_isolated, why = _probe_network_isolation(_unshare_flags(separate_uid))
            if why:
                notes.append(why)
        self.info = SandboxInfo(
            root=self.root,
            uid=self.uid,
            separate_uid=separate_uid,
            network_isolated=network_isolated,
            notes=tuple(notes),
        )
        tmp = os.path.join(self.root, ".tmp")
        os.makedirs(tmp, exist_ok=True)
        if separate_uid:
            os.chown(tmp, self.uid, self.uid)
        self._env = {"PATH": _SANDBOX_PATH, "HOME": self.root, "TMPDIR": tmp, "LANG": "C.UTF-8"}
        self._env.update(env or {})

    # ---- commands ---------------------------------------------------------------------------

    def _rlimits(self) -> list[tuple[int, int, int]]:
        lim = self.limits
        mib = 1024 * 1024
        num_processes = lim.max_processes
        if not self._separate_uid:  # the limit counts every process of this user
            num_processes += len(_pids_of_uid(self.uid))
        return [
            (resource.RLIMIT_CPU, lim.cpu_s, lim.cpu_s + 1),  # SIGXCPU at soft, SIGKILL at hard
            (resource.RLIMIT_AS, lim.memory_mib * mib, lim.memory_mib * mib),
            (resource.RLIMIT_FSIZE, lim.file_mib * mib, lim.file_mib * mib),
            (resource.RLIMIT_NPROC, num_processes, num_processes),
            (resource.RLIMIT_CORE, 0, 0),  # a core per SIGXCPU would fill the folder
        ]

    async def run(
        self, command: str | list[str], *, stdin: str | None = None, timeout_s: float | None = None
    ) -> CommandResult:
        """Run `command` (a shell line for /bin/sh, or an argv list) in the folder, within the limits."""
        self._check_open()
        if isinstance(command, str):
            argv, via_shell = ["/bin/sh", "-c", command], True
        elif isinstance(command, list) and command and all(isinstance(a, str) for a in command):
            argv, via_shell = list(command), False
        else:
            raise ValueError(f"command must be a shell string or a non-empty list of str, got {command!r}")
        timeout_s = self.limits.timeout_s if timeout_s is None else timeout_s
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        async with self._lock:
            return await self._run(argv, via_shell, stdin, timeout_s)

    async def _run(
        self, argv: list[str], via_shell: bool, stdin: str | None, timeout_s: float
    ) -> CommandResult:
        network_flags = _unshare_flags(self._separate_uid) if self.info.network_isolated else 0
        uid = self.uid if self._separate_uid else None
        started = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-I",
                "-S",
                "-c",
                _REAPER_SOURCE,
                json.dumps({"unshare": network_flags, "rlimits": self._rlimits(), "uid": uid}),
                *argv,
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=self.root,
                env=self._env,
                start_new_session=True,
            )
        except OSError as exc:
            raise SandboxError(f"could not start the sandbox's reaper ({sys.executable}): {exc}") from exc

        out, err = _CappedBuffer(self.limits.output_bytes), _CappedBuffer(self.limits.output_bytes)
        over_cap = asyncio.Event()

        async def pump(stream: asyncio.StreamReader, buf: _CappedBuffer) -> None:
            while chunk := await stream.read(_READ_CHUNK_BYTES):
                if not buf.add(chunk):
                    over_cap.set()  # keep draining, so the pipe reaches EOF once the kill lands

        async def feed() -> None:
            if stdin is None or proc.stdin is None:
                return
            try:
                proc.stdin.write(stdin.encode())
                await proc.stdin.drain()
                proc.stdin.close()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the command exited without reading all of its input: its own business

        assert proc.stdout is not None and proc.stderr is not None
        done = asyncio.ensure_future(
            asyncio.gather(pump(proc.stdout, out), pump(proc.stderr, err), feed(), proc.wait())
        )
        try:
            reason = await self._watch(done, over_cap, started + timeout_s)
            timed_out = reason == "timeout"
            num_live = len(self._live_pids(proc.pid))
            if reason in ("timeout", "output") and (
                num_live >= self.limits.max_processes or _classify(1, err.text(), False) == "processes"
            ):
                # it timed out, or flooded its output with fork failures, because it filled the process table
                reason = "processes"
            await self._kill_all(proc.pid)
            await asyncio.wait({done}, timeout=_KILL_GRACE_S)
        except BaseException:
            await asyncio.shield(self._kill_all(proc.pid))
            done.cancel()
            raise
        if not done.done():  # something escaped the kill and holds the pipes (only without root)
            done.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await done
        exit_code = proc.returncode if proc.returncode is not None else -signal.SIGKILL
        stderr_text = err.text()
        if exit_code == 125 and stderr_text.startswith(_SETUP_FAILED):
            raise SandboxError(f"could not set up the sandbox for {argv!r}: {stderr_text.strip()}")
        if not reason:
            reason = _classify(exit_code, stderr_text, via_shell)
            if not reason and num_live >= self.limits.max_processes:
                reason = "processes"  # the command returned, leaving a full process table behind
        if not reason:
            used = await asyncio.to_thread(_tree_bytes, self.root)
            if used is None or used > self.limits.disk_mib * 1024 * 1024:
                reason = "disk"
        escaped = await asyncio.to_thread(self._sweep_escapes)
        if escaped and not reason:
            reason = "escape"
        return CommandResult(
            exit_code=exit_code,
            stdout=out.text(),
            stderr=stderr_text,
            truncated=out.truncated or err.truncated,
            timed_out=timed_out,
            killed_reason=reason,
            duration_s=time.monotonic() - started,
            escaped_paths=escaped,
        )

    async def _watch(self, done: asyncio.Future, over_cap: asyncio.Event, deadline: float) -> KilledReason:
        """Wait for the command; the reason to kill it early, or "" when it ended by itself."""
        over_wait = asyncio.ensure_future(over_cap.wait())
        try:
            while True:
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:
                    return "timeout"
                await asyncio.wait(
                    {done, over_wait},
                    timeout=min(remaining_s, _DISK_POLL_S),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if over_cap.is_set():
                    return "output"
                if done.done():
                    return ""
                used = await asyncio.to_thread(_tree_bytes, self.root)
                if used is None or used > self.limits.disk_mib * 1024 * 1024:
                    return "disk"
        finally:
            over_wait.cancel()

    def _live_pids(self, pgid: int) -> list[int]:
        return _pids_of_uid(self.uid) if self._separate_uid else _pids_of_group(pgid)

    async def _kill_all(self, pgid: int | None) -> None:
        """Kill every process of the sandbox's uid (without root: of the command's process group)."""
        if not self._separate_uid:
            if pgid is not None:  # start_new_session made the reaper's pid the group's id
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
            return
        uid = self.uid

        def kill_as_uid() -> None:
            # kill(-1) reaches every process this uid may signal, i.e. the sandbox's, and the
            # kernel walks the process list under a lock that fork also takes: nothing slips by.
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.kill(-1, signal.SIGKILL)

        for _ in range(10):
            if not _pids_of_uid(uid):
                return
            killer = await asyncio.create_subprocess_exec(
                "true",
                preexec_fn=kill_as_uid,
                env={"PATH": _SANDBOX_PATH},
                cwd="/",
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            await killer.wait()
        left = _pids_of_uid(uid)
        if left:
            raise SandboxError(f"processes {left} of sandbox uid {uid} survived SIGKILL")

    def _sweep_escapes(self) -> tuple[str, ...]:
        """Remove what the sandbox's uid made in world-writable folders outside its own."""
        if not self._separate_uid:
            return ()
        found = []
        for folder in dict.fromkeys(
            os.path.realpath(d) for d in (*_WORLD_WRITABLE_DIRS, tempfile.gettempdir())
        ):
            try:
                entries = list(os.scandir(folder))
            except (FileNotFoundError, PermissionError):
                continue
            for entry in entries:
                try:
                    owner = entry.stat(follow_symlinks=False).st_uid
                except FileNotFoundError:
                    continue
                if owner == self.uid and os.path.realpath(entry.path) != self.root:
                    found.append(entry.path)
                    _remove(entry.path)
        return tuple(sorted(found))

    # ---- files ------------------------------------------------------------------------------

    def _resolve(self, path: str) -> str:
        """The real path of `path` inside the folder; ValueError when it would land outside."""
        if not isinstance(path, str) or not path or os.path.isabs(path):
            raise ValueError(f"sandbox paths are relative to the sandbox folder, got {path!r}")
        full = os.path.realpath(os.path.join(self.root, path))
        if os.path.commonpath([full, self.root]) != self.root or full == self.root:
            raise ValueError(f"path {path!r} resolves to {full}, outside the sandbox folder {self.root}")
        return full

    async def write_file(self, path: str, data: str | bytes) -> None:
        """Write `data` to `path` under the folder (parents made), owned by the sandbox's uid."""
        self._check_open()
        payload = data.encode() if isinstance(data, str) else bytes(data)
        if len(payload) > self.limits.file_mib * 1024 * 1024:
            raise ValueError(f"{len(payload)} bytes for {path!r} exceed file_mib={self.limits.file_mib}")
        full = self._resolve(path)
        await asyncio.to_thread(self._write, full, payload)

    def _write(self, full: str, payload: bytes) -> None:
        parent = os.path.dirname(full)
        missing = []
        probe = parent
        while not os.path.isdir(probe):
            missing.append(probe)
            probe = os.path.dirname(probe)
        os.makedirs(parent, exist_ok=True)
        # O_NOFOLLOW: a symlink planted by a command must not turn this root-owned write outward.
        fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        if self._separate_uid:
            for made in (*missing, full):
                os.chown(made, self.uid, self.uid, follow_symlinks=False)

    async def read_file(self, path: str) -> bytes:
        """The bytes of `path` under the folder (at most file_mib)."""
        self._check_open()
        full = self._resolve(path)
        return await asyncio.to_thread(self._read, full)

    def _read(self, full: str) -> bytes:
        fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            return f.read(self.limits.file_mib * 1024 * 1024)

    # ---- lifecycle ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"sandbox {self.root} is closed")

    async def close(self) -> None:
        """Kill what is left of the sandbox's processes and remove its folder (when it made it)."""
        if self._closed:
            return
        self._closed = True
        async with self._lock:
            if self._separate_uid:
                await self._kill_all(None)
                await asyncio.to_thread(self._sweep_escapes)
            if self._remove_root:
                await asyncio.to_thread(shutil.rmtree, self.root)
