"""The `alone` marker: a test that times a real run against a model of it (the simulator's
prediction of a run recorded now) needs the cores to itself, since a test of another file running
beside it on another pytest-xdist worker changes the run's timing while it records. Under xdist
every test holds a shared lock on a file of its session while it runs (setup to teardown) and an
`alone` test an exclusive one, so it starts once the running tests end and none starts beside it;
the `alone` tests are collected first, where the tests running beside them are short.
A turnstile lock in front makes the exclusive request wait its turn rather than forever behind a
stream of shared ones. Without xdist (one process) there is nothing to wait for."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "alone: no other test runs beside it (under pytest-xdist)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The `alone` tests first (a stable sort): the session's first tests on the other worker are
    short ones, so the exclusive lock comes at once, where later it would wait out whatever long
    end-to-end test that worker was in the middle of, its own worker idle meanwhile."""
    items.sort(key=lambda item: item.get_closest_marker("alone") is None)


def lock_files(config: pytest.Config) -> tuple[Path, Path] | None:
    """The session's two lock files, in the folder above the worker's own temporary one (xdist gives
    each worker `<the session's basetemp>/popen-gwN`), which pytest removes with old sessions."""
    if "PYTEST_XDIST_WORKER" not in os.environ or not config.option.basetemp:
        return None
    session = Path(config.option.basetemp).parent
    return session / "alone.turnstile", session / "alone.room"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    files = lock_files(item.config)
    if files is None:
        yield
        return
    alone = item.get_closest_marker("alone") is not None
    with open(files[0], "a") as turnstile, open(files[1], "a") as room:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            if not alone:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(room, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
