"""The `miles-async` command line (docs/design.md, "Launch and the command line").

It parses a verb and its arguments and hands off to the library, which it imports only when the
verb runs, so that `--help` stays fast and pulls in neither torch nor ZeroMQ. A verb whose code is
not written yet says so on stderr and exits with status 2; it never pretends to have run. A verb
that serves names its process for `ps` and `top` (`miles-async: controller` for `run`,
`miles-async: node-1 agent` for a `launch` node, `miles-async: serve engine`); the processes a run
starts are named by the runtime (`miles-async: engine-0`, `miles-async: trainer-0`).

`run`, `sft` and `launch` take a recipe file or a shipped recipe's name (`miles-async recipes`
lists them; miles_async/launch/catalog.py). Before the run folder (--out) is made, the pre-flight
(miles_async/actors/preflight.py) checks the recipe, the model, its tokenizer and the task's data: a bad one
is one line on stderr and exit status 2, nothing written. `--dry-run` stops there, printing the
resolved recipe as TOML.

`miles-async bench TARGET ...` passes every argument after TARGET, `--help` included, to
`miles_async.bench.TARGET.main(argv)`.

Try it: `miles-async --help`, `miles-async run reverse --dry-run`, `miles-async bench runtime --json`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from miles_async import __version__
from miles_async.launch.console import log_level, restart_line

PROG = "miles-async"
NOT_IMPLEMENTED_STATUS = 2
# Each target is the module miles_async.bench.<target>; the text names the peer it is measured against.
BENCH_TARGETS = {
    "runtime": "actor messaging, side by side with Ray and raw ZeroMQ",
    "engine": "embedded-engine generation, side by side with HF generate (--vs-vllm: with vLLM's CPU build)",
    "trainer": "a SmolLM2-135M training step, side by side with transformers and torch AdamW",
    "optimizer": "AdamW with its state streamed from disk, side by side with torch AdamW in memory and the disk's rate",
    "weights": "weight transports, side by side with memcpy",
    "loop": "the RL loop, async side by side with sync",
    "sim": "the simulator at scale, side by side with a bare event heap",
    "gpu": "trainer, engine, weight sync and pause/resume on one GPU (Qwen3-0.6B-shaped), beside its limits",
}
# Hugging Face's model_type names (miles_async.models.FAMILIES, not imported here to keep --help
# fast); "qwen3-moe" is accepted for qwen3_moe.
MODEL_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")

# A handler gets the parsed arguments and, for pass-through verbs only, the arguments left over.
Handler = Callable[[argparse.Namespace, list[str]], int]


def _key_value(text: str) -> str:
    key, sep, _ = text.partition("=")
    if not sep or not key or key.startswith("-"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an override: write key=value, e.g. trainer.lr=1e-6"
        )
    return text


RECIPE_HELP = "a recipe file, or the name of a shipped one (`miles-async recipes` lists them)"
DRY_RUN_HELP = ("check the recipe, the model, the tokenizer and the task's data, print the resolved recipe (TOML, every "
                "default filled in) and exit, without writing --out or starting anything")
RESTARTS_HELP = ("when a process the run cannot go on without (a trainer rank, the scheduler, the buffer, the "
                 "session server) dies or fails, stop every process of the run and start it again from its latest "
                 "checkpoint, up to N times, as torchrun does (default: %(default)s)")


def _restarts(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _not_implemented(verb: str, args: argparse.Namespace, extra: list[str]) -> int:
    print(f"{PROG} {verb}: not implemented yet (see the issue tracker)", file=sys.stderr)
    return NOT_IMPLEMENTED_STATUS


def _bench(args: argparse.Namespace, extra: list[str]) -> int:
    module_name = f"miles_async.bench.{args.target}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise  # the benchmark exists but something it imports is missing: show that
        return _not_implemented(f"bench {args.target}", args, extra)
    return module.main(extra)


def _launch(args: argparse.Namespace, extra: list[str]) -> int:
    from miles_async.launch.launcher import main as launch_main

    return launch_main(args)


def _recipes(args: argparse.Namespace, extra: list[str]) -> int:
    """`miles-async recipes`: the shipped recipes, what runs each, what each is and needs."""
    from miles_async.launch.catalog import describe, shipped, shipped_folder

    infos = [describe(path) for path in shipped().values()]
    width = max(len(info.name) for info in infos)
    for info in infos:
        needs = f"  [needs: {'; '.join(info.needs)}]" if info.needs else ""
        print(f"{info.name:<{width}}  {info.verb}  {info.description}{needs}")
    print(f"\nrun one: {PROG} run NAME (sft NAME for an sft recipe) [--dry-run] [key=value ...]; "
          f"the files: {shipped_folder()}")
    return 0


def _sim(args: argparse.Namespace, extra: list[str]) -> int:
    from miles_async.sim.cli import main as sim_main

    return sim_main(args)


def _init_model(args: argparse.Namespace, extra: list[str]) -> int:
    from miles_async.models import init_model

    try:
        folder = init_model(args.family, args.preset, args.out, seed=args.seed)
    except ValueError as e:  # a bad preset: say so like argparse does, without a traceback
        print(f"{PROG} init-model: {e}", file=sys.stderr)
        return 2
    print(f"wrote a random-init {args.family} ({args.preset}) model and its tokenizer to {folder}")
    return 0


def _serve_engine(args: argparse.Namespace, extra: list[str]) -> int:
    from miles_async.models.hub import resolve_model

    try:  # a folder, or a Hub id's snapshot (downloaded into the Hugging Face cache if needed and allowed)
        model = resolve_model(args.model, args.revision, key="--model", revision_key="--revision")
    except ValueError as e:
        print(f"{PROG} serve engine: {e}", file=sys.stderr)
        return 2
    if model.commit:
        print(f"{PROG} serve engine: {model.describe()}", file=sys.stderr)
    from miles_async.engine.server import main as serve_engine  # after the model is found: it imports torch

    return serve_engine(str(model.folder), args.host, args.port,
                        api_key=args.api_key or os.environ.get("MILES_ASYNC_API_KEY"),
                        kv_cache_mib=args.kv_cache_mib, max_running_requests=args.max_running_requests,
                        device=args.device, served_model_name=args.served_model_name or model.name)


def _refused_early(verb: str, args: argparse.Namespace) -> bool:
    """Whether `run`/`sft` is refused before importing the library (seconds: torch and the actors),
    having said why: a resume without --out, a recipe that is neither a file nor a shipped one.
    Sets `args.recipe_path` to the recipe's file (miles_async/launch/catalog.py)."""
    from miles_async.launch.catalog import find_recipe

    if args.resume and not args.out:
        print(f"{PROG} {verb}: --resume needs --out DIR (the run to continue)", file=sys.stderr)
        return True
    try:
        args.recipe_path = find_recipe(args.recipe)
    except ValueError as e:
        print(f"{PROG} {verb}: {e}", file=sys.stderr)
        return True
    return False


