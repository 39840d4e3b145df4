"""`ActorSystem`: one per process. Hosts actors behind one ZeroMQ ROUTER, sends through Links.

    async with ActorSystem() as system:                       # binds ipc://<run_dir>/root.sock
        counter = await system.spawn(Counter, "counter")      # in this process
        worker = await system.spawn(Worker, "w0", process=True,
                                    restart=RestartPolicy(mode="on_failure"))
        await counter.tell(Add(amount=2))
        total = await counter.ask(Get(), timeout_s=5)

What lives here:
- hosting: each hosted actor has a mailbox (a deque) and runs one handler at a time (see
  `actor.py`); frames from the ROUTER are decoded with the actor's one typed decoder and
  delivered; a bad frame gets a typed ERROR reply and nothing else happens;
- calling: one Link per host process (refs.py); replies, ACKs and PONGs come back on it;
- supervision: every spawned actor has an owner (an actor, or the system); when it dies the
  owner's system applies its `RestartPolicy`, restarting it in place, respawning its process,
  or leaving it dead (callers then get `ActorDeadError` with the root cause);
- liveness: every Link pings its host; a host silent for `heartbeat_timeout_s` is lost, and a
  child process's exit is seen at once through its sentinel;
- the directory (names to addresses) is an actor, `$directory`, on the first system of a run;
- the data plane (`dataplane.py`): bulk bytes in shared memory, read by `BlobRef`; other
  processes reach it through the `$dataplane` actor, and the segments of a child process that
  died are unlinked when its exit is seen.

Sockets are plain (non-asyncio) pyzmq sockets driven by `loop.add_reader` on their FD, drained
with non-blocking receives: far cheaper per message than a Future per `recv`.

The pieces below this module reach the system only through Protocols that it implements, each
declared beside its user: `refs.Sender` (what an ActorRef sends through), `dataplane.DataPlaneHost`,
`actor.ActorHost` (an actor's `self.system`), `owner.SupervisorHost` and `control.ControlHost`.
None touches a private member here, so system.py sits on top of the runtime's imports.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import os
import shutil
import tempfile
from collections import deque
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import zmq

from miles_async.runtime import security, wire
from miles_async.runtime.actor import Actor, HandlerSpec
from miles_async.runtime.child import ChildSpec
from miles_async.runtime.config import RuntimeConfig
from miles_async.runtime.control import DataPlaneActor, Directory, SystemActor
from miles_async.runtime.dataplane import DATAPLANE_ACTOR, DataPlane
from miles_async.runtime.eager import PENDING, start
from miles_async.runtime.errors import (
    ActorDeadError,
    ActorError,
    AskTimeoutError,
    BadMessageError,
    Failure,
    RemoteError,
    SpawnError,
    UnknownActorError,
)
from miles_async.runtime.messages import (
    ActorAddress,
    ChildDied,
    ChildReady,
    Lookup,
    Message,
    Register,
    StopActor,
    Unregister,
)
from miles_async.runtime.owner import (
    DEAD,
    NOT_STARTED,
    RESTARTING,
    RUNNING,
    STARTING,
    STOPPED,
    STOPPING,
    SYSTEM_ACTOR,
    Child,
    Supervisor,
)
from miles_async.runtime.refs import ActorRef, Link, reply_decoder
from miles_async.runtime.supervision import RestartPolicy

if TYPE_CHECKING:
    from typing_extensions import Self

    from miles_async.runtime.control import ControlHost

log = logging.getLogger("miles_async.runtime")

A = TypeVar("A", bound=Actor)

DIRECTORY_ACTOR = "$directory"
_BATCH = 512  # frames handled per wake-up before yielding to other callbacks
_PING = wire.frame(wire.PING, 0)
_send, _recv, _get = wire.raw_send, wire.raw_recv, wire.raw_get
NOBLOCK, SNDMORE_NOBLOCK, EVENTS, RCVMORE, POLLIN = (
    wire.NOBLOCK, wire.SNDMORE_NOBLOCK, wire.EVENTS, wire.RCVMORE, wire.POLLIN)


class _Env:
    """One delivered message: where its outcome goes (a remote identity, or a local future)."""

    __slots__ = ("fut", "ident", "is_ask", "msg", "msg_id", "spec", "timer")

    def __init__(self, ident: bytes | None, msg_id: int, is_ask: bool, msg: Message, spec: HandlerSpec,
                 fut: asyncio.Future[Any] | None, timer: asyncio.TimerHandle | None) -> None:
        self.timer = timer
        self.ident = ident
        self.msg_id = msg_id
        self.is_ask = is_ask
        self.msg = msg
        self.spec = spec
        self.fut = fut


class _Hosted:
    """An actor hosted by this process: its instance, mailbox and state."""

    __slots__ = (
        "actor",
        "args",
        "backlog",
        "capacity",
        "cls",
        "failure",
        "kwargs",
        "name",
        "owner",
        "owner_address",
        "queue",
        "route",
        "running",
        "state",
        "table",
        "tasks",
    )

    def __init__(self, name: str, cls: type[Actor], args: tuple[Any, ...], kwargs: dict[str, Any],
                 owner: str, owner_address: str) -> None:
        self.name = name
        self.cls = cls
        self.args = args
        self.kwargs = kwargs
        self.table = cls.handler_table()
        self.capacity = int(cls.mailbox_capacity)
        self.owner = owner
        self.owner_address = owner_address
        self.actor: Actor | None = None
        self.queue: deque[_Env] = deque()
        self.running = False
        self.tasks: set[asyncio.Task[Any]] = set()
        self.state = STARTING
        self.failure: Failure | None = None
        self.backlog: dict[bytes, int] = {}
        self.route = name.encode()




class ActorSystem:
    """The actor host of one process (see the module docstring)."""

    def __init__(self, name: str = "root", *, config: RuntimeConfig | None = None, directory: str | None = None,
                 bind: str | None = None, key_dir: str | None = None) -> None:
        self.name = name
        self.config = config or RuntimeConfig()
        self._directory_address = directory  # None: this system hosts the run's directory
        self._bind = bind
        self._key_dir = key_dir
        self._owns_run_dir = False
        self.run_dir = ""
        self.address = ""
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # set by start()
        self._ctx: zmq.Context | None = None
        self._router: zmq.Socket | None = None
        self._router_scheduled = False
        self._auth: Any = None
        self._keys: security.CurveKeys | None = None
        self._links: dict[str, Link] = {}
        self._local: Link | None = None
        self._hosted: dict[bytes, _Hosted] = {}
        self.supervisor = Supervisor(self, serve_child)
        self._ids = itertools.count(1)
        self._encode = msgspec.msgpack.Encoder().encode
        self._max_body = self.config.max_message_bytes - wire.HEAD_BYTES - wire.MAX_ROUTE_BYTES
        self._acks: dict[tuple[bytes, bytes], int] = {}
        self._acks_scheduled = False
        self._background: set[asyncio.Task[Any]] = set()
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._closed: asyncio.Event | None = None
        self._started = False
        self._closing = False
        self._owner_pid: int | None = None  # a child process's owner, watched (watch_owner)
        self.main_actor: str | None = None  # in a child process: the actor it was started for
        self.dataplane: DataPlane = None  # type: ignore[assignment]  # made by start()

    # -- lifecycle --------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        if self._started:
            raise RuntimeError(f"actor system {self.name!r} is already started")
        self.loop = asyncio.get_running_loop()
        self._closed = asyncio.Event()
        cfg = self.config
        if cfg.run_dir:
            self.run_dir = cfg.run_dir
            Path(self.run_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
        else:
            self.run_dir = tempfile.mkdtemp(prefix="miles-async-")
            self._owns_run_dir = True
            self.config = msgspec.structs.replace(cfg, run_dir=self.run_dir)
        self.dataplane = DataPlane(self)  # checks its folder; creates nothing until the first put
        self._ctx = zmq.Context()
        if self.config.use_curve:
            key_dir = self._key_dir or os.path.join(self.run_dir, "keys")
            if self._key_dir is None and not os.path.exists(os.path.join(key_dir, f"{security.KEY_NAME}.key_secret")):
                security.generate_run_keys(key_dir)
            self._key_dir = key_dir
            self._keys = security.load_run_keys(key_dir)
            self._auth = security.start_authenticator(self._ctx, key_dir)
        self._bind_router()
        self._local = Link(self.address, None, self.loop.time())
        self._links[self.address] = self._local
        self._started = True
        self._host_builtin(SYSTEM_ACTOR, SystemActor)
        self._host_builtin(DATAPLANE_ACTOR, DataPlaneActor)
        if self._directory_address is None:
            self._host_builtin(DIRECTORY_ACTOR, Directory)
            self._directory_address = self.address
        self._heartbeat_task = self.loop.create_task(self._heartbeats())

    def _bind_router(self) -> None:
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, 0)  # replies are bounded by each caller's window
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        if self._keys is not None:
            security.make_server(sock, self._keys)
        bind = self._bind
        if bind is None:
            if self.config.transport == "ipc":
                bind = f"ipc://{wire.ipc_path(self.run_dir, 'system-' + self.name)}"
            else:
                bind = f"tcp://{self.config.host}:*"
        try:
            if bind.startswith("ipc://"):
                wire.check_ipc_free(bind[len("ipc://"):])
            sock.bind(bind)
        except (zmq.ZMQError, OSError) as exc:
            sock.close()
            raise OSError(f"actor system {self.name!r} cannot bind {bind}: {exc}") from exc
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.config.advertise_host and self.address.startswith("tcp://"):
            port = self.address.rsplit(":", 1)[1]
            self.address = f"tcp://{self.config.advertise_host}:{port}"
        self._router = sock
        self.loop.add_reader(sock.fileno(), self._drain_router)

    async def close(self) -> None:
        """Stop every hosted actor (owned children first), child processes, then the sockets."""
        if not self._started or self._closing:
            return
        self._closing = True
        try:
            await self.stop_all("its actor system closed")
        finally:
            self._teardown()

    async def stop_all(self, reason: str = "stopped") -> None:
        """Stop every actor this system started (child processes first, newest first), leaving the
        system itself serving: e.g. a job started again in the same system."""
        for rec in reversed(list(self.supervisor.children.values())):
            if rec.state not in (STOPPED, DEAD) or rec.process not in (None, NOT_STARTED):
                await self.supervisor.stop_child(rec)
        for h in reversed(list(self._hosted.values())):
            if not h.name.startswith("$"):
                await self._stop_hosted(h, reason)

    def _teardown(self) -> None:
        """Release sockets, threads and files; runs even if stopping the actors failed."""
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
        if self.dataplane is not None:
            self.dataplane.close()
        for task in list(self._background):
            task.cancel()
        for link in self._links.values():
            if link.sock is not None:
                self._close_link_socket(link)
            self._fail_link(link, wire.problem("SystemClosed", f"actor system {self.name!r} closed"))
        if self._router is not None:
            self.loop.remove_reader(self._router.fileno())
            self._router.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        if self._ctx is not None:
            self._ctx.term()
        if self.address.startswith("ipc://"):
            Path(self.address[len("ipc://"):]).unlink(missing_ok=True)
        if self._owns_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        assert self._closed is not None
        self._closed.set()

    async def wait_closed(self) -> None:
        assert self._closed is not None
        await self._closed.wait()

    # -- public API -------------------------------------------------------------------------

    def ref(self, entry: ActorAddress) -> ActorRef:
        """A live ref from an address (e.g. one received inside a message)."""
        return ActorRef(self, entry)

    @property
    def curve_keys(self) -> security.CurveKeys | None:
        """The run's CURVE keypair when CURVE is on (tcp across hosts), else None: what other
        channels of the run (a weight stream) use to admit only the run's processes."""
        return self._keys

    @property
    def directory(self) -> ActorRef:
        assert self._directory_address is not None, "start() the system first"
        return self.ref(ActorAddress(name=DIRECTORY_ACTOR, address=self._directory_address, capacity=1024))

    async def lookup(self, name: str, *, timeout_s: float | None = None) -> ActorRef:
        """The ref of a running actor of this run, by name (asks the run's directory)."""
        entry = await self.directory.ask(Lookup(name=name), timeout_s=timeout_s)
        if entry is None:
            raise UnknownActorError(f"no actor named {name!r} in this run")
        return self.ref(entry)

    async def spawn(self, cls: type[A], name: str, *, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                    process: bool = False, restart: RestartPolicy | None = None, owner: str | None = None,
                    env: dict[str, str] | None = None) -> ActorRef:
        """Start an actor named `name` (unique in the run), here or in a new child process.

        `process=True` starts a fresh Python process (spawned, not forked) that hosts it; `cls`,
        `args` and `kwargs` must then be picklable (the class importable by its module name).
        `owner` (an actor hosted here) makes the new actor its child; by default the system owns
        it. `env` (process only): environment variables set in the child before its actor is built
        (e.g. CUDA_VISIBLE_DEVICES). Raises `SpawnError` when the constructor or `on_start` fails.
        """
        self._check_started()
        _check_name(name)
        if not (isinstance(cls, type) and issubclass(cls, Actor)):
            raise TypeError(f"spawn() takes an Actor subclass, got {cls!r}")
        cls.handler_table()  # bad handler declarations fail here, in the caller
        old = self.supervisor.children.get(name)
        if old is not None and old.state not in (DEAD, STOPPED):
            raise ValueError(f"an actor named {name!r} is already running (state {old.state})")
        if owner is not None and owner != SYSTEM_ACTOR and owner.encode() not in self._hosted:
            raise ValueError(f"owner {owner!r} is not an actor hosted by this system")
        taken = await self.directory.ask(Lookup(name=name), timeout_s=self.config.spawn_timeout_s)
        if taken is not None and (old is None or taken.address != old.address):
            raise ValueError(f"an actor named {name!r} is already running at {taken.address}")
        if env and not process:
            raise ValueError("spawn(env=...) sets a child process's environment: it needs process=True")
        rec = Child(name, cls, tuple(args), dict(kwargs or {}), owner or SYSTEM_ACTOR,
                    restart or RestartPolicy(), process, int(cls.mailbox_capacity), env)
        self.supervisor.children[name] = rec
        try:
            if process:
                await self.supervisor.start_process(rec)
            else:
                h = self._host(name, cls, rec.args, rec.kwargs, rec.owner, self.address)
                await self._start_hosted(h)
                rec.address = self.address
        except BaseException:
            rec.state = DEAD
            raise
        rec.state = RUNNING
        entry = ActorAddress(name=name, address=rec.address, capacity=rec.capacity)
        if not process:  # a child process registers itself before it reports ready
            try:
                await self._register(entry)
            except RemoteError as exc:  # the name was taken since the check above
                await self.supervisor.stop_child(rec)
                raise ValueError(f"cannot register actor {name!r}: {exc.failure.message}") from exc
        return self.ref(entry)

    def watch(self, target: ActorRef) -> asyncio.Future[Failure]:
        """A future resolved with the cause once `target` is dead for good: an actor this system
        spawned, when its `RestartPolicy` gives up on it (a restart in progress is not a death);
        any other, when the link to its process is lost (the process exited, or went silent past
        the heartbeat timeout). A graceful stop resolves it too, for an actor not spawned here.
        Cancel the future to stop watching."""
        self._check_started()
        rec = self.supervisor.children.get(target.name)
        if rec is not None:
            return self.supervisor.watch(rec)
        fut: asyncio.Future[Failure] = self.loop.create_future()
        link = self.link_to(target.address)
        if link.dead is not None:
            fut.set_result(link.dead)
        else:
            link.watchers[:] = [w for w in link.watchers if not w.done()]
            link.watchers.append(fut)
        return fut

    async def stop(self, target: ActorRef | str, *, timeout_s: float | None = None) -> None:
        """Stop an actor gracefully wherever it runs; it is not restarted."""
        name = target if isinstance(target, str) else target.name
        rec = self.supervisor.children.get(name)
        if rec is not None:
            await self.supervisor.stop_child(rec)
            return
        h = self._hosted.get(name.encode())
        if h is not None:
            await self._stop_hosted(h, "stopped")
            return
        ref = target if isinstance(target, ActorRef) else await self.lookup(name)
        host = self.ref(ActorAddress(name=SYSTEM_ACTOR, address=ref.address, capacity=1024))
        await host.ask(StopActor(name=name), timeout_s=timeout_s)

    # -- seams: what the supervisor (owner.SupervisorHost), the `$system` actor
    # (control.ControlHost) and a child process use; not for actors ------------------------

    @property
    def closing(self) -> bool:
        """True once `close()` began: from then on nothing is restarted."""
        return self._closing

    @property
    def key_dir(self) -> str | None:
        """The folder of the run's CURVE keys, which child processes load (None: CURVE is off)."""
        return self._key_dir

    @property
    def directory_address(self) -> str:
        """The address of the system that hosts the run's directory (this one's, on the first)."""
        return self._directory_address or self.address

    def hosts(self, name: str) -> bool:
        """Whether an actor named `name` is hosted in this process, in any state."""
        return name.encode() in self._hosted

    async def start_hosted(self, name: str) -> None:
        """(Re)start the actor `name` hosted here: a fresh instance, then `on_start`. Messages that
        arrive meanwhile wait. Raises `SpawnError` if either fails, `UnknownActorError` if no such
        actor is hosted here."""
        h = self._hosted.get(name.encode())
        if h is None:
            raise UnknownActorError(f"no actor named {name!r} is hosted at {self.address}")
        await self._start_hosted(h)

    async def stop_hosted(self, name: str, reason: str) -> None:
        """Stop the actor `name` hosted here, if there is one (see `stop`, which also finds the
        actors of other processes)."""
        h = self._hosted.get(name.encode())
        if h is not None:
            await self._stop_hosted(h, reason)

    def crash_hosted(self, name: str, failure: Failure, *, failed_start: bool = False) -> None:
        """Crash the actor `name` hosted here: its callers fail, `on_failure` runs, its children
        stop and its owner decides. `failed_start`: its (re)start failed, so it is dead already and
        is crashed all the same, for its owner's policy to judge. System actors are never crashed."""
        h = self._hosted.get(name.encode())
        if h is None or h.name.startswith("$"):
            return
        if failed_start:
            h.state = RUNNING  # _crash passes over the dead
        self._crash(h, failure)

    def on_peer_ready(self, address: str) -> None:
        """A process at `address` (a child, started or restarted there) is serving again."""
        link = self._links.get(address)
        if link is not None and link.dead is not None:
            self._revive(link)

    def on_peer_exit(self, address: str, cause: Failure, *, expected: bool = False) -> None:
        """The process at `address` exited: its callers here fail with `cause` (quietly when
        `expected`, i.e. it was being stopped)."""
        link = self._links.get(address)
        if link is not None:
            self._link_lost(link, cause, expected)

    async def serve_main(self, spec: ChildSpec) -> int:
        """In a child process: host, start and register the actor it was started for, report to
        its owner, and serve until this system closes. Returns the process's exit status (1: the
        actor failed to start, and the owner was told why)."""
        self.main_actor = spec.name
        owner = self.ref(ActorAddress(name=SYSTEM_ACTOR, address=spec.owner_address, capacity=1 << 16))
        h = self._host(spec.name, spec.cls, spec.args, spec.kwargs, spec.owner, spec.owner_address)
        try:
            await self._start_hosted(h)
            entry = ActorAddress(name=spec.name, address=self.address, capacity=h.capacity)
            await self._register(entry)
            await owner.ask(ChildReady(name=spec.name, address=self.address, capacity=h.capacity),
                            timeout_s=spec.config.spawn_timeout_s)
        except (ActorError, ValueError) as exc:  # SpawnError, a taken name, an owner that is gone
            cause = exc.cause if isinstance(exc, SpawnError) else Failure.from_exception(exc)
            log.error("actor %r failed to start: %s", spec.name, exc)
            try:
                await owner.ask(ChildDied(name=spec.name, cause=cause), timeout_s=5.0)
            except ActorError as report_exc:  # the owner is gone; the exit status still tells
                log.error("could not report the failure to the owner: %s", report_exc)
            await self.close()
            return 1
        await self.wait_closed()
        return 0

    # -- hosting ----------------------------------------------------------------------------

    def _host(self, name: str, cls: type[Actor], args: tuple[Any, ...], kwargs: dict[str, Any], owner: str,
              owner_address: str) -> _Hosted:
        key = name.encode()
        old = self._hosted.get(key)
        if old is not None and old.state not in (DEAD, STOPPED):
            raise ValueError(f"an actor named {name!r} is already hosted here (state {old.state})")
        h = _Hosted(name, cls, args, kwargs, owner, owner_address)
        self._hosted[key] = h
        return h

    def _host_builtin(self, name: str, cls: type[Actor]) -> None:
        h = self._host(name, cls, (), {}, SYSTEM_ACTOR, self.address)
        actor = cls()
        self._bind_actor(h, actor)
        h.state = RUNNING

    def _bind_actor(self, h: _Hosted, actor: Actor) -> None:
        actor.name = h.name
        actor.system = self
        actor.ref = self.ref(ActorAddress(name=h.name, address=self.address, capacity=h.capacity))
        h.actor = actor

    async def _start_hosted(self, h: _Hosted) -> None:
        """Construct the actor and run `on_start`; messages that arrive meanwhile wait."""
        h.state = STARTING
        h.failure = None
        h.actor = None
        try:
            actor = h.cls(*h.args, **h.kwargs)
            self._bind_actor(h, actor)
            await actor.on_start()
        except Exception as exc:  # an actor boundary: the owner learns the cause
            failure = Failure.from_exception(exc)
            h.state = DEAD
            h.failure = failure
            self._fail_queue(h)
            raise SpawnError(h.name, failure) from exc
        h.state = RUNNING
        self._pump(h)

    def _deliver(self, h: _Hosted, env: _Env) -> None:
        state = h.state
        if state is RUNNING:
            if env.spec.concurrent:
                self._run(h, env, False)
                return
            h.queue.append(env)
            if not h.running:
                self._pump(h)
        elif state is STARTING or state is RESTARTING:
            h.queue.append(env)
        else:
            self._complete(h, env, None, ActorDeadError(h.name, h.failure or _stopped(h.name)))

    def _pump(self, h: _Hosted) -> None:
        queue = h.queue
        while queue and not h.running and h.state is RUNNING:
            env = queue.popleft()
            if env.spec.concurrent:
                self._run(h, env, False)
                continue
            h.running = True
            if self._run(h, env, True):
                h.running = False

    def _run(self, h: _Hosted, env: _Env, serial: bool) -> bool:
        """Run a handler; True if it finished inline, False if a Task carries it on."""
        spec = env.spec
        try:
            if spec.is_async:
                value, task = start(spec.fn(h.actor, env.msg))
                if value is PENDING:
                    assert task is not None
                    h.tasks.add(task)
                    task.add_done_callback(lambda t: self._task_done(h, env, serial, t))
                    return False
            else:
                value = spec.fn(h.actor, env.msg)
        except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - an actor boundary: the fault goes to its caller
            self._complete(h, env, None, exc)
            return True
        self._complete(h, env, value, None)
        return True

    def _task_done(self, h: _Hosted, env: _Env, serial: bool, task: asyncio.Task[Any]) -> None:
        h.tasks.discard(task)
        if task.cancelled():
            self._complete(h, env, None, asyncio.CancelledError())
        else:
            exc = task.exception()
            self._complete(h, env, None if exc else task.result(), exc)
        if serial:
            h.running = False
            self._pump(h)

    def _complete(self, h: _Hosted, env: _Env, value: Any, exc: BaseException | None) -> None:
        """Deliver a handler's outcome to its caller; a failed tell crashes the actor."""
        if exc is not None and h.failure is not None and isinstance(exc, asyncio.CancelledError):
            exc = ActorDeadError(h.name, h.failure)  # cancelled because the actor died
        if isinstance(exc, ActorDeadError) and exc.actor != h.name:
            # the handler let another actor's death escape: that is this handler's failure
            err = RemoteError(h.name, Failure.from_exception(exc))
            err.__cause__ = exc
            exc = err
        ident = env.ident
        if ident is None:  # a caller in this process
            assert self._local is not None
            self._local.release(h.name)
            fut = env.fut
            if env.timer is not None:
                env.timer.cancel()
            if fut is not None and not fut.done():
                if exc is None:
                    fut.set_result(value)
                elif isinstance(exc, (ActorDeadError, RemoteError)):
                    fut.set_exception(exc)
                else:
                    err = RemoteError(h.name, Failure.from_exception(exc))
                    err.__cause__ = exc
                    fut.set_exception(err)
        else:
            self._answer_remote(h, env, ident, value, exc)
        if exc is not None and not env.is_ask and not isinstance(exc, ActorDeadError) and h.state is RUNNING:
            if h.name.startswith("$"):  # a system actor serves every peer: one bad tell must not kill it
                log.error("system actor %r: a tell of %s failed", h.name, type(env.msg).__name__, exc_info=exc)
                return
            log.error("actor %r crashed: a tell handler for %s raised", h.name, type(env.msg).__name__,
                      exc_info=exc)
            self._crash(h, Failure.from_exception(exc))

    def _answer_remote(self, h: _Hosted, env: _Env, ident: bytes, value: Any, exc: BaseException | None) -> None:
        left = h.backlog.get(ident, 1) - 1
        if left:
            h.backlog[ident] = left
        else:
            h.backlog.pop(ident, None)
        if exc is None:
            if env.is_ask:
                self._reply_value(h, env, ident, value)
            else:
                self._ack(ident, h.route)  # a tell's credit comes back in a batched ACK
        elif isinstance(exc, ActorDeadError):
            self._reply_error(ident, env.msg_id, h.route, "dead", exc.cause)
        else:
            self._reply_error(ident, env.msg_id, h.route, "handler", Failure.from_exception(exc))

    def _reply_value(self, h: _Hosted, env: _Env, ident: bytes, value: Any) -> None:
        what = type(env.msg).__name__
        try:
            body = self._encode(value)
        except (TypeError, ValueError) as exc:
            problem = f"the {what} handler returned a value that cannot be sent: {exc}"
        else:
            if len(body) <= self._max_body:
                self._router_send(ident, wire.HEAD.pack(wire.REPLY, env.msg_id, 0) + body)
                return
            problem = f"the reply to {what} is {len(body)} bytes, over max_message_bytes ({self.config.max_message_bytes})"
        self._reply_error(ident, env.msg_id, h.route, "handler", wire.problem("EncodeError", problem))

    def _fail_queue(self, h: _Hosted) -> None:
        failure = h.failure or _stopped(h.name)
        queue, h.queue = h.queue, deque()
        for env in queue:
            self._complete(h, env, None, ActorDeadError(h.name, failure))

    def _crash(self, h: _Hosted, failure: Failure) -> None:
        """The actor is dead: fail its callers, run `on_failure`, stop its children, tell its owner."""
        if h.state in (DEAD, STOPPING, STOPPED):
            return
        h.state = DEAD
        h.failure = failure
        for task in list(h.tasks):
            task.cancel()
        self._fail_queue(h)
        self.run_background(self._after_crash(h, failure))

    async def _after_crash(self, h: _Hosted, failure: Failure) -> None:
        actor = h.actor
        if actor is not None:
            try:
                await actor.on_failure(failure)
            except Exception:  # an actor boundary: report and carry on with supervision
                log.exception("on_failure of actor %r raised", h.name)
        await self.supervisor.stop_children_of(h.name)
        await self._report_death(h, failure)

    async def _report_death(self, h: _Hosted, failure: Failure) -> None:
        if h.owner_address == self.address:
            self.supervisor.on_child_died(h.name, failure)
            return
        owner = self.ref(ActorAddress(name=SYSTEM_ACTOR, address=h.owner_address, capacity=1024))
        try:
            await owner.tell(ChildDied(name=h.name, cause=failure))
        except ActorDeadError:
            log.error("actor %r died and its owner is gone too: %s", h.name, failure.describe())

    async def _stop_hosted(self, h: _Hosted, reason: str) -> None:
        if h.state in (STOPPING, STOPPED):
            return
        was_alive = h.state in (RUNNING, STARTING)
        h.state = STOPPING
        h.failure = wire.problem("ActorStopped", f"actor {h.name!r} was stopped ({reason})")
        self._fail_queue(h)
        await self.supervisor.stop_children_of(h.name)
        if h.tasks:
            _, late = await asyncio.wait(list(h.tasks), timeout=self.config.stop_grace_s)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=1.0)
        if was_alive and h.actor is not None:
            try:
                await h.actor.on_stop()
            except Exception:  # an actor boundary
                log.exception("on_stop of actor %r raised", h.name)
        h.state = STOPPED
        if not h.name.startswith("$") and not self._closing:
            self.unregister(h.name)

    # -- directory --------------------------------------------------------------------------

    async def _register(self, entry: ActorAddress) -> None:
        await self.directory.ask(Register(entry=entry), timeout_s=self.config.spawn_timeout_s)

    def unregister(self, name: str) -> None:
        """Drop `name` from the run's directory (a tell: a directory that is gone or busy leaves it stale)."""
        if self._closing and self._directory_address not in self._links:
            return  # no new sockets while closing; the run's directory may outlive us with a stale name
        try:
            self.directory.tell_nowait(Unregister(name=name))
        except ActorError as exc:  # the directory is gone or busy; the name goes stale, nothing else
            log.debug("could not unregister %r: %s", name, exc)

    # -- the wire: calling side -------------------------------------------------------------

    # These three are `refs.Sender`, the seam every ActorRef sends through; call `ActorRef`'s
    # tell/ask rather than these.

    def link_to(self, address: str) -> Link:
        """The Link to the host process at `address` (made, and its socket connected, on first use)."""
        link = self._links.get(address)
        if link is None:
            # while closing, links are still made: stopping a child process that was never
            # messaged (a spawn in flight when the system closed) needs one to its host
            if not self._started or (self._closed is not None and self._closed.is_set()):
                raise RuntimeError(f"actor system {self.name!r} is not running (use `async with ActorSystem()`)")
            sock = self._connect(address)
            link = Link(address, sock, self.loop.time())
            self._links[address] = link
            self.loop.add_reader(sock.fileno(), self._drain_link, link)
        return link

    def _connect(self, address: str) -> zmq.Socket:
        assert self._ctx is not None
        if not address.startswith(("ipc://", "tcp://")):
            raise ValueError(f"bad actor address {address!r}: expected ipc://PATH or tcp://HOST:PORT")
        sock: zmq.Socket = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)  # bounded by the per-target windows instead
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        sock.setsockopt(zmq.RECONNECT_IVL, 50)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        if self._keys is not None:
            security.make_client(sock, self._keys)
        sock.connect(address)
        return sock

    def send(self, link: Link, ref: ActorRef, kind: int, msg: Message, fut: asyncio.Future[Any] | None,
              timer: asyncio.TimerHandle | None) -> None:
        """Send (or deliver here) one message; an ask's `fut` gets the outcome, `timer` is its timeout."""
        if link.sock is None:
            self._send_local(link, ref, kind, msg, fut, timer)
            return
        body = self._encode(msg)
        if len(body) > self._max_body:
            raise ValueError(f"{type(msg).__name__} encodes to {len(body)} bytes, over max_message_bytes "
                             f"({self.config.max_message_bytes}); send tensors through a transport and a handle here")
        msg_id = next(self._ids)
        if fut is not None:
            link.pending[msg_id] = [fut, reply_decoder(type(msg)), ref.name, timer]
        link.used[ref.name] = link.used.get(ref.name, 0) + 1
        sock = link.sock
        _send(sock, wire.HEAD.pack(kind, msg_id, len(ref.route)) + ref.route + body, NOBLOCK)
        if _get(sock, EVENTS) & POLLIN:  # see _kick_link
            self._kick_link(link)

    def _send_local(self, link: Link, ref: ActorRef, kind: int, msg: Message, fut: asyncio.Future[Any] | None,
                    timer: asyncio.TimerHandle | None) -> None:
        h = self._hosted.get(ref.route)
        if h is None:
            raise UnknownActorError(f"no actor named {ref.name!r} is hosted at {self.address}")
        spec = h.table.specs.get(type(msg))
        if spec is None:
            raise BadMessageError(f"actor {ref.name!r} does not handle {type(msg).__name__} "
                                  f"(it handles {', '.join(h.table.names)})")
        link.used[ref.name] = link.used.get(ref.name, 0) + 1
        self._deliver(h, _Env(None, 0, kind == wire.ASK, msg, spec, fut, timer))

    async def wait_room(self, link: Link, ref: ActorRef, timeout_s: float | None) -> float:
        """Wait until `ref`'s window has room; returns what is left of `timeout_s`."""
        deadline = None if timeout_s is None else self.loop.time() + timeout_s
        while link.used.get(ref.name, 0) >= ref.capacity:
            if link.dead is not None:
                raise ActorDeadError(ref.name, link.dead)
            fut = self.loop.create_future()
            link.waiters.setdefault(ref.name, deque()).append(fut)
            left = None if deadline is None else deadline - self.loop.time()
            if left is not None and left <= 0:
                raise AskTimeoutError(f"mailbox of actor {ref.name!r} stayed full for {timeout_s:g}s")
            try:
                await asyncio.wait_for(fut, left)
            except asyncio.TimeoutError:
                raise AskTimeoutError(f"mailbox of actor {ref.name!r} stayed full for {timeout_s:g}s") from None
        if link.dead is not None:
            raise ActorDeadError(ref.name, link.dead)
        return self.config.ask_timeout_s if deadline is None else max(0.0, deadline - self.loop.time())

    def _kick_link(self, link: Link) -> None:
        # ZeroMQ's FD is edge-triggered: a send may consume the edge of frames that arrived
        # meanwhile, so after each send we check ZMQ_EVENTS and, if frames wait, drain them on
        # the next loop turn.
        if not link.scheduled:
            link.scheduled = True
            self.loop.call_soon(self._drain_link, link)

    def _drain_link(self, link: Link) -> None:
        link.scheduled = False
        sock = link.sock
        if sock is None or sock.closed:
            return
        link.last_heard = self.loop.time()
        for _ in range(_BATCH):
            if not _get(sock, EVENTS) & POLLIN:
                return
            # hosts of this run send single frames (and CURVE keeps others out), so no
            # RCVMORE check here: each get costs about a microsecond
            self._on_link_frame(link, _recv(sock, NOBLOCK))
        self._kick_link(link)  # more may wait: let other callbacks run first

    def _on_link_frame(self, link: Link, data: bytes) -> None:
        if link.dead is not None:
            self._revive(link)
        try:
            kind, msg_id, route, body = wire.parse(data)
        except ValueError as exc:
            log.warning("dropped a malformed frame from %s: %s", link.address, exc)
            return
        if kind == wire.REPLY:
            entry = link.pending.pop(msg_id, None)
            if entry is None:
                return
            link.release(entry[2])
            fut = entry[0]
            if entry[3] is not None:
                entry[3].cancel()
            if not fut.done():
                try:
                    fut.set_result(entry[1].decode(body))
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    fut.set_exception(BadMessageError(f"reply from actor {entry[2]!r} does not decode: {exc}"))
        elif kind == wire.ACK:
            link.release(route.decode(errors="replace"), msg_id)
        elif kind == wire.ERROR:
            self._on_error_frame(link, msg_id, route.decode(errors="replace"), body)
        elif kind != wire.PONG:
            log.warning("dropped a frame of unknown kind %d from %s", kind, link.address)

    def _on_error_frame(self, link: Link, msg_id: int, target: str, body: memoryview) -> None:
        try:
            err = wire.ERROR_DECODER.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError):
            err = wire.ErrorReply(kind="bad_frame", failure=wire.problem("BadFrame", "undecodable error reply"))
        entry = link.pending.pop(msg_id, None)
        if entry is not None:
            link.release(entry[2])
            if entry[3] is not None:
                entry[3].cancel()
            if not entry[0].done():
                entry[0].set_exception(wire.to_exception(entry[2], err))
            return
        if target:
            link.release(target)  # a tell that was refused or whose handler raised
        log.warning("actor %r at %s reported on tell #%d: %s: %s", target, link.address, msg_id, err.kind,
                    err.failure.describe())

    def _link_lost(self, link: Link, cause: Failure, expected: bool = False) -> None:
        if link.sock is None or link.dead is not None:
            return
        busy = bool(link.pending) or any(link.used.values())
        level = logging.DEBUG if expected else logging.WARNING if busy else logging.INFO
        log.log(level, "lost contact with %s: %s", link.address, cause.message)
        # a fresh socket drops frames queued for the dead peer, so a restarted peer never
        # runs requests that were already failed here
        self._close_link_socket(link)
        link.sock = self._connect(link.address)
        self.loop.add_reader(link.sock.fileno(), self._drain_link, link)
        self._fail_link(link, cause)
        self._ping(link)  # answered only if the peer comes back (e.g. restarted at this address)

    def _ping(self, link: Link) -> None:
        assert link.sock is not None
        try:
            _send(link.sock, _PING, NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("ping to %s failed: %s", link.address, exc)
        if _get(link.sock, EVENTS) & POLLIN:
            self._kick_link(link)

    def _fail_link(self, link: Link, cause: Failure) -> None:
        link.dead = cause
        watchers, link.watchers = link.watchers, []
        for watcher in watchers:
            if not watcher.done():
                watcher.set_result(cause)
        pending, link.pending = link.pending, {}
        for fut, _, target, timer in pending.values():
            if timer is not None:
                timer.cancel()
            if not fut.done():
                fut.set_exception(ActorDeadError(target, cause))
        link.used.clear()
        link.wake_all()

    def _revive(self, link: Link) -> None:
        log.info("contact with %s is back", link.address)
        link.dead = None
        link.last_heard = self.loop.time()

    def _close_link_socket(self, link: Link) -> None:
        assert link.sock is not None
        if not link.sock.closed:
            self.loop.remove_reader(link.sock.fileno())
            link.sock.close(linger=0)

    async def _heartbeats(self) -> None:
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.heartbeat_interval_s)
            now = self.loop.time()
            for link in list(self._links.values()):
                if link.sock is None:
                    continue
                if link.dead is not None:
                    continue  # one ping waits in its fresh socket (see _link_lost)
                if now - link.last_heard > cfg.heartbeat_timeout_s:
                    cause = wire.problem(
                        "PeerLost", f"no message from {link.address} for {now - link.last_heard:.1f}s "
                        f"(heartbeat timeout {cfg.heartbeat_timeout_s:g}s): its process or node is lost")
                    self._link_lost(link, cause)
                    self.supervisor.on_peer_lost(link.address, cause)
                else:
                    self._ping(link)
            if self._owner_pid is not None and not _alive(self._owner_pid):
                self._owner_gone()

    def watch_owner(self, pid: int) -> None:
        """Shut down when process `pid` (a child's owner) exits. A forked child's parent is the fork
        server, not its owner, so the owner is watched by pid: through a pidfd, readable the moment
        it exits, where Linux has them; else polled at each heartbeat."""
        if pid <= 0:
            return
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # not Linux 5.3+, or not allowed: poll instead
            self._owner_pid = pid
            return
        self.loop.add_reader(fd, self._owner_gone, fd)

    def _owner_gone(self, fd: int | None = None) -> None:
        if fd is not None:
            self.loop.remove_reader(fd)
            os.close(fd)
        self._owner_pid = None
        if not self._closing:
            log.error("actor system %r: its owner process is gone; shutting down", self.name)
            self.run_background(self.close())

    # -- the wire: hosting side -------------------------------------------------------------

    def _drain_router(self) -> None:
        self._router_scheduled = False
        sock = self._router
        if sock is None or sock.closed:
            return
        for _ in range(_BATCH):
            if not _get(sock, EVENTS) & POLLIN:
                return
            ident = _recv(sock, NOBLOCK)  # a ROUTER message always has an identity and a frame
            data = _recv(sock, NOBLOCK)
            if _get(sock, RCVMORE):
                extra = 0
                while _get(sock, RCVMORE):
                    _recv(sock, NOBLOCK)
                    extra += 1
                self._reply_error(ident, 0, b"", "bad_frame", wire.problem(
                    "BadFrame", f"a message is one frame; got {extra + 1} frames"))
                continue
            self._serve(ident, data)
        self._kick_router()  # more may wait: let other callbacks run first

    def _kick_router(self) -> None:
        if not self._router_scheduled:
            self._router_scheduled = True
            self.loop.call_soon(self._drain_router)

    def _router_send(self, ident: bytes, data: bytes) -> None:
        sock = self._router
        if sock is None or sock.closed:
            return
        try:
            _send(sock, ident, SNDMORE_NOBLOCK)
            _send(sock, data, NOBLOCK)
        except zmq.ZMQError as exc:  # the caller disconnected (EHOSTUNREACH): nobody to tell
            log.debug("reply to a gone caller dropped: %s", exc)
        if _get(sock, EVENTS) & POLLIN:  # see _kick_link
            self._kick_router()

    def _reply_error(self, ident: bytes, msg_id: int, route: bytes, kind: wire.ErrorKind, failure: Failure) -> None:
        self._router_send(ident, wire.frame(wire.ERROR, msg_id, route, wire.error_frame(kind, failure)))

    def _ack(self, ident: bytes, route: bytes) -> None:
        key = (ident, route)
        self._acks[key] = self._acks.get(key, 0) + 1
        if not self._acks_scheduled:
            self._acks_scheduled = True
            self.loop.call_soon(self._flush_acks)

    def _flush_acks(self) -> None:
        self._acks_scheduled = False
        acks, self._acks = self._acks, {}
        for (ident, route), count in acks.items():
            self._router_send(ident, wire.frame(wire.ACK, count, route))

    def _serve(self, ident: bytes, data: bytes) -> None:
        """Handle one frame from a caller. Bad input gets an ERROR reply, never an exception."""
        try:
            kind, msg_id, route, body = wire.parse(data)
        except ValueError as exc:
            self._reply_error(ident, 0, b"", "bad_frame", wire.problem("BadFrame", str(exc)))
            return
        if kind == wire.PING:
            self._router_send(ident, wire.frame(wire.PONG, msg_id))
            return
        if kind != wire.ASK and kind != wire.TELL:
            self._reply_error(ident, msg_id, route, "bad_frame", wire.problem(
                "BadFrame", f"expected an ASK ({wire.ASK}) or TELL ({wire.TELL}) frame, got kind {kind}"))
            return
        h = self._hosted.get(route)
        if h is None:
            name = route.decode(errors="replace")
            self._reply_error(ident, msg_id, route, "unknown_actor", wire.problem(
                "UnknownActor", f"no actor named {name!r} is hosted at {self.address}"))
            return
        if h.state in (DEAD, STOPPING, STOPPED):
            self._reply_error(ident, msg_id, route, "dead", h.failure or _stopped(h.name))
            return
        waiting = h.backlog.get(ident, 0)
        if waiting >= h.capacity:
            self._reply_error(ident, msg_id, route, "mailbox_full", wire.problem(
                "MailboxFull", f"actor {h.name!r} already holds {waiting} unfinished messages from this "
                "caller (its mailbox capacity); wait for replies or acks before sending more"))
            return
        try:
            msg = h.table.decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._reply_error(ident, msg_id, route, "bad_message", wire.problem(
                "BadMessage", f"actor {h.name!r} (handles {', '.join(h.table.names)}) cannot decode the "
                f"message: {exc}"))
            return
        h.backlog[ident] = waiting + 1
        self._deliver(h, _Env(ident, msg_id, kind == wire.ASK, msg, h.table.specs[type(msg)], None, None))

    # -- helpers ----------------------------------------------------------------------------

    def run_background(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run `coro` as a task of this system: cancelled when it closes, its failure logged."""
        task = self.loop.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("runtime task failed", exc_info=task.exception())

    def _check_started(self) -> None:
        if not self._started or self._closing:
            raise RuntimeError(f"actor system {self.name!r} is not running (use `async with ActorSystem()`)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, as another user
    return True


async def serve_child(spec: ChildSpec) -> int:
    """A child process's life once `child.main` has set it up (the `serve` of its `ChildSpec`):
    its own system, joined to its owner's run, serving the one actor it was started for."""
    system = ActorSystem(spec.name, config=spec.config, directory=spec.directory, bind=spec.bind,
                         key_dir=spec.key_dir)
    await system.start()
    system.watch_owner(spec.owner_pid)
    gc.freeze()  # this process lives on: keep its start-up objects out of every later collection
    return await system.serve_main(spec)


if TYPE_CHECKING:
    def _seams(system: ActorSystem) -> ControlHost:
        """The `$system` actor's seam, which nothing else assigns: mypy checks it here (the other
        seams are checked where the system hands itself to a ref, its data plane, its supervisor)."""
        return system


def _stopped(name: str) -> Failure:
    return wire.problem("ActorStopped", f"actor {name!r} was stopped")


def _check_name(name: str) -> None:
    if (not isinstance(name, str) or not name or name.startswith("$") or "\0" in name or "/" in name
            or len(name.encode()) > wire.MAX_ROUTE_BYTES):
        raise ValueError(f"bad actor name {name!r}: use a non-empty string of at most {wire.MAX_ROUTE_BYTES} "
                         "bytes, without '/', NUL or a leading '$'")
