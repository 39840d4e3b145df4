"""`miles-async launch`: one launcher per node, torchrun style; together they run one recipe.

    node 0:  miles-async launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 R.toml
    node 1:  miles-async launch --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 R.toml

Every launcher holds the run's shared secret (`--secret-file`, or `MILES_ASYNC_SECRET`). First,
node 0 runs the pre-flight (miles_async/actors/preflight.py: the recipe, the model, its tokenizer, the task's
data), so a bad input ends it with one line and status 2 before anything is written or waited
for; `--dry-run` (on any node) stops there and prints the resolved recipe, with no rendezvous and
no secret. Then:

1. Rendezvous (`rendezvous.py`): node 0 listens on the master address (a torch.distributed
   TCPStore, as torchrun's), every node proves it holds the secret and runs the same version,
   and node 0 hands the run's CURVE keys out, encrypted under the secret. A node that does not
   arrive, a port in use, a version mismatch or a wrong secret ends every launcher with a message
   naming the node and the cause, within `--rdzv-timeout-s`.
2. Node 0 starts the run's actor system on tcp at its address, with CURVE on (only holders of the
   run's key can deliver a message), hosts the run's directory and publishes its address in the
   store. Every other node starts its own system joined to that directory, and a `NodeAgent`
   (`agent.py`), which starts processes there when the controller asks.
3. Node 0 runs the controller (`miles_async/actors/controller.py`) with the recipe's `[placement]`: engines
   and trainer ranks are spawned on the nodes it names, each bound to its node's address. When
   the run ends, node 0 tells every agent to stop its processes and exit; an agent whose
   controller stops answering does the same, so no node outlives its run.

Environment of the processes: the trainer ranks get RANK, WORLD_SIZE, LOCAL_RANK (their index on
their node), MASTER_ADDR and MASTER_PORT (rank 0's node; the ranks may span nodes) and bind their
node's interface (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME); on GPUs each engine gets
CUDA_VISIBLE_DEVICES, one of its node's GPUs the trainer ranks there do not use. A node lacking
the model folder is sent it before its engines start; trainer ranks off node 0 need the run
folder shared with node 0 (checked as they start).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from miles_async.actors import PRELOAD
from miles_async.runtime.child import start_fork_server
from miles_async.runtime.config import RuntimeConfig

log = logging.getLogger("miles_async.launch")

PROG = "miles-async launch"
REMOTE_TRACEBACK = "--- remote traceback ---"  # where a remote error's message ends and its traceback starts
NODE_PRELOAD = (*PRELOAD, "miles_async.launch.agent")  # the node's fork server: the run's actors and the node agent


def route_address(master_addr: str, master_port: int) -> str:
    """This node's address on the route to node 0 (what other nodes will reach it at)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master_addr, master_port))  # no packet is sent: this only picks the route
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def num_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - no usable torch.cuda: no GPUs to place on
        return 0


async def wait_for_agents(system: Any, infos: list[Any], timeout_s: float) -> dict[int, Any]:
    """Each node's agent (by rank), looked up in the run's directory as it registers; a clear error
    naming the nodes whose agent did not come within `timeout_s`."""
    from miles_async.launch.agent import agent_name
    from miles_async.runtime import UnknownActorError

    deadline = time.monotonic() + timeout_s
    found: dict[int, Any] = {}
    ranks = [info.rank for info in infos]
    while True:
        for info in infos:
            if info.rank not in found:
                with contextlib.suppress(UnknownActorError):
                    found[info.rank] = await system.lookup(agent_name(info.rank, info.pid), timeout_s=timeout_s)
        missing = [r for r in ranks if r not in found]
        if not missing:
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"node(s) {missing} passed the rendezvous but their agent did not register with the "
                               f"run's directory within {timeout_s:g} s (a firewall between the nodes? each "
                               "node's --host must be reachable from node 0)")
        await asyncio.sleep(0.1)


