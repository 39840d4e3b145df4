"""`miles-async bench runtime`: actor round trips between two processes, beside its peers.

Our side: the benchmark process hosts an ActorSystem and spawns an `Echo` actor in a child
process (`spawn(..., process=True)`), then measures, over ipc and tcp,
  * sequential `await ref.ask(msg)` round trips per second (one outstanding),
  * pipelined round trips per second with 64 asks in flight (`ref.ask_future`),
  * p50/p99 latency of the sequential asks.
In the same run, the same workloads on the peers (miles_async/bench/runtime_peers.py): a raw asyncio
ZeroMQ + msgspec echo loop (the floor we build on) and a Ray actor (what users would otherwise
pick; its pipelined figure the best of a blocking get on the oldest call, `ray.wait` and a batched
`ray.get`, each recorded), and the ratios. Rounds interleave our runtime and the raw loop, so drift in machine
load hits both alike. Prints one JSON object.

    miles-async bench runtime --json
    miles-async bench runtime --json --num-sequential 2000 --num-pipelined 10000 --reps 1
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import sys
import time
from typing import Any

from miles_async.bench.runtime_peers import NUM_WARMUP, check_counts, raw_zmq, ray_actor, summarise
from miles_async.runtime import Actor, ActorSystem, Message, RuntimeConfig, handler, run

WINDOW = 64
TARGETS = {"sequential_vs_ray": 4.0, "pipelined_vs_ray": 6.0, "raw_zmq_over_ours_max": 1.5}


class Echo(Message[Any]):
    """The same fields as the peers' payload (miles_async/bench/runtime_peers.py: EchoMsg)."""

    id: int
    step: int
    tokens: list[int]
    tag: str


Echo.Reply = Echo


class EchoActor(Actor):
    @handler
    async def echo(self, msg: Echo) -> Echo:
        return msg


def _payload(i: int) -> Echo:
    return Echo(id=i, step=7, tokens=list(range(16)), tag="rollout")


async def _ours(transport: str, num_sequential: int, num_pipelined: int, reps: int) -> dict:
    async with ActorSystem("bench", config=RuntimeConfig(transport=transport)) as system:
        echo = await system.spawn(EchoActor, "echo", process=True)
        for i in range(NUM_WARMUP):
            await echo.ask(_payload(i))
        sequential, latencies, pipelined = [], [], []
        for _ in range(reps):
            rep_latencies = []
            msg = _payload(0)
            t0 = time.perf_counter()
            for _ in range(num_sequential):
                t = time.perf_counter()
                reply = await echo.ask(msg)
                rep_latencies.append(time.perf_counter() - t)
            sequential.append(num_sequential / (time.perf_counter() - t0))
            latencies.append(rep_latencies)
            assert reply == msg
            in_flight: collections.deque[asyncio.Future[Any]] = collections.deque()
            t0 = time.perf_counter()
            for _ in range(num_pipelined):
                if len(in_flight) >= WINDOW:
                    await in_flight.popleft()
                in_flight.append(echo.ask_future(msg))
            while in_flight:
                await in_flight.popleft()
            pipelined.append(num_pipelined / (time.perf_counter() - t0))
        await echo.stop()
    return summarise(sequential, pipelined, latencies)


