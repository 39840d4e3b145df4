"""`miles-async bench sim`: the simulator at scale, beside a bare discrete-event heap.

The issue's target: "Scale: 100,000 samples over 512 simulated engines in under 10 seconds on one
core." In one run, for each scenario asked (`--scenario`, both by default):

* ours: `miles_async.sim.simulate(config, costs, workload, record=False)` timed with
  `time.perf_counter`, on a synthetic scenario (`miles_async.sim.synthetic.SCENARIOS`) scaled to
  `--engines` engines (512): `max_in_flight_per_engine=32`, `target_in_flight = engines * 32`,
  `batch_groups = engines`, `capacity_groups = 4 * batch_groups` (the scenarios' own ratio), and
  `num_steps = ceil(samples / (batch_groups * group_size))`, so that at least `--samples`
  (100,000) samples are generated: every trained sample was generated, and the filter's drops
  and the samples still in flight at the end add more. The simulator has no stop-at-N-samples
  condition, so the run generates more than asked (`samples_generated`, reported); the target is
  checked against the count asked, which only makes it harder. Two scenarios: `math-8gpu`
  (single turn, long-tailed lengths) and `agentic-64gpu` (4-20 turns with tool calls, long
  tails: many more events per sample).
* the floor: a bare discrete-event loop (`bare_heap`) doing the same heap operations, as many
  pops of (time, seq, code, obj, gen) tuples as the simulator handled events (`num_events`), each
  popped event's trivial handler pushing the next one (the classic hold model), on a heap kept at
  `target_in_flight` entries (one pending event per sample in flight). The simulator's own heap is
  smaller (one tick per engine plus the samples in prefill or a tool call, and ticks made stale by
  a reschedule: a mean of about 5 to 10 per engine, measured), so this floor is if anything slow and
  the ratio low. `ratio_to_bare_heap = sim_s / floor_s` is what the simulator's policies, engines
  and bookkeeping cost over the heap alone.

Rounds interleave ours and the floor (`--repeat`), so drift in machine load hits both alike; the
figures are the best round's (`*_reps` list every round, `*_median` the median). Each round starts
cold (the workload's per-prompt cache cleared). The simulator is single-threaded: one core is
what it uses whatever `cpus_allowed` (`os.sched_getaffinity`) says. `meets_target`:
`sim_s < 10 * samples / 100000` (the issue's 10 s, scaled to the count asked).

Last measured here (2 cores, machine otherwise idle; defaults, one round):
  math-8gpu     25 steps, 140,240 samples generated (102,400 trained), 311k events (2.2 a sample):
                4.7 s vs 0.30 s for the bare heap; meets the 10 s target.
  agentic-64gpu 25 steps, 143,264 samples generated, 4.40M events (30.7 a sample: 4-20 turns,
                each a start, its ticks and a tool call): 13.4 s vs 4.9 s for the bare heap,
                ratio 2.7: over 10 s, as 100k agentic episodes are 1.2M engine calls.
Where agentic's time goes (cProfile): the engines' per-turn bookkeeping (`Simulator._tick`,
`_start`, `_schedule`, `_advance`) and the run loop's dispatch; the refill and buffer policies
are under 10%, drawing the samples (numpy, one generator per group) about 8%.

Prints one JSON object on stdout (indented without `--json`); progress goes to stderr.

    miles-async bench sim --json
    miles-async bench sim --json --scenario math-8gpu --repeat 3
    miles-async bench sim --json --engines 16 --samples 3000      # small (the e2e test)
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from typing import Any

import msgspec

import miles_async
from miles_async.sim import SimResult, simulate
from miles_async.sim.synthetic import SCENARIOS, Scenario

TARGET_S = 10.0  # the issue's: seconds for TARGET_SAMPLES samples on one core
TARGET_SAMPLES = 100_000
PER_ENGINE = 32  # samples in flight per engine
CHOICES = ("math-8gpu", "agentic-64gpu")


def _progress(line: str) -> None:
    print(f"[bench sim] {line}", file=sys.stderr, flush=True)  # stdout carries only the JSON


def scaled(name: str, engines: int, samples: int, per_engine: int = PER_ENGINE) -> Scenario:
    """The scenario `name` scaled to `engines` engines, with enough steps to generate `samples` samples."""
    chosen = SCENARIOS[name]
    group_size = chosen.config.group_size
    batch_groups = engines
    config = msgspec.structs.replace(
        chosen.config, num_engines=engines, target_in_flight=engines * per_engine,
        max_in_flight_per_engine=per_engine, batch_groups=batch_groups, capacity_groups=4 * batch_groups,
        num_steps=max(1, math.ceil(samples / (batch_groups * group_size))))
    return msgspec.structs.replace(chosen, config=config)


def _cold() -> None:
    """Clear the workload's caches, so every round starts as a fresh process would."""
    from miles_async.sim.workload import clear_caches

    clear_caches()


def run_sim(chosen: Scenario) -> tuple[float, SimResult]:
    _cold()
    t0 = time.perf_counter()
    result = simulate(chosen.config, chosen.costs, chosen.workload, record=False)
    return time.perf_counter() - t0, result


class _Hold:
    """The bare loop's one handler: each popped event pushes the next, a pre-drawn delay later."""

    __slots__ = ("deltas", "heap", "i", "seq", "t")

    def __init__(self, heap: list, deltas: list[float], seq: int) -> None:
        self.heap, self.deltas, self.seq, self.i, self.t = heap, deltas, seq, 0, 0.0

    def handle(self, obj: object, gen: int) -> None:
        self.seq += 1
        self.i = (self.i + 1) & 4095
        heapq.heappush(self.heap, (self.t + self.deltas[self.i], self.seq, 0, obj, gen))


