"""A module for a fork server's preload in tests/dist/test_spawn.py: importing it appends
"imported PID" to the file named by $MILES_TEST_EXIT_MARKER, and it registers an atexit handler
that appends "atexit PID" (which the server's quickexit must skip)."""

from __future__ import annotations

import atexit
import os


def _note(what: str) -> None:
    with open(os.environ["MILES_TEST_EXIT_MARKER"], "a") as f:
        f.write(f"{what} {os.getpid()}\n")


_note("imported")
atexit.register(_note, "atexit")