def _merge(results: list[dict]) -> dict:
    """Pool per-round results (each with reps=1) into one summary of the same shape."""
    seq = [x for r in results for x in r["reps"]["sequential_per_s"]]
    pipe = [x for r in results for x in r["reps"]["pipelined_per_s"]]
    out = summarise(seq, pipe, [[1e-6 * r["p50_us"]] for r in results])
    out["p50_us"] = round(sorted(r["p50_us"] for r in results)[len(results) // 2], 1)
    out["p99_us"] = round(sorted(r["p99_us"] for r in results)[len(results) // 2], 1)
    out["reps"]["p50_us"] = [r["p50_us"] for r in results]
    out["reps"]["p99_us"] = [r["p99_us"] for r in results]
    return out


def _versions() -> dict:
    import msgspec
    import zmq

    versions = {"python": platform.python_version(), "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(),
                "msgspec": msgspec.__version__, "cpus": os.cpu_count()}
    for name in ("uvloop", "ray"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    return versions


def measure(num_sequential: int, num_pipelined: int, reps: int, with_ray: bool = True,
            ray_counts: tuple[int, int] = (2000, 8000)) -> dict:
    """Our runtime and the raw loop in interleaved rounds per transport, then Ray.

    Ray gets smaller counts (`ray_counts`): at about 1,000 calls/s here, the same counts would
    take minutes, and its rate does not depend on the count.
    """
    check_counts(num_sequential, num_pipelined, WINDOW, reps)
    result: dict[str, Any] = {"bench": "runtime", "versions": _versions(), "window": WINDOW,
                              "num_sequential": num_sequential, "num_pipelined": num_pipelined, "rounds": reps}
    for transport in ("ipc", "tcp"):
        ours, raw = [], []
        for i in range(reps):
            ours.append(run(_ours(transport, num_sequential, num_pipelined, 1)))
            raw.append(raw_zmq(transport, num_sequential, num_pipelined, WINDOW, reps=1))
            _progress(f"{transport} round {i + 1}/{reps}: miles-async {ours[-1]['sequential_per_s']:,.0f} sequential, "
                      f"{ours[-1]['pipelined_per_s']:,.0f} pipelined per s; raw zmq {raw[-1]['sequential_per_s']:,.0f}, "
                      f"{raw[-1]['pipelined_per_s']:,.0f}")
        result[f"miles_async_{transport}"] = _merge(ours)
        result[f"raw_zmq_{transport}"] = _merge(raw)
    if with_ray:
        _progress(f"Ray actor, {reps} reps of {ray_counts[0]:,} sequential and {ray_counts[1]:,} pipelined calls...")
    result["ray_actor"] = ray_actor(*ray_counts, reps=reps) if with_ray else None
    result["ray_counts"] = list(ray_counts)
    result["ratios"] = _ratios(result)
    return result


def _progress(line: str) -> None:
    print(f"[bench runtime] {line}", file=sys.stderr, flush=True)  # stdout carries only the JSON


def _ratios(result: dict) -> dict:
    ratios: dict[str, Any] = {}
    ray = result.get("ray_actor")
    for transport in ("ipc", "tcp"):
        ours, raw = result[f"miles_async_{transport}"], result[f"raw_zmq_{transport}"]
        r = {
            "raw_zmq_over_ours_sequential": round(raw["sequential_per_s"] / ours["sequential_per_s"], 2),
            "raw_zmq_over_ours_pipelined": round(raw["pipelined_per_s"] / ours["pipelined_per_s"], 2),
        }
        if ray is not None:
            r["sequential_vs_ray"] = round(ours["sequential_per_s"] / ray["sequential_per_s"], 2)
            r["pipelined_vs_ray"] = round(ours["pipelined_per_s"] / ray["pipelined_per_s"], 2)
        limit = TARGETS["raw_zmq_over_ours_max"]
        r["meets_targets"] = (
            r["raw_zmq_over_ours_sequential"] <= limit and r["raw_zmq_over_ours_pipelined"] <= limit
            and (ray is None or (r["sequential_vs_ray"] >= TARGETS["sequential_vs_ray"]
                                 and r["pipelined_vs_ray"] >= TARGETS["pipelined_vs_ray"])))
        ratios[transport] = r
    ratios["targets"] = TARGETS
    return ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="miles-async bench runtime", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--num-sequential", type=int, default=5000)
    parser.add_argument("--num-pipelined", type=int, default=20000)
    parser.add_argument("--reps", type=int, default=3, help="interleaved rounds per transport")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray peer even if installed")
    args = parser.parse_args(argv)
    _progress(f"{args.reps} rounds over ipc and tcp, then Ray: about a minute and a half")
    result = measure(args.num_sequential, args.num_pipelined, args.reps, with_ray=not args.no_ray)
    print(json.dumps(result, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
