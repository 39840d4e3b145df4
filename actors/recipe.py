"""A run's recipe: one TOML file whose tables fill each component's typed config.

    [model]    where the weights come from (a folder, or a fresh `init_model`)
    [task]     the prompts and the reward function (a dotted path)
    [agent]    multi-turn: the agent coroutine and its environment (dotted paths), sandboxes
    [sft]      the warm start before RL (stops when sampled probe accuracy reaches a target)
    [rollout]  engines, rollout workers, sampling, group size, requests in flight, partial rollouts
    [buffer]   capacity, what becomes of stale / aborted groups, the filter
    [loop]     mode (sync | one_step_off | async), max_staleness, steps, batch, checkpoints, seed
    [trainer]  TrainerConfig (without model_dir: the run sets it)
    [weights]  WeightSyncConfig (without family: read from the model)
    [eval]     none | shared | dedicated | command, every N steps
    [placement] multi-node runs: the node of each engine and of the trainer ranks

`load_recipe(path, overrides)` reads the file and applies `key=value` overrides (dotted keys,
TOML values: `loop.num_steps=20`, `rollout.sampling.temperature=0.7`, `eval.mode="shared"`).
Unknown keys and wrong types fail with the key's path, e.g. `Expected int, got str - at
$.loop.num_steps`.

Try it: `python -c "from miles_async.actors.recipe import load_recipe; print(load_recipe('recipes/reverse.toml'))"`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import msgspec

from miles_async.actors.rollout import SamplingConfig
from miles_async.engine.core import EngineConfig
from miles_async.policies.buffer import BufferConfig
from miles_async.rl import AdvantageConfig, PolicyLossConfig
from miles_async.tasks.calculator import CalculatorTaskConfig
from miles_async.tasks.reverse import ReverseTaskConfig

MODES = {"sync": 0, "one_step_off": 1}


class ModelSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    path: str = ""  # a Hugging Face folder; "" makes one with init_model under the run folder
    family: str = "qwen3"
    preset: str = "tiny"
    seed: int = 0


class TaskSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: Literal["reverse", "calculator"] = "reverse"  # calculator is multi-turn: it needs [agent]
    reverse: ReverseTaskConfig = ReverseTaskConfig()
    calculator: CalculatorTaskConfig = CalculatorTaskConfig()
    num_prompts: int = 20000  # the training set (positions cycle when the run outlasts it)
    reward: str = "miles_async.tasks.reverse:reward"


class AgentSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Multi-turn rollouts: each sample is an episode of `agent` in `environment` (dotted paths),
    talking to the policy through the run's TITO session server."""

    agent: str = ""  # "" = single-turn generation
    environment: str = ""
    rollout: str = "miles_async.agents.api:run_episode"  # drives one episode (agents.api.RolloutFn)
    sandbox: bool = True  # a LocalSandbox per episode for the environment's tools


class SFTSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_steps: int = 300  # 0 skips the warm start
    batch_size: int = 32
    lr: float = 1e-3
    target_accuracy: float = 0.15  # sampled (temperature 1) accuracy on the probe set that ends it
    probe_every: int = 10
    num_probe: int = 64


class RolloutSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    num_engines: int = 1
    num_workers: int = 1
    # How workers reach embedded engines: "actor" (a message to the EngineActor's mailbox) or
    # "http" (SGLang's HTTP API, as for a real SGLang server).
    client: Literal["actor", "http"] = "actor"
    group_size: int = 8
    target_in_flight: int = 64
    max_in_flight_per_engine: int | None = None
    partial: Literal["continue", "abort_retry"] = "continue"  # requests in flight across a weight update
    # When a finished sample's slot is refilled: "sample" at once, "group" once its whole group is done.
    refill: Literal["sample", "group"] = "sample"
    sampling: SamplingConfig = SamplingConfig()
    engine: EngineConfig = EngineConfig(kv_cache_mib=16, max_seq_len=64)
    engine_threads: int = 1
    # Give every sample its own sampling seed (from loop.seed and prompt, index, attempt), so a run
    # samples the same whatever the completion order; costs the engine ~10% (a generator per row).
    seeded: bool = False


class LoopSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    mode: Literal["sync", "one_step_off", "async"] = "async"
    max_staleness: int = 2  # used by mode "async" (sync is 0, one_step_off is 1)
    num_steps: int = 100
    batch_groups: int = 8
    checkpoint_every: int = 0  # 0: only at the end (and on Ctrl-C)
    seed: int = 0

    @property
    def staleness(self) -> int:
        return MODES.get(self.mode, self.max_staleness)


class TrainerSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    lr: float = 1e-4
    micro_batch_tokens: int = 2048
    num_threads: int = 1
    world_size: int = 1
    grad_clip: float = 1.0
    policy_loss: PolicyLossConfig = PolicyLossConfig()
    advantage: AdvantageConfig = AdvantageConfig()
    old_logprobs: Literal["trainer", "rollout"] = "trainer"


class WeightsSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    transport: str = "shm"
    bucket_mib: float = 64.0
    verify: str = "first"
    double_buffer: bool = True


class EvalSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    mode: Literal["none", "shared", "dedicated", "command"] = "shared"
    every: int = 20
    num_prompts: int = 64
    temperature: float = 0.0
    command: str = ""  # mode "command": run with {checkpoint} replaced; its last stdout line is {"score": x}


class PlacementSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which node runs what, in a multi-node run (`miles-async launch`; `run` is one node: all 0).

    engines: the node rank of each engine, in order (cycled when shorter than rollout.num_engines;
        [] puts every engine on the controller's node, 0).
    trainer: the node of every trainer rank (one number), or of each rank in order (a list of
        trainer.world_size numbers: ranks spanning nodes). Trainer ranks off node 0 write
        checkpoints and weight exports that node 0 reads: the run folder must be on a filesystem
        those nodes share (checked when the ranks start).
    scheduler, buffer, sessions: the node of the refill scheduler, of the buffer and of the TITO
        session server (agent runs); each a process of its own off node 0, in the controller's
        process on node 0.
    The controller, rollout workers and weight pusher run on node 0.
    """

    engines: list[int] = []
    trainer: int | list[int] = 0
    scheduler: int = 0
    buffer: int = 0
    sessions: int = 0

    def __post_init__(self) -> None:
        trainer = self.trainer if isinstance(self.trainer, list) else [self.trainer]
        if any(n < 0 for n in (*self.engines, *trainer, self.scheduler, self.buffer, self.sessions)) or not trainer:
            raise ValueError(f"placement node ranks must be >= 0, got engines={self.engines} trainer={self.trainer} "
                             f"scheduler={self.scheduler} buffer={self.buffer} sessions={self.sessions}")

    def engine_node(self, index: int) -> int:
        return self.engines[index % len(self.engines)] if self.engines else 0

    def trainer_nodes(self, world_size: int) -> list[int]:
        """The node of each trainer rank."""
        if isinstance(self.trainer, int):
            return [self.trainer] * world_size
        if len(self.trainer) != world_size:
            raise ValueError(f"placement.trainer lists {len(self.trainer)} node(s) but trainer.world_size is "
                             f"{world_size}: give one node per rank, or one number for all")
        return list(self.trainer)

    @property
    def nodes(self) -> set[int]:
        trainer = self.trainer if isinstance(self.trainer, list) else [self.trainer]
        return {0, *trainer, *self.engines, self.scheduler, self.buffer, self.sessions}


class RunConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: ModelSection = ModelSection()
    task: TaskSection = TaskSection()
    agent: AgentSection = AgentSection()
    sft: SFTSection = SFTSection()
    rollout: RolloutSection = RolloutSection()
    buffer: BufferConfig = BufferConfig()
    loop: LoopSection = LoopSection()
    trainer: TrainerSection = TrainerSection()
    weights: WeightsSection = WeightsSection()
    eval: EvalSection = EvalSection()
    placement: PlacementSection = PlacementSection()

    def __post_init__(self) -> None:
        if self.loop.num_steps < 0 or self.loop.batch_groups < 1:
            raise ValueError(f"loop.num_steps must be >= 0 and loop.batch_groups >= 1, got {self.loop.num_steps} "
                             f"and {self.loop.batch_groups}")
        if self.rollout.num_engines < 1 or self.rollout.num_workers < 1:
            raise ValueError("rollout.num_engines and rollout.num_workers must be >= 1")
        if self.buffer.capacity_groups < self.loop.batch_groups:
            raise ValueError(f"buffer.capacity_groups ({self.buffer.capacity_groups}) must hold a batch "
                             f"(loop.batch_groups = {self.loop.batch_groups})")
        if (self.task.name == "calculator") != bool(self.agent.agent):
            raise ValueError("task.name = \"calculator\" is multi-turn: it goes with [agent] agent and environment "
                             "(e.g. miles_async.tasks.calculator:agent and :CalculatorEnv), and only it does")
        if self.agent.agent and not self.agent.environment:
            raise ValueError("[agent] agent needs [agent] environment (a dotted path)")
        remote_engines = any(n != 0 for n in self.placement.engines)
        if remote_engines and self.weights.transport in ("shm", "colocated"):
            raise ValueError(f"weights.transport = {self.weights.transport!r} needs the engines on the controller's node; "
                             "with placement.engines on other nodes use \"stream\" (authenticated), \"broadcast\" or "
                             "\"disk_delta\" (a shared filesystem)")
        self.placement.trainer_nodes(self.trainer.world_size)  # one node per rank, when listed
        if self.eval.mode == "command" and not self.eval.command:
            raise ValueError('eval.mode = "command" needs eval.command (with {checkpoint} where the folder goes)')


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
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


def _check_keys(tree: dict[str, Any], cls: type, where: str) -> None:
    """Unknown keys fail by their path (msgspec checks only structs marked forbid_unknown_fields)."""
    fields = {f.encode_name: f for f in msgspec.structs.fields(cls)}
    for key, value in tree.items():
        field = fields.get(key)
        if field is None:
            raise ValueError(f"unknown key {where}{key!r}; {cls.__name__} has: {', '.join(fields)}")
        kind = field.type
        if isinstance(value, dict) and isinstance(kind, type) and issubclass(kind, msgspec.Struct):
            _check_keys(value, kind, f"{where}{key}.")


def load_recipe(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read a recipe (None: all defaults) and apply overrides; ValueError naming the bad key."""
    tree: dict[str, Any] = {}
    if path is not None:
        try:
            tree = msgspec.toml.decode(Path(path).read_text())
        except FileNotFoundError as e:
            raise ValueError(f"recipe {path} does not exist") from e
        except msgspec.DecodeError as e:
            raise ValueError(f"recipe {path} is not valid TOML: {e}") from e
    for text in overrides:
        _set(tree, *parse_override(text))
    _check_keys(tree, RunConfig, "")
    try:
        return msgspec.convert(tree, RunConfig)
    except msgspec.ValidationError as e:
        raise ValueError(f"recipe {path or '(defaults)'}: {e}") from e


def dump_recipe(config: RunConfig) -> dict[str, Any]:
    return msgspec.to_builtins(config)