def _start_fork_server(args: argparse.Namespace) -> None:
    """The run's fork server, started before `run`/`sft` import torch and the actors, so that its
    own imports of them (RuntimeConfig.preload) run beside these (miles_async/runtime/child.py)."""
    if not args.dry_run:
        from miles_async.actors import PRELOAD
        from miles_async.runtime.child import start_fork_server
        from miles_async.runtime.config import RuntimeConfig

        start_fork_server(RuntimeConfig(preload=PRELOAD))


def _prepared(verb: str, args: argparse.Namespace, load: Callable[[Any, list[str]], Any],
              check: Callable[[Any, Any], Any], dump: Callable[[Any], str]) -> tuple[Any, Any, Any] | int:
    """`run`/`sft` up to the start: the recipe (`load(path, overrides)`), the pre-flight's result
    (`check(recipe, out)`: everything checked before the run folder is made) and the run folder,
    logging set up and nothing written yet. Else the exit status, having said on stderr what is
    wrong (a bad recipe or input: 2, one line; a folder in use), or for --dry-run having printed
    the resolved recipe (`dump(recipe)`: TOML, every default filled in): 0."""
    import logging
    import time
    from pathlib import Path

    try:
        recipe = load(args.recipe_path, args.overrides)
    except ValueError as e:
        print(f"{PROG} {verb}: {e}", file=sys.stderr)
        return 2
    out = Path(args.out or Path("runs") / f"{args.recipe_path.stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    if not args.resume and (out / "metrics.jsonl").exists():
        print(f"{PROG} {verb}: {out} already holds a run; continue it with --resume, or choose another --out",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=log_level(args), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        checked = check(recipe, out)
    except ValueError as e:  # the model, the teacher, the tokenizer, the task's data: nothing written yet
        print(f"{PROG} {verb}: the run cannot start: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(dump(recipe), end="")
        return 0
    print(f"{PROG} {verb}: {args.recipe_path} -> {out}", file=sys.stderr)
    return recipe, checked, out


def _run(args: argparse.Namespace, extra: list[str]) -> int:
    """`miles-async run RECIPE`: the whole loop on this node (miles_async/actors/controller.py)."""
    if _refused_early("run", args):
        return 2
    _start_fork_server(args)
    from miles_async.actors.controller import RunLostError, RunSetupError
    from miles_async.actors.controller import run as run_loop
    from miles_async.actors.preflight import check_run
    from miles_async.actors.recipe import dump_recipe_toml, load_recipe
    from miles_async.runtime import SpawnError
    from miles_async.runtime import run as run_async

    prepared = _prepared("run", args, load_recipe, check_run, dump_recipe_toml)
    if isinstance(prepared, int):
        return prepared
    config, checked, out = prepared

    def said(attempt: int, error: RunLostError) -> None:
        print(f"{PROG} run: {restart_line(attempt, args.max_restarts, error)}", file=sys.stderr)

    try:
        result = run_async(run_loop(config, out, resume=args.resume, progress=not args.quiet,
                                    max_restarts=args.max_restarts, on_restart=said, checked=checked))
    except RunLostError as e:  # a trainer rank, the scheduler, the buffer or the session server died
        print(f"{PROG} run: {e}", file=sys.stderr)
        return 1
    except RunSetupError as e:
        print(f"{PROG} run: the run cannot start: {e}", file=sys.stderr)
        return 2
    except SpawnError as e:  # a process of the run could not start: its own error, not our traceback
        return _spawn_failed("run", e)
    return _summary(out, result)


def _spawn_failed(verb: str, error: Any) -> int:
    print(f"{PROG} {verb}: the run could not start: {error.actor} failed: {error.cause.type}: {error.cause.message}",
          file=sys.stderr)
    return 1


def _summary(out: Any, result: Any) -> int:
    """Print a run's result (and write it to `out/summary.json`); its exit status."""
    import msgspec

    summary = msgspec.json.encode(result).decode()
    (out / "summary.json").write_text(summary)
    print(summary)
    return 130 if result.interrupted else 0


def _sft(args: argparse.Namespace, extra: list[str]) -> int:
    """`miles-async sft RECIPE`: supervised fine-tuning on the trainer ranks (miles_async/actors/sft.py)."""
    if _refused_early("sft", args):
        return 2
    _start_fork_server(args)
    from miles_async.actors.sft import SFTRun, load_sft_recipe, sft_recipe_toml
    from miles_async.observe import TrackerError
    from miles_async.runtime import SpawnError
    from miles_async.runtime import run as run_async

    def check(recipe: Any, out: Any) -> SFTRun:
        sft = SFTRun(recipe, out, resume=args.resume, progress=not args.quiet)
        sft.prepare()  # the model and the data file: ValueError, nothing written
        return sft

    prepared = _prepared("sft", args, load_sft_recipe, check, sft_recipe_toml)
    if isinstance(prepared, int):
        return prepared
    _, sft, out = prepared
    try:
        result = run_async(sft.run())
    except SpawnError as e:
        return _spawn_failed("sft", e)
    except TrackerError as e:  # wandb could not start (a key it refused, no network): its own line
        print(f"{PROG} sft: the run cannot start: {e}", file=sys.stderr)
        return 2
    return _summary(out, result)


def _plot(args: argparse.Namespace, extra: list[str]) -> int:
    from miles_async.observe.plot import main as plot_main

    return plot_main(args.run_dir)


def _serve_session(args: argparse.Namespace, extra: list[str]) -> int:
    """`miles-async serve session`: the TITO session server in front of one or more engines."""
    import json
    import urllib.request

    model, served = args.model, args.served_model_name
    if model is not None:  # a folder, or a Hub id's snapshot (its config and tokenizer files: no weights)
        from miles_async.models.hub import resolve_model

        try:
            resolved = resolve_model(model, args.revision, key="--model", revision_key="--revision", weights=False)
        except ValueError as e:
            print(f"{PROG} serve session: {e}", file=sys.stderr)
            return 2
        if resolved.commit:
            print(f"{PROG} serve session: {resolved.describe()}", file=sys.stderr)
        model, served = str(resolved.folder), served or resolved.name
    elif args.revision:
        print(f"{PROG} serve session: --revision {args.revision} picks a revision of a Hugging Face id: give it "
              "with --model ORG/NAME", file=sys.stderr)
        return 2
    else:
        try:
            with urllib.request.urlopen(f"{args.engine[0].rstrip('/')}/get_model_info", timeout=10) as response:
                info = json.load(response)
            model, served = info.get("tokenizer_path"), served or info.get("served_model_name")
        except OSError as e:
            print(f"{PROG} serve session: cannot ask {args.engine[0]} for its model ({e}); give --model DIR",
                  file=sys.stderr)
            return 2
        if not model:
            print(f"{PROG} serve session: {args.engine[0]} reports no tokenizer; give --model DIR", file=sys.stderr)
            return 2
    from miles_async.agents.session import main as serve_session  # after the checks: it imports torch

    return serve_session(args.engine, model, args.host, args.port, served_model_name=served)


def _add_verb(subparsers, name: str, help_text: str, handler: Handler, **kwargs) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(name, help=help_text, description=help_text, **kwargs)
    parser.set_defaults(handler=handler)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Fully asynchronous RL post-training of language models on an actor runtime of its own.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)

    run = _add_verb(verbs, "run", "run the whole loop on this node", _run)
    run.add_argument("recipe", metavar="RECIPE", help=RECIPE_HELP)
    run.add_argument("--out", metavar="DIR", help="run directory (default: a new folder under runs/)")
    run.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    run.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    run.add_argument("--max-restarts", type=_restarts, default=0, metavar="N", help=RESTARTS_HELP)
    run.add_argument("--quiet", action="store_true", help="no live progress display, warnings only")
    run.add_argument("--verbose", action="store_true", help="log every weight update, SFT probe and agent turn")
    run.add_argument(
        "overrides",
        nargs="*",
        type=_key_value,
        metavar="key=value",
        help="override a config field by dotted path",
    )

    sft = _add_verb(verbs, "sft", "supervised fine-tuning from a data file, on the trainer ranks", _sft)
    sft.add_argument("recipe", metavar="RECIPE", help=f"the SFT recipe ([model], [data], [loop], [trainer]): {RECIPE_HELP}")
    sft.add_argument("--out", metavar="DIR", help="run directory (default: a new folder under runs/)")
    sft.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    sft.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    sft.add_argument("--quiet", action="store_true", help="no progress lines, warnings only")
    sft.add_argument("--verbose", action="store_true", help="debug logging")
    sft.add_argument("overrides", nargs="*", type=_key_value, metavar="key=value",
                     help="override a config field by dotted path")

    launch = _add_verb(verbs, "launch", "start this node's part of a multi-node run (one launcher per node)", _launch)
    launch.add_argument("--nnodes", type=int, required=True, metavar="N", help="number of nodes")
    launch.add_argument("--node-rank", type=int, required=True, metavar="R", help="this node's rank, 0..N-1")
    launch.add_argument("--master-addr", required=True, metavar="A", help="address of node 0")
    launch.add_argument("--master-port", type=int, required=True, metavar="P", help="port on node 0")
    launch.add_argument("recipe", metavar="RECIPE", help=f"the recipe, the same on every node: {RECIPE_HELP}")
    launch.add_argument("--dry-run", action="store_true",
                        help="check what node 0 checks (the recipe, the model, the tokenizer, the task's data), print "
                        "the resolved recipe and exit, without meeting the other nodes (no secret needed), writing "
                        "--out or starting anything")
    launch.add_argument("--host", metavar="H",
                        help="this node's address, as the others reach it (default: the one on the route to A)")
    launch.add_argument("--secret-file", metavar="F",
                        help="the run's shared secret (default: the MILES_ASYNC_SECRET environment variable)")
    launch.add_argument("--rdzv-timeout-s", type=float, default=120.0, metavar="S",
                        help="how long the nodes may take to arrive (default: %(default)s)")
    launch.add_argument("--heartbeat-timeout-s", type=float, default=10.0, metavar="S",
                        help="a node (or process) silent this long is declared lost (default: %(default)s)")
    launch.add_argument("--out", metavar="DIR", help="run directory, on node 0 (default: a new folder under runs/)")
    launch.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    launch.add_argument("--max-restarts", type=_restarts, default=0, metavar="N", help=RESTARTS_HELP)
    launch.add_argument("--quiet", action="store_true", help="no live progress display, warnings only")
    launch.add_argument("--verbose", action="store_true", help="log every weight update, SFT probe and agent turn")
    launch.add_argument("overrides", nargs="*", type=_key_value, metavar="key=value",
                        help="override a config field by dotted path")

    _add_verb(verbs, "recipes", "list the shipped recipes (run one by name: miles-async run reverse)", _recipes)

    serve = verbs.add_parser(
        "serve", help="serve an engine or a session server", description="Serve over HTTP."
    )
    servers = serve.add_subparsers(dest="server", metavar="SERVER", required=True)
    engine = _add_verb(
        servers,
        "engine",
        "the embedded engine behind SGLang's native HTTP API",
        _serve_engine,
    )
    engine.add_argument("--model", required=True, metavar="MODEL",
                        help="a Hugging Face model folder, or a Hub id org/name (into the Hugging Face cache: HF_HOME, "
                        "HF_TOKEN; HF_HUB_OFFLINE=1 keeps to it)")
    engine.add_argument("--revision", default="", metavar="REV",
                        help="of a Hub id: a branch, tag or commit (default: main)")
    engine.add_argument(
        "--host", default="127.0.0.1", metavar="H", help="address to bind (default: %(default)s)"
    )
    engine.add_argument("--port", type=int, default=30000, metavar="P",
                        help="port, 0 for any free one (default: %(default)s)")
    engine.add_argument("--kv-cache-mib", type=float, default=512.0, metavar="MIB",
                        help="KV cache memory, all layers (default: %(default)s)")
    engine.add_argument("--api-key", metavar="KEY", help="require `Authorization: Bearer KEY` on every request "
                        "(default: MILES_ASYNC_API_KEY; none on loopback)")
    engine.add_argument("--max-running-requests", type=int, default=256, metavar="N",
                        help="requests decoded together at most; more wait (default: %(default)s)")
    engine.add_argument("--device", default="cpu", metavar="DEV",
                        help='cpu, cuda, cuda:N, or auto (a GPU if one is visible) (default: %(default)s)')
    engine.add_argument("--served-model-name", metavar="NAME",
                        help="the model's name in the OpenAI API and /metrics (default: --model as given: a Hub id, "
                        "or the folder's name)")
    session = _add_verb(servers, "session", "the TITO session server, OpenAI-compatible", _serve_session)
    session.add_argument("--engine", required=True, action="append", metavar="URL",
                         help="URL of an engine to route to (repeat for several; sessions stick to one)")
    session.add_argument("--model", metavar="MODEL",
                         help="the model folder, or Hub id org/name, whose tokenizer to use (default: the engine's, "
                         "from /get_model_info)")
    session.add_argument("--revision", default="", metavar="REV",
                         help="of a Hub id: a branch, tag or commit (default: main)")
    session.add_argument("--host", default="127.0.0.1", help="interface to bind (default: %(default)s)")
    session.add_argument("--port", type=int, default=8000, metavar="P", help="port (default: %(default)s)")
    session.add_argument("--served-model-name", metavar="NAME",
                         help="the model's name in /v1/models and /metrics (default: --model as given, else the "
                         "engine's served name)")

    sim = _add_verb(verbs, "sim", "replay a recorded trace (or a synthetic scenario) in the simulator", _sim)
    sim.add_argument("trace", nargs="?", metavar="TRACE.jsonl", help="a run's trace.jsonl (or .jsonl.gz)")
    sim.add_argument("--synthetic", metavar="NAME", help="simulate a built-in planning scenario instead of a trace "
                     "(agentic-64gpu, math-8gpu)")
    sim.add_argument("--set", action="append", metavar="KEY=VALUE",
                     help="change a setting: num_engines=4, mode=sync, max_staleness=1, refill=group, "
                     "gen.token_s=0.02, ... (repeatable)")
    sim.add_argument("--sweep", action="append", metavar="KEY=V1,V2,...",
                     help="one simulation per value, as a table (repeat for every combination)")
    sim.add_argument("--costs", choices=("fitted", "replay"), default="fitted",
                     help="time samples with the fitted cost models, or with their recorded durations "
                     "(default: %(default)s)")
    sim.add_argument("--segment", type=int, metavar="K", help="which segment of a resumed run's trace (default: "
                     "the one with the most steps)")
    sim.add_argument("--timeline", metavar="PNG", help="draw engines and trainer as lanes over time")
    sim.add_argument("--window-steps", type=int, default=10, metavar="N",
                     help="the timeline shows the last N steps, 0 for all (default: %(default)s)")
    sim.add_argument("--sweep-plot", metavar="PNG", help="draw the sweep's metrics against its values")
    sim.add_argument("--write", metavar="TRACE", help="save the simulated run as a trace (e.g. a synthetic one)")
    sim.add_argument("--json", action="store_true", help="print the report as JSON")

    bench = verbs.add_parser(
        "bench",
        help="side-by-side benchmarks",
        description="Benchmarks that print JSON. Arguments after TARGET go to the benchmark itself: "
        "`miles-async bench TARGET --help` lists them.",
    )
    targets = bench.add_subparsers(dest="target", metavar="TARGET", required=True)
    for target, help_text in BENCH_TARGETS.items():
        # add_help=False: --help after TARGET belongs to the benchmark's own parser.
        _add_verb(targets, target, help_text, _bench, add_help=False).set_defaults(passes_through=True)

    init_model = _add_verb(
        verbs,
        "init-model",
        "write a randomly initialised model and its tokenizer",
        _init_model,
    )
    init_model.add_argument(
        "--family",
        required=True,
        type=lambda text: text.replace("-", "_"),
        choices=MODEL_FAMILIES,
        help="model family",
    )
    init_model.add_argument(
        "--preset", default="tiny", metavar="NAME", help="size preset (default: %(default)s)"
    )
    init_model.add_argument("--out", required=True, metavar="DIR", help="folder to write")
    init_model.add_argument("--seed", type=int, default=0, help="weight seed (default: %(default)s)")

    plot = _add_verb(verbs, "plot", "write PNG plots of a run (RUN_DIR/plots/*.png)", _plot)
    plot.add_argument("run_dir", metavar="RUN_DIR", help="a run directory")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "passes_through", False):
        return args.handler(args, extra)
    if extra and hasattr(args, "overrides") and not any(text.startswith("-") for text in extra):
        # argparse leaves over the overrides that follow an option (`run R --out D k=v`).
        try:
            args.overrides += [_key_value(text) for text in extra]
        except argparse.ArgumentTypeError as e:
            parser.error(str(e))
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    role = _process_role(args)
    if role:
        from miles_async.runtime.proctitle import set_title

        set_title(role)
    return args.handler(args, [])


def _process_role(args: argparse.Namespace) -> str:
    """What `ps` and `top` call this process while it serves a run (runtime/proctitle.py); ""
    for the short-lived verbs, which keep their command line."""
    if args.handler is _run:
        return "controller"
    if args.handler is _launch:
        return "node-0 controller" if args.node_rank == 0 else f"node-{args.node_rank} agent"
    if args.handler in (_serve_engine, _serve_session):
        return f"serve {args.server}"
    return ""


if __name__ == "__main__":
    sys.exit(main())
