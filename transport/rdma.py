"""RDMA transport (one-sided writes into engine-registered memory): only the import guard so far.

The wire code is not written: this machine has no RDMA device or soft-RoCE module, and a
transport that cannot be run here would be untested. The schedule it will execute is planned
and tested in `rdma_plan.py`. Install: `pip install 'miles-async[rdma]'` (pyverbs needs the
libibverbs and libnl development headers; DESIGN.md, "Weight transports", notes the build pitfalls).

Try it: `python -c "from miles_async.transport.rdma import require_pyverbs; require_pyverbs()"`.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def require_pyverbs() -> ModuleType:
    """Return the `pyverbs` module, or raise ImportError naming the `[rdma]` extra."""
    try:
        return importlib.import_module("pyverbs")
    except ImportError as e:
        raise ImportError("the RDMA transport needs pyverbs: pip install 'miles-async[rdma]' "
                          "(needs libibverbs and libnl headers, and an RDMA device or soft-RoCE)") from e
