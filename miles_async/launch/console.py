"""What the run verbs say on the console: `run` (miles_async/launch/cli.py) and `launch` (miles_async/launch/launcher.py).

How loudly a verb logs (`--quiet`, `--verbose`) and the line a restart prints on stderr. Both
verbs use them; they live here, below both, so the launcher needs nothing from the command line's
module (which imports the launcher when the `launch` verb runs).
"""

from __future__ import annotations

import argparse
import logging


def log_level(args: argparse.Namespace) -> int:
    """--quiet: warnings only; --verbose: every weight update, probe and turn (DEBUG); else the few
    lines a run says once (INFO) beside the progress display."""
    return logging.WARNING if args.quiet else logging.DEBUG if args.verbose else logging.INFO


def restart_line(attempt: int, max_restarts: int, cause: BaseException) -> str:
    """What a restart says on stderr: which one, and the cause (the run's own one-line error)."""
    return f"restart {attempt} of {max_restarts}: {cause}"
