"""The shared-memory segments of a run: named under the run's prefix on this node, always unlinked.

Every segment a process of a run creates (the data plane's blobs, an engine's shared weights) is
a file in a shared-memory folder (/dev/shm: POSIX shared memory is a file there on Linux) named

    miles-<run>-<pid>-<what>        e.g. miles-3fa9c2d1-41872-dp5e0b77a1-3, miles-3fa9c2d1-41903-w9c1d...

`<run>` is the run's tag on this node, chosen by the node's root process (the first process of
the tree that is not a child of a run: `miles-async run`, a `launch` node, `serve`, a test) and
handed to every process it spawns (`join_run`); `<pid>` is the process that created the segment.
The root holds an `flock` on `miles-<run>.lock` in the same folder for as long as it lives; the
kernel releases it however the root ends, SIGKILL included, so a free lock means a dead run.

Who unlinks a segment, in the order it happens (each step a backstop for the one before):
1. its creator, when the blob is freed or the weights are closed (the normal case);
2. its creator at exit (`atexit`; in a child process, multiprocessing's exit finalizers too: a
   child forked by the fork server ends in `os._exit`, which skips `atexit`): whatever it still
   holds under its pid;
3. the parent system, when it sees a child process exit, however it exited (`reap_process`:
   `miles-<run>-<pid>-*`), so a SIGKILLed engine or trainer leaks nothing while the run goes on,
   and a respawned process does not pile up segments;
4. the root at exit: everything left under `miles-<run>-` (a grandchild killed with its parent),
   then its lock;
5. the next root to start on this node (`run_tag`, any run's): every run whose lock is free or
   gone (a root killed by SIGKILL, a whole process group killed at once) is swept. Only this
   user's files can be opened and unlinked there, so another user's runs are never touched.

No segment of ours is registered with Python's `resource_tracker`: the runtime unlinks them,
and a tracker would warn about (and unlink) segments that another process legitimately owns.

Try it: `pytest tests/unit/test_segments.py`.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import logging
import multiprocessing.util
import os
import re
import secrets
import tempfile
import threading
from collections.abc import Iterable

__all__ = ["default_folder", "join_run", "process_prefix", "reap_process", "run_tag", "sweep_stale", "use_folder"]

log = logging.getLogger("miles_async.runtime")

PREFIX = "miles-"
LOCK_SUFFIX = ".lock"
_TAG = re.compile(r"[0-9a-f]{8}")
_NAME = re.compile(rf"{PREFIX}([0-9a-f]{{8}})(?:-\d+-.+|{re.escape(LOCK_SUFFIX)})")

_tag: str | None = None
_lock_fd: int | None = None  # set in a root process: the fd holding the run's lock
_owner_pid = 0  # the process that set `_tag`: a forked copy of it must not run its exit sweeps
_claim = threading.Lock()  # an engine may make its first segment in a thread of its own
_swept: set[str] = set()  # folders this process already swept for dead runs
_extra_folders: set[str] = set()  # folders besides the default one where this process puts segments


def default_folder() -> str:
    """/dev/shm where it exists and is writable (tmpfs: memory, not disk), else the temp folder."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


def run_tag() -> str:
    """This process's run tag: its parent's (`join_run`), else a new run's, whose lock this
    process then holds (after sweeping the segments of dead runs from the default folder)."""
    if _tag is not None:
        return _tag
    with _claim:
        return _tag or _claim_run()