def bare_heap(num_events: int, heap_size: int, seed: int = 0) -> float:
    """Seconds for `num_events` pops (and as many pushes) of (time, seq, code, obj, gen) tuples on
    a heap of `heap_size` entries, each through a trivial handler: the floor of any event loop."""
    rng = random.Random(seed)
    deltas = [rng.expovariate(1.0) for _ in range(4096)]
    heap = [(rng.random(), i, 0, None, 0) for i in range(heap_size)]
    heapq.heapify(heap)
    hold = _Hold(heap, deltas, heap_size)
    handlers = (hold.handle,)
    pop = heapq.heappop
    t0 = time.perf_counter()
    for _ in range(num_events):
        t, _, code, obj, gen = pop(heap)
        hold.t = t
        handlers[code](obj, gen)
    return time.perf_counter() - t0


def measure_scenario(name: str, engines: int, samples: int, repeat: int) -> dict:
    chosen = scaled(name, engines, samples)
    config = chosen.config
    sim_reps: list[float] = []
    floor_reps: list[float] = []
    result: SimResult | None = None
    for i in range(repeat):
        sim_s, result = run_sim(chosen)
        sim_reps.append(sim_s)
        floor_reps.append(bare_heap(result.num_events, config.target_in_flight))
        _progress(f"{name} round {i + 1}/{repeat}: {result.stats.samples_generated:,} samples, "
                  f"{result.num_events:,} events in {sim_s:.2f} s; bare heap {floor_reps[-1]:.2f} s")
    assert result is not None
    stats = result.stats
    sim_s, floor_s = min(sim_reps), min(floor_reps)
    generated = stats.samples_generated
    target = TARGET_S * samples / TARGET_SAMPLES
    return {
        "scenario": name,
        "description": chosen.description,
        "config": {field: getattr(config, field) for field in (
            "num_engines", "mode", "max_staleness", "group_size", "batch_groups", "target_in_flight",
            "max_in_flight_per_engine", "capacity_groups", "partial", "filter", "num_steps")},
        "samples_asked": samples,
        "samples_generated": generated,
        "samples_trained": stats.num_steps * config.batch_groups * config.group_size,
        "dropped_groups": stats.dropped,
        "num_events": result.num_events,
        "events_per_sample": round(result.num_events / max(generated, 1), 2),
        "sim_s": round(sim_s, 4),
        "sim_s_median": round(statistics.median(sim_reps), 4),
        "sim_s_reps": [round(x, 4) for x in sim_reps],
        "floor_s": round(floor_s, 4),
        "floor_s_median": round(statistics.median(floor_reps), 4),
        "floor_s_reps": [round(x, 4) for x in floor_reps],
        "floor_heap_size": config.target_in_flight,
        "ratio_to_bare_heap": round(sim_s / floor_s, 3),
        "samples_per_s_of_wall": round(generated / sim_s, 1),
        "events_per_s": round(result.num_events / sim_s, 1),
        "floor_events_per_s": round(result.num_events / floor_s, 1),
        "simulated_span_s": round(stats.span_s, 3),
        "simulated_s_per_wall_s": round(stats.span_s / sim_s, 2),
        "s_per_100k_generated": round(sim_s * TARGET_SAMPLES / max(generated, 1), 3),
        "target_s": TARGET_S,
        "target_s_scaled": round(target, 4),
        "meets_target": sim_s < target,
    }


_MEASURED = ("sim_s: wall time (perf_counter) of simulate(..., record=False), best of the rounds. floor_s: a bare "
             "heapq loop with num_events pops and pushes of (time, seq, code, obj, gen) tuples, a trivial handler, "
             "a heap of target_in_flight entries, best of the rounds interleaved with ours. simulated_span_s: "
             "RunStats.span_s (first to last train step end). meets_target: sim_s < target_s * samples_asked / "
             "100000 (the issue's 10 s per 100,000 samples on one core).")


def _cpus_allowed() -> int | None:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def measure(names: list[str], engines: int, samples: int, repeat: int) -> dict:
    result: dict[str, Any] = {
        "bench": "sim",
        "versions": {"miles_async": miles_async.__version__, "python": platform.python_version(),
                     "implementation": platform.python_implementation(), "msgspec": msgspec.__version__},
        "machine": {"cpus": os.cpu_count(), "cpus_allowed": _cpus_allowed(),
                    "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
                    "note": "the simulator is single-threaded: one core, whatever cpus_allowed is"},
        "settings": {"engines": engines, "samples": samples, "repeat": repeat, "per_engine_in_flight": PER_ENGINE},
        "measured": _MEASURED,
        "scenarios": {},
    }
    for name in names:
        result["scenarios"][name] = measure_scenario(name, engines, samples, repeat)
    meets = {name: result["scenarios"][name]["meets_target"] for name in names}
    result["meets_targets"] = {**meets, "all": all(meets.values())}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="miles-async bench sim", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the JSON object on one line")
    parser.add_argument("--engines", type=int, default=512, help="simulated engines (default %(default)s)")
    parser.add_argument("--samples", type=int, default=TARGET_SAMPLES,
                        help="generate at least this many samples (default %(default)s)")
    parser.add_argument("--scenario", choices=[*CHOICES, "both"], default="both",
                        help="the synthetic scenario to scale (default %(default)s)")
    parser.add_argument("--repeat", type=int, default=1, help="rounds; the best and the median are reported")
    args = parser.parse_args(argv)
    for flag in ("engines", "samples", "repeat"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    names = list(CHOICES) if args.scenario == "both" else [args.scenario]
    result = measure(names, args.engines, args.samples, args.repeat)
    print(json.dumps(result, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