def serve_joins(system: Any, store: Any, rdzv: Any, secret: bytes, controller: Any, agents: dict[int, Any],
                args: Any) -> threading.Event:
    """Admit launchers that arrive after the run started (a node back after it was lost, or a new
    one: the elastic rollout fleet), from a thread polling the store. A rank whose node still
    answers is refused. Set the returned event to stop."""
    from miles_async.actors.fleet import Node
    from miles_async.launch.agent import GetNodeStatus, RemoteSpawner
    from miles_async.launch.rendezvous import JoinServer

    loop = asyncio.get_running_loop()
    stop = threading.Event()
    server = JoinServer(store, rdzv, secret)

    def alive(rank: int) -> bool:
        agent = agents.get(rank)
        if agent is None:
            return False
        probe = asyncio.run_coroutine_threadsafe(agent.ask(GetNodeStatus(), timeout_s=2.0), loop)
        try:
            probe.result(timeout=5.0)
            return True
        except Exception:  # noqa: BLE001 - no answer: the node is gone
            return False

    def accept(info: Any) -> str | None:
        return f"node {info.rank} is still in the run" if alive(info.rank) else None

    async def admit(info: Any) -> None:
        found = await wait_for_agents(system, [info], args.rdzv_timeout_s)
        agents[info.rank] = found[info.rank]  # the new launcher's agent replaces the lost one's
        controller.add_node(Node(rank=info.rank, host=info.host, spawner=RemoteSpawner(system, found[info.rank]),
                                 num_gpus=info.num_gpus))

    def serve() -> None:
        while not stop.is_set():
            try:
                info = server.poll(accept, timeout_s=0.5)
            except Exception as e:  # noqa: BLE001 - the store is gone: the run is ending
                log.warning("no more joins: %s", e)
                return
            if info is not None:
                log.warning("node %d (%s) joins the running job", info.rank, info.host)
                asyncio.run_coroutine_threadsafe(admit(info), loop)

    threading.Thread(target=serve, name="join-server", daemon=True).start()
    asyncio.ensure_future(watch_nodes(system, controller, agents, rdzv, args.heartbeat_timeout_s, stop))
    return stop


async def watch_nodes(system: Any, controller: Any, agents: dict[int, Any], rdzv: Any, timeout_s: float,
                      stop: threading.Event) -> None:
    """A node cut off (no answer past the heartbeat timeout: its engines are declared lost) whose
    agent answers again later is back: its stale processes are stopped, and it is admitted again
    like a rejoining node (new engines, the current weights first)."""
    from miles_async.actors.fleet import Node
    from miles_async.launch.agent import GetNodeStatus, RemoteSpawner, StopChildren

    hosts = {n.rank: n.host for n in rdzv.nodes}
    silent_since: dict[int, float] = {}
    lost: dict[int, Any] = {}  # rank -> the agent that went silent (a rejoin brings a new one)
    while not stop.is_set():
        await asyncio.sleep(0.5)
        for rank, agent in list(agents.items()):
            try:
                status = await agent.ask(GetNodeStatus(), timeout_s=1.0)
            except Exception:  # noqa: BLE001 - silent: cut off, or gone
                silent_since.setdefault(rank, time.monotonic())
                if rank not in lost and time.monotonic() - silent_since[rank] > timeout_s:
                    lost[rank] = agent
                    log.warning("node %d is cut off or gone", rank)
                continue
            silent_since.pop(rank, None)
            was = lost.pop(rank, None)
            if was is agent:  # the same agent answers again: the node was cut off, not restarted
                log.warning("node %d (%s) is back: restarting its engines with the current weights", rank,
                            status.host)
                await agent.ask(StopChildren(), timeout_s=60.0)
                controller.add_node(Node(rank=rank, host=hosts.get(rank, status.host),
                                         spawner=RemoteSpawner(system, agent), num_gpus=status.num_gpus))


async def stop_run(system: Any, agents: dict[int, Any]) -> None:
    """Stop every process of the run on every node (node 0's own actors, the others' through their
    agents), the agents staying for the run's next start."""
    from miles_async.launch.agent import StopChildren

    await system.stop_all("the run restarts")
    for rank, agent in list(agents.items()):
        try:
            await agent.ask(StopChildren(), timeout_s=60.0)
        except Exception as e:  # noqa: BLE001 - a node gone has nothing left to stop; it may rejoin
            log.warning("node %d did not confirm that its processes stopped: %s", rank, e)