def _claim_run() -> str:
    global _tag, _lock_fd, _owner_pid
    folder = default_folder()
    _sweep_once(folder)
    while True:  # the lock is taken under a temporary name, then linked into place: a sweeper never
        tag = secrets.token_hex(4)  # sees a lock file that nobody holds yet
        lock_path = os.path.join(folder, f"{PREFIX}{tag}{LOCK_SUFFIX}")
        temp_path = os.path.join(folder, f".{PREFIX}{tag}-{os.getpid()}{LOCK_SUFFIX}")
        fd = os.open(temp_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            os.link(temp_path, lock_path)
        except FileExistsError:
            os.close(fd)
            continue
        finally:
            os.unlink(temp_path)
        break
    _tag, _lock_fd, _owner_pid = tag, fd, os.getpid()
    atexit.register(_end_run, folder)
    return tag


def join_run(tag: str) -> None:
    """Adopt the run of the parent process (a child does so before it creates any segment)."""
    global _tag, _owner_pid
    if not _TAG.fullmatch(tag):
        raise ValueError(f"{tag!r} is not a run tag (8 hex digits, as run_tag() makes)")
    if _tag is not None and _tag != tag:
        raise RuntimeError(f"this process already belongs to run {_tag}, not {tag}")
    if _tag is None:
        _tag, _owner_pid = tag, os.getpid()
        atexit.register(_reap_self)
        multiprocessing.util.Finalize(None, _reap_self, exitpriority=0)  # once more is harmless


def process_prefix(pid: int | None = None) -> str:
    """The name prefix of the segments process `pid` (default: this one) creates in this run."""
    return f"{PREFIX}{run_tag()}-{os.getpid() if pid is None else pid}-"


def reap_process(pid: int, folders: Iterable[str]) -> list[str]:
    """Unlink the segments process `pid` of this run left in `folders` (it exited); their paths."""
    if pid == os.getpid():
        raise ValueError("reap_process is for processes that exited, not this one")
    return _unlink_prefixed(process_prefix(pid), folders)


def sweep_stale(folder: str) -> int:
    """Unlink, in `folder`, the segments and lock of every run whose lock (always in the default
    folder) nobody holds, its root being dead, or that has no lock at all. Returns how many
    segments it unlinked."""
    with os.scandir(folder) as entries:
        names = [entry.name for entry in entries if entry.name.startswith(PREFIX)]
    by_tag = {match.group(1) for match in map(_NAME.fullmatch, names) if match}
    num_unlinked = 0
    for tag in by_tag:
        if tag == _tag or not _is_dead(os.path.join(default_folder(), f"{PREFIX}{tag}{LOCK_SUFFIX}")):
            continue
        gone = _unlink_prefixed(f"{PREFIX}{tag}-", [folder])
        with contextlib.suppress(FileNotFoundError, PermissionError):
            os.unlink(os.path.join(folder, f"{PREFIX}{tag}{LOCK_SUFFIX}"))
        if gone:
            log.info("unlinked %d shared-memory segments of a dead run (%s) from %s", len(gone), tag, folder)
        num_unlinked += len(gone)
    return num_unlinked


def _is_dead(lock_path: str) -> bool:
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except FileNotFoundError:
        return True  # segments without a lock: their root is gone (it takes its lock before any segment)
    except OSError:
        return False  # not ours to judge (another user's run)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held: the run is alive
    finally:
        os.close(fd)  # drops our lock too, if we got it
    return True


def _unlink_prefixed(prefix: str, folders: Iterable[str]) -> list[str]:
    gone = []
    for folder in dict.fromkeys(folders):
        try:
            with os.scandir(folder) as entries:
                names = [entry.name for entry in entries if entry.name.startswith(prefix)]
        except FileNotFoundError:
            continue
        for name in names:
            path = os.path.join(folder, name)
            try:
                os.unlink(path)
            except (FileNotFoundError, PermissionError):
                continue  # unlinked meanwhile by its owner, or another user's
            gone.append(path)
    return gone


def _reap_self() -> None:
    if os.getpid() == _owner_pid:
        _unlink_prefixed(process_prefix(), _folders())


def _end_run(folder: str) -> None:
    """The root's exit: every segment of the run still here, then the lock."""
    global _lock_fd
    if os.getpid() != _owner_pid:
        return
    left = _unlink_prefixed(f"{PREFIX}{_tag}-", _folders())
    if left:
        log.info("unlinked %d shared-memory segments the run left", len(left))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(folder, f"{PREFIX}{_tag}{LOCK_SUFFIX}"))
    if _lock_fd is not None:
        os.close(_lock_fd)
        _lock_fd = None


def use_folder(folder: str) -> None:
    """Note that this process puts segments in `folder` too (a configured data-plane folder), so
    that the exit sweeps look there; sweeps it for dead runs once."""
    _extra_folders.add(folder)
    _sweep_once(folder)


def _sweep_once(folder: str) -> None:
    if folder not in _swept:
        _swept.add(folder)
        sweep_stale(folder)


def _folders() -> list[str]:
    return [default_folder(), *sorted(_extra_folders)]
