"""The run trace: what happened, when, on which engine, at which weight version.

`RUN_DIR/trace.jsonl` holds one JSON object per line, each tagged by its `kind` field. It is the
input of the simulator (`miles_async/sim/`): replaying a real run's timings against the real policies on a
virtual clock is how a scheduling change is judged before it is run. So the schema is a
contract: new fields are appended with defaults, fields are never renamed or retyped.

The first record of a run (and of each resumed run, which appends to the same file and whose
clock starts again at 0) is its header, kind = "run", carrying the schema version and the
settings the simulator replays with.

Times are seconds since the run started (the controller's clock at launch), as floats; a
duration is the difference of two of them unless it has its own `_s` field.

kind = "run" (`RunTrace`): the header, the first record a process writes.
    schema          int    the trace schema version (`TRACE_SCHEMA`); a reader refuses others
    start_s         s      when it was written (about 0: the process's clock starts at launch)
    source          str    "run" (recorded) or "synthetic" (made by the simulator's generator)
    num_engines, trainer_world_size, mode, max_staleness, group_size, batch_groups,
    target_in_flight, max_in_flight_per_engine, refill, partial, capacity_groups, filter,
    on_stale, on_abort, eval_mode, eval_every, num_steps, transport
                           the run's settings, as in the recipe (rollout.*, loop.*, buffer.*, ...)
    teacher_in_flight      distillation: teacher.max_in_flight, the scoring stage's bound; 0: no teacher
    The RL phase starts with the first train step's start_s: records before it (the weight
    updates of an SFT warm start, a resumed run's first push) belong to the warm-up.

kind = "sample" (`SampleTrace`): one attempt at one completion of one prompt.
    prompt_id      int    the prompt's dataset position (the refill scheduler's prompt id)
    index          int    which of the group's completions this is (0 .. n_samples_per_prompt-1)
    attempt        int    0 for the first try; +1 each time the sample is resubmitted after an abort
    engine         str    the engine actor that generated it (its actor name)
    submit_s       s      when the rollout side submitted the request
    end_s          s      when the completion (or its abort) came back
    prompt_tokens  tokens prompt length
    output_tokens  tokens generated length (partial length for an aborted attempt)
    versions       [int]  weight version of each engine call that contributed tokens, in order
                          (more than one entry when generation spanned a weight update)
    reward         float  the reward given; 0.0 when the sample was dropped before scoring
    finish_reason  str    "stop", "length", "abort" as the engine reported it; "error" (the engine
                          failed or was unreachable), "reward_error" (the reward function raised)
    dropped        str    "" when the sample counted (it went into its group); "engine_lost" for a
                          late reply from an engine already declared lost (the sample was reissued).
                          Group-level drops (aborted, filtered, stale) are the metrics' dropped_* keys
    num_turns      int    engine calls of a multi-turn episode (1 for a single generation)
    tool_s         s      time the episode spent outside the engine (tools, environment); 0.0
                          when not measured
    teacher_s      s      distillation: the teacher's scoring request for this sample (it starts
                          after end_s, once a request slot is free); 0.0 without a teacher
    teacher_wait_s s      distillation: the wait for that slot (the stage's queue)

kind = "train_step" (`StepTrace`): one optimiser step of the trainer.
    step            int    1-based optimiser step number
    weight_version  int    the version the weights get after this step
    start_s         s      when the trainer began waiting for this step's batch
    end_s           s      when the step was done (its weight push may still be running: it
                           overlaps the next step; see the weight_update record)
    wait_data_s     s      time blocked on the buffer for a full batch
    train_s         s      forward/backward/optimiser time
    update_s        s      time the trainer spent on the weight update (the export, and waiting
                           for the previous push to finish)
    num_samples     int    samples in the batch
    num_tokens      tokens tokens in the batch (prompt + output)
    staleness_mean  float  mean over the batch of (trainer version - oldest generating version)
    staleness_max   int    maximum of the same
    prompt_ids      list   the dataset positions of the groups trained in the step
    train_end_s     s      when training finished (before the update and the write-down);
                           0.0 in traces from before this field

kind = "weight_update" (`UpdateTrace`): one broadcast of new weights to the engines.
    version    int    the weight version pushed
    start_s    s      when the push began
    end_s      s      when every engine acknowledged the new version
    transport  str    how the weights travelled (actors.weights.TRANSPORTS: "shm", "stream", "disk", ...)
    num_bytes  bytes  bytes sent (per engine, the tensor payload)
    paused_s   s      how long generation was paused for the update (0.0 if it was not)
    target     str    whose engines: "rollout", or "eval" (the dedicated eval engine's own pushes)

kind = "eval" (`EvalTrace`): one evaluation of the current policy.
    step         int    the train step whose weights were evaluated
    score        float  the task's score (its own scale; mean reward for most tasks)
    num_samples  int    samples evaluated
    mode         str    where: "shared" engines, a "dedicated" engine, or an external "command"
    start_s      s      when it began (0.0 in traces from before this field)
    end_s        s      when it ended; while a "shared" eval runs, rollouts and training wait

kind = "engine" (`EngineTrace`): a rollout engine leaving or coming back.
    engine          str    the engine actor's name
    time_s          s      when it happened
    event           str    "serving": it takes rollouts from here on (at the run's start, and when a
                           restarted engine holds the current weights); "lost": its process died
                           (its in-flight samples go to the other engines); "restarted": its process
                           is up again, model loaded, weights not yet current; "gone": dead for good
                           (restart limit reached, restarts off, or its node lost)
    weight_version  int    "serving": the version it serves from; -1 for the other events
    cause           str    "lost", "gone": why (the failure, or the limit reached); "" otherwise
    pid             int    "serving", "restarted": the engine's process; 0 otherwise

Write with `logs.TraceLog`; read back with `decode_trace(path)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

__all__ = ["ENGINE_EVENTS", "TRACE_SCHEMA", "EngineTrace", "EvalTrace", "RunTrace", "SampleTrace", "StepTrace",
           "TraceRecord", "UpdateTrace", "decode_trace"]


TRACE_SCHEMA = 1


class RunTrace(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="run"):
    schema: int
    start_s: float
    source: str = "run"
    num_engines: int
    trainer_world_size: int
    mode: str
    max_staleness: int
    group_size: int
    batch_groups: int
    target_in_flight: int
    max_in_flight_per_engine: int | None = None
    refill: str = "sample"
    partial: str = "continue"
    capacity_groups: int
    filter: str
    on_stale: str
    on_abort: str
    eval_mode: str = "none"
    eval_every: int = 0
    num_steps: int = 0
    transport: str = ""
    teacher_in_flight: int = 0  # distillation: the teacher stage's bound on requests out (0: no teacher)


class SampleTrace(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="sample"):
    prompt_id: int
    index: int
    attempt: int = 0
    engine: str
    submit_s: float
    end_s: float
    prompt_tokens: int
    output_tokens: int
    versions: list[int]
    reward: float = 0.0
    finish_reason: str
    dropped: str = ""
    num_turns: int = 1
    tool_s: float = 0.0
    teacher_s: float = 0.0  # distillation: the teacher's scoring request (after end_s), and its wait for a slot
    teacher_wait_s: float = 0.0
    scored: bool = True  # False: the environment gave no reward (`reward` means nothing)


class StepTrace(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="train_step"):
    step: int
    weight_version: int
    start_s: float
    end_s: float
    wait_data_s: float
    train_s: float
    update_s: float
    num_samples: int
    num_tokens: int
    staleness_mean: float
    staleness_max: int
    prompt_ids: list[int] = []  # the dataset positions of the groups trained
    train_end_s: float = 0.0


class UpdateTrace(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="weight_update"):
    version: int
    start_s: float
    end_s: float
    transport: str
    num_bytes: int
    paused_s: float = 0.0
    target: str = "rollout"


class EvalTrace(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="eval"):
    step: int
    score: float
    num_samples: int
    mode: str
    start_s: float = 0.0
    end_s: float = 0.0


ENGINE_EVENTS = ("serving", "lost", "restarted", "gone")


class EngineTrace(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="engine"):
    engine: str
    time_s: float
    event: str  # one of ENGINE_EVENTS
    weight_version: int = -1
    cause: str = ""
    pid: int = 0


TraceRecord = RunTrace | SampleTrace | StepTrace | UpdateTrace | EvalTrace | EngineTrace

# Built once: the decoder compiles its tagged-union dispatch on construction.
_decoder = msgspec.json.Decoder(TraceRecord)


def decode_jsonl(path: str | Path, decoder: msgspec.json.Decoder, what: str) -> list[Any]:
    """Every line of a JSONL file of `decoder`'s type, in file order; blank lines are skipped.
    ValueError naming the file and line of one that is not `what` (bad JSON, a missing or
    mistyped field)."""
    path = Path(path)
    records: list[Any] = []
    with path.open("rb") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                records.append(decoder.decode(line))
            except msgspec.DecodeError as e:
                raise ValueError(f"{path}:{line_number}: not {what} ({e}); line starts {line[:80]!r}") from e
    return records


def decode_trace(path: str | Path) -> list[TraceRecord]:
    """Every record of a trace.jsonl, in file order; blank lines are skipped.

    Raises ValueError naming the file and line number for a line that is not a valid record
    (bad JSON, unknown `kind`, a missing or mistyped field).
    """
    return decode_jsonl(path, _decoder, "a trace record")
