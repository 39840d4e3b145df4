"""Processes say what they are: `miles-async: engine-0` in `ps`, `miles:engine-0` in `top`.

    set_title("trainer-0")    # ps -o pid,comm,args:  1234 miles:trainer-0  miles-async: trainer-0

Two names tell a process apart, as Ray's `ray::` and vLLM's `VLLM::` ones do: its command line
(`ps aux`, `top -c`, `/proc/<pid>/cmdline`), set by `setproctitle`, and the 15-byte kernel name
(`top`, `ps -o comm`, `/proc/<pid>/comm`), which would keep only `miles-async: en` of the first:
it gets the shorter `miles:<role>` instead. Threads started afterwards inherit the short name.
The runtime names each actor's process where it starts (child.py); the command line names its own.
"""

from __future__ import annotations

import logging

__all__ = ["set_title"]

log = logging.getLogger("miles_async.runtime")

TITLE_PREFIX = "miles-async: "
COMM_PREFIX = "miles:"
COMM_BYTES = 15  # TASK_COMM_LEN - 1 on Linux


def set_title(role: str) -> None:
    """Name this process `miles-async: <role>` (command line) and `miles:<role>` (kernel name)."""
    try:
        import setproctitle
    except ImportError:  # a dependency, but only cosmetic: an environment without it still runs
        log.debug("setproctitle is not installed: this process keeps its name (pip install setproctitle)")
        return
    setproctitle.setproctitle(TITLE_PREFIX + role)
    # setproctitle sets the kernel name to the title's first 15 bytes; the main thread's name is
    # the process's (where the platform has one: elsewhere this does nothing)
    setproctitle.setthreadtitle((COMM_PREFIX + role).encode()[:COMM_BYTES].decode(errors="ignore"))
