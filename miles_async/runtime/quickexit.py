"""Imported by the fork server alone (`child.context` names it last in the server's preload): the
server's exit becomes an `os._exit`.

A fork server lives until its owner's process is gone, then exits like any interpreter: its atexit
handlers and the teardown of every module it preloaded (torch, the engine and trainer actors),
seconds of CPU for a process that only ever forked. It holds the owner's stderr while it does, so
whoever reads the owner's output to its end (a shell pipeline, a test's `subprocess.run`) waits
those seconds after the owner has exited. The children forked from it are unaffected: each one ends
in `os._exit` already (multiprocessing's fork server does that), without running the server's
atexit handlers.

Registered on import, last (atexit runs the handlers last in, first out), so that it runs before
the others and skips them; it flushes the standard streams first. Only an import from the fork
server's preload (`multiprocessing.forkserver.main` on the stack) registers it: imported anywhere
else (a test, the docs tools) this module does nothing, so no other process's exit, nor its exit
status, is cut short.
"""

from __future__ import annotations

import atexit
import os
import sys
from types import FrameType


def _exit_now() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed or replaced: nothing to flush
            pass
    os._exit(0)


def _imported_by_fork_server() -> bool:
    import multiprocessing.forkserver

    serve = multiprocessing.forkserver.main.__code__
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is serve:
            return True
        frame = frame.f_back
    return False


if _imported_by_fork_server():
    atexit.register(_exit_now)
