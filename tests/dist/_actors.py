"""Actors and messages of the multi-process tests: child processes import them from here.

Child processes are spawned (not forked), so each class must be importable by its module name;
pytest puts `tests/dist` on `sys.path` and the runtime hands `sys.path` to its children.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from typing import Any

import msgspec

from miles_async.runtime import Actor, BlobRef, DataPlaneStats, Message, handler


class CounterStats(msgspec.Struct, frozen=True, kw_only=True):
    """A typed reply: the caller decodes it back into this struct."""

    count: int
    history: list[int]
    pid: int
    incarnation: int


class PutInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A blob put by a `BlobKeeper`: its ref and the sha256 of its bytes."""

    ref: BlobRef
    sha256: str


class ReadInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a `BlobKeeper` read: the sha256 of the bytes, and its data plane's stats after."""

    sha256: str
    stats: DataPlaneStats


# -- messages -------------------------------------------------------------------------------


class Add(Message[int]):
    amount: int


class Get(Message[int]):
    """The counter's value."""


class Record(Message):
    """Sent as a tell, to check arrival order."""

    seq: int


class Stats(Message[CounterStats]):
    """The actor's counters."""


class Pid(Message[int]):
    """The process id of the actor's process."""


class GetEnv(Message[Any]):
    name: str


class Boom(Message):
    """Ask: the handler raises ValueError(text); tell: the actor crashes."""

    text: str


class Crash(Message):
    """A tell whose handler raises RuntimeError(text): the actor crashes."""

    text: str


class Sleep(Message[float]):
    seconds: float


class Blob(Message[int]):
    data: bytes


class Fill(Message[bytes]):
    """Ask for `num_bytes` bytes back (a reply may be too large to send)."""

    num_bytes: int


class Unhandled(Message):
    """No actor here handles it (a well-formed message of the wrong type)."""

    x: int


class Hold(Message):
    """Finishes only once the actor's gate opens."""

    tag: int


class OpenGate(Message):
    pass


class CloseGate(Message):
    pass


class Held(Message[list[int]]):
    """How many asks the gate holds."""


class PutRandom(Message[PutInfo]):
    """Put `num_bytes` random bytes into the receiver's data plane."""

    num_bytes: int


class ReadRef(Message[ReadInfo]):
    ref: BlobRef


class FreeRefs(Message):
    """Ask the receiver to free refs (its own, or another process's through their owner)."""

    refs: list[BlobRef]


class PlaneStats(Message[DataPlaneStats]):
    """The data plane's stats in the actor's process."""


class Family(Message[list[int]]):
    """Ask a parent actor for its pid and its own child process's pid."""


class HoldWeights(Message[str]):
    """Create a small shared-weights segment (as an engine does) and keep it; its name."""



# -- actors ---------------------------------------------------------------------------------

# how many instances this process has built: a restart in place makes a new one in the same pid
_incarnations = 0


class Counter(Actor):
    def __init__(self, start: int = 0) -> None:
        global _incarnations
        _incarnations += 1
        self.incarnation = _incarnations
        self.count = start
        self.history: list[int] = []

    @handler
    async def add(self, msg: Add) -> int:
        self.count += msg.amount
        return self.count

    @handler
    def get(self, msg: Get) -> int:
        return self.count

    @handler
    def record(self, msg: Record) -> None:
        self.history.append(msg.seq)

    @handler
    def stats(self, msg: Stats) -> CounterStats:
        return CounterStats(count=self.count, history=list(self.history), pid=os.getpid(),
                            incarnation=self.incarnation)

    @handler
    def blob(self, msg: Blob) -> int:
        return len(msg.data)

    @handler
    def fill(self, msg: Fill) -> bytes:
        return b"x" * msg.num_bytes

    @handler
    def pid(self, msg: Pid) -> int:
        return os.getpid()

    @handler
    def getenv(self, msg: GetEnv) -> Any:
        return os.environ.get(msg.name)

    @handler
    def boom(self, msg: Boom) -> None:
        raise ValueError(msg.text)  # dist-test: boom raise line

    @handler
    def crash(self, msg: Crash) -> None:
        raise RuntimeError(msg.text)

    @handler(concurrent=True)  # so that other asks can prove it was delivered while it waits
    async def sleep(self, msg: Sleep) -> float:
        await asyncio.sleep(msg.seconds)
        return msg.seconds


class Gate(Actor):
    """A small mailbox whose `Hold` handlers wait for the gate; `OpenGate` may overlap them."""

    mailbox_capacity = 4

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.held: list[int] = []

    @handler
    async def hold(self, msg: Hold) -> None:
        await self.gate.wait()
        self.held.append(msg.tag)

    @handler(concurrent=True)
    async def open(self, msg: OpenGate) -> None:
        self.gate.set()

    @handler(concurrent=True)
    async def close(self, msg: CloseGate) -> None:
        self.gate.clear()

    @handler(concurrent=True)
    async def list_held(self, msg: Held) -> list[int]:
        return list(self.held)


class Parent(Actor):
    """Lives in a child process and spawns its own child process (a grandchild of the test)."""

    async def on_start(self) -> None:
        self.kid = await self.spawn(Counter, f"{self.name}-kid", process=True)

    @handler
    async def family(self, msg: Family) -> list[int]:
        return [os.getpid(), await self.kid.ask(Pid(), timeout_s=30)]

    @handler
    def crash(self, msg: Crash) -> None:
        raise RuntimeError(msg.text)


class FailsToStart(Actor):
    async def on_start(self) -> None:
        raise ValueError("no such device: cuda:7")  # dist-test: on_start raise line

    @handler
    def get(self, msg: Get) -> int:
        return 0


class BlobKeeper(Actor):
    """Puts, reads and frees data-plane blobs in its process when asked; holds shared weights."""

    def __init__(self) -> None:
        self.held: list[Any] = []  # SharedWeights segments, kept open until the process ends

    @handler
    def put_random(self, msg: PutRandom) -> PutInfo:
        data = os.urandom(msg.num_bytes)
        return PutInfo(ref=self.system.dataplane.put(data), sha256=hashlib.sha256(data).hexdigest())

    @handler
    async def read_ref(self, msg: ReadRef) -> ReadInfo:
        view = await self.system.dataplane.read(msg.ref)
        digest = hashlib.sha256(view).hexdigest()
        view.release()
        return ReadInfo(sha256=digest, stats=self.system.dataplane.stats)

    @handler
    def free_refs(self, msg: FreeRefs) -> None:
        self.system.dataplane.free(msg.refs)

    @handler
    def plane_stats(self, msg: PlaneStats) -> DataPlaneStats:
        return self.system.dataplane.stats

    @handler
    def pid(self, msg: Pid) -> int:
        return os.getpid()

    @handler
    def hold_weights(self, msg: HoldWeights) -> str:
        import torch

        from miles_async.transport.shm import SharedWeights

        weights = SharedWeights.like({"w": torch.ones(64, 16)})
        self.held.append(weights)
        return weights.name