async def run_node_zero(args: Any, config: Any, rdzv: Any, store: Any, host: str, out: Path, secret: bytes,
                        checked: Any = None) -> int:
    from miles_async.actors.controller import Controller, RunLostError, run_restarting
    from miles_async.actors.fleet import LocalSpawner, Node
    from miles_async.launch.agent import RemoteSpawner, ShutdownNode
    from miles_async.launch.console import restart_line
    from miles_async.runtime import ActorSystem

    runtime = runtime_config(host, args)
    async with ActorSystem("controller", config=runtime, key_dir=rdzv.key_dir) as system:
        await asyncio.to_thread(store.set, "directory", system.address)
        agents = await wait_for_agents(system, [n for n in rdzv.nodes if n.rank != 0], args.rdzv_timeout_s)
        gpus = {info.rank: info.num_gpus for info in rdzv.nodes}
        nodes = {0: Node(rank=0, host=host, spawner=LocalSpawner(system, host), num_gpus=gpus.get(0, 0))}
        for info in rdzv.nodes:
            if info.rank != 0:
                nodes[info.rank] = Node(rank=info.rank, host=info.host, spawner=RemoteSpawner(system, agents[info.rank]),
                                        num_gpus=info.num_gpus)
        # The engines' HTTP APIs listen on the nodes' addresses: only holders of the run's secret get in.
        api_key = hmac.new(secret, f"miles-async engine api {rdzv.run_id}".encode(), hashlib.sha256).hexdigest()
        reason = "the run is over"
        joins: threading.Event | None = None

        def start(resume: bool) -> Controller:
            nonlocal joins
            controller = Controller(config, out, resume=resume, progress=not args.quiet, runtime=runtime,
                                    system=system, nodes=nodes, engine_api_key=api_key, checked=checked)
            joins = serve_joins(system, store, rdzv, secret, controller, agents, args)
            return controller

        async def restarting(attempt: int, error: RunLostError) -> None:
            print(f"{PROG}: {restart_line(attempt, args.max_restarts, error)}", file=sys.stderr)
            assert joins is not None
            joins.set()  # the next start serves joins of its own
            await stop_run(system, agents)

        try:
            result = await run_restarting(start, resume=args.resume, max_restarts=args.max_restarts,
                                          on_restart=restarting)
        except BaseException as e:
            reason = f"the run stopped on node 0: {type(e).__name__}: {str(e).split(REMOTE_TRACEBACK)[0].strip()}"
            raise
        finally:
            if joins is not None:
                joins.set()
            for rank, agent in list(agents.items()):
                try:
                    await agent.ask(ShutdownNode(reason=reason), timeout_s=60.0)
                except Exception as e:  # noqa: BLE001 - a node already gone has nothing left to stop
                    log.warning("node %d did not confirm its shutdown: %s", rank, e)
    summary = msgspec.json.encode(result).decode()
    (out / "summary.json").write_text(summary)
    print(summary)
    return 130 if result.interrupted else 0


async def run_other_node(args: Any, rdzv: Any, store: Any, host: str) -> int:
    from miles_async.launch.agent import NodeAgent, agent_name
    from miles_async.runtime import ActorSystem

    directory = (await asyncio.to_thread(store.get, "directory", args.rdzv_timeout_s)).decode()
    done = asyncio.Event()
    outcome: dict[str, str] = {}
    async with ActorSystem(f"node{args.node_rank}", config=runtime_config(host, args), directory=directory,
                           key_dir=rdzv.key_dir) as system:
        await system.spawn(NodeAgent, agent_name(args.node_rank, os.getpid()),
                           kwargs={"node_rank": args.node_rank, "host": host, "num_gpus": num_gpus(),
                                   "controller_address": directory, "done": done, "outcome": outcome})
        print(f"{PROG}: node {args.node_rank} at {host} joined the run; serving until node 0 says stop",
              file=sys.stderr)
        await done.wait()
        await asyncio.sleep(0.2)  # the answer to node 0's ShutdownNode leaves before this system closes
    reason = outcome.get("reason", "")
    print(f"{PROG}: node {args.node_rank} stops: {reason}", file=sys.stderr)
    return 0 if outcome.get("clean") == "yes" else 1


def runtime_config(host: str, args: Any) -> RuntimeConfig:
    timeout_s = args.heartbeat_timeout_s
    return RuntimeConfig(transport="tcp", host=host, curve=True,
                         run_dir=tempfile.mkdtemp(prefix=f"miles-async-node{args.node_rank}-"),
                         ask_timeout_s=600.0, spawn_timeout_s=300.0, heartbeat_timeout_s=timeout_s,
                         heartbeat_interval_s=min(1.0, timeout_s / 4), preload=NODE_PRELOAD)


def main(args: Any) -> int:
    """The `launch` verb (its arguments parsed by `miles_async.launch.cli`)."""
    from miles_async.launch.catalog import find_recipe

    # Refused before the library is imported (seconds: torch and the actors): a node rank out of
    # range, a recipe that is neither a file nor a shipped one.
    if not 0 <= args.node_rank < args.nnodes:
        print(f"{PROG}: --node-rank {args.node_rank} is outside 0..{args.nnodes - 1}", file=sys.stderr)
        return 2
    try:
        recipe = find_recipe(args.recipe)  # a file, or a shipped recipe's name
    except ValueError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2

    if not args.dry_run:
        start_fork_server(RuntimeConfig(preload=NODE_PRELOAD))  # its imports beside the ones below
    from miles_async.actors.controller import RunLostError, RunSetupError
    from miles_async.actors.preflight import check_run
    from miles_async.actors.recipe import dump_recipe_toml, load_recipe
    from miles_async.launch.console import log_level
    from miles_async.launch.rendezvous import RendezvousError, load_secret, rendezvous
    from miles_async.runtime import SpawnError
    from miles_async.runtime import run as run_async

    logging.basicConfig(level=log_level(args),
                        format=f"%(asctime)s %(levelname)s [node {args.node_rank}] %(name)s: %(message)s")
    try:
        config = load_recipe(recipe, args.overrides)
        secret = b"" if args.dry_run else load_secret(args.secret_file)
    except (ValueError, OSError) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    beyond = sorted(n for n in config.placement.nodes if n >= args.nnodes)
    if beyond:
        print(f"{PROG}: [placement] names node(s) {beyond} but --nnodes is {args.nnodes}", file=sys.stderr)
        return 2
    out = Path(args.out or Path("runs") / f"{recipe.stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    checked = None
    if args.node_rank == 0 or args.dry_run:  # node 0's pre-flight, before the others are waited for or --out is made
        try:
            checked = check_run(config, out, num_nodes=args.nnodes)
        except ValueError as e:
            print(f"{PROG}: the run cannot start: {e}", file=sys.stderr)
            return 2
    if args.dry_run:
        print(dump_recipe_toml(config), end="")
        return 0
    host = args.host or route_address(args.master_addr, args.master_port)
    key_dir = tempfile.mkdtemp(prefix=f"miles-async-keys-node{args.node_rank}-")
    try:
        rdzv, store = rendezvous(nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
                                 master_port=args.master_port, secret=secret, host=host, key_dir=key_dir,
                                 timeout_s=args.rdzv_timeout_s, num_gpus=num_gpus())
    except RendezvousError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 3
    try:
        if args.node_rank == 0:
            print(f"{PROG}: {args.nnodes} node(s) arrived: "
                  + ", ".join(f"{n.rank}={n.host}" for n in rdzv.nodes) + f"; {recipe} -> {out}", file=sys.stderr)
            return run_async(run_node_zero(args, config, rdzv, store, host, out, secret, checked))
        return run_async(run_other_node(args, rdzv, store, host))
    except TimeoutError as e:
        print(f"{PROG}: node {args.node_rank}: {e}", file=sys.stderr)
        return 3
    except RunLostError as e:  # a trainer rank, the scheduler, the buffer or the session server died
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    except RunSetupError as e:
        print(f"{PROG}: the run cannot start: {e}", file=sys.stderr)
        return 2
    except SpawnError as e:  # a process of the run could not start (every node was told, and stopped)
        print(f"{PROG}: the run could not start: {e.actor} failed: {e.cause.type}: {e.cause.message}",
              file=sys.stderr)
        return 1
    finally:
        store.close()
