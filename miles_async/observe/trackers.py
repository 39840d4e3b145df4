"""Experiment trackers the metrics rows fan out to: Weights & Biases and TensorBoard.

    MetricsLog.log(row) ──► metrics.jsonl
                       └──► each Tracker.log(row)            wandb.log / SummaryWriter.add_scalar
    MetricsLog.log_samples(step, samples) ──► samples.jsonl
                       └──► each Tracker.log_samples(...)    a wandb.Table / TensorBoard text

Both are asked for in the recipe's `[observe]` (`observe.config.ObserveConfig`) and opened by
`open_trackers`; the metric names are the same as in metrics.jsonl (`observe.names`).

wandb (`pip install 'miles-async[wandb]'`): `wandb.init` with the project, name, entity and tags,
the resolved recipe as the run's config, and its files under RUN_DIR/wandb/. The run id is kept
in RUN_DIR/wandb_run_id, so `--resume` continues the same wandb run; the metrics are plotted
against our `step` (wandb's own step only counts calls), so the steps a resume runs again show up
again rather than being refused. `WANDB_MODE=offline` logs with no network (`wandb sync` uploads
later); the key comes from WANDB_API_KEY or `wandb login`, never from the recipe, and is never
logged.

TensorBoard (`pip install 'miles-async[tensorboard]'`): scalars and the samples' text under
RUN_DIR/tensorboard/. A resumed run's writer purges the steps it runs again (`purge_step`), so
TensorBoard shows each step once. Without the package it says so once, at INFO, and the run goes
on with metrics.jsonl.

wandb and torch are imported here lazily, only when a tracker opens.
"""

from __future__ import annotations

import logging
import netrc
import os
import re
import secrets
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from miles_async.observe.config import ObserveConfig
from miles_async.observe.samples import SAMPLE_COLUMNS, SampleText

__all__ = ["WANDB_ID_FILE", "TensorBoardTracker", "Tracker", "TrackerError", "WandbTracker", "check_trackers",
           "open_trackers"]

log = logging.getLogger("miles_async.observe")

WANDB_ID_FILE = "wandb_run_id"
SAMPLES_KEY = "rollout/samples"  # the samples' table (wandb) and text (TensorBoard)
_SECRET = re.compile(r"(api_?key|token|secret|password)$", re.IGNORECASE)


class TrackerError(RuntimeError):
    """A tracker asked for could not start (wandb without a key or a network, ...): the message says
    what to do."""


class Tracker(Protocol):
    """Where metrics rows go besides metrics.jsonl."""

    def log(self, row: dict[str, Any]) -> None:
        """One metrics row; `row["step"]` is its x (a row has one unless a test writes otherwise)."""

    def log_samples(self, step: int, samples: Sequence[SampleText]) -> None:
        """The decoded samples of step `step`."""

    def close(self) -> None:
        """Flush and let go; safe to call twice."""


def _numbers(row: dict[str, Any]) -> dict[str, float]:
    return {key: value for key, value in row.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}


def _redacted(tree: Any) -> Any:
    """The recipe with values under key-like names blanked: a tracker's config leaves the machine."""
    if isinstance(tree, dict):
        return {k: "(redacted)" if _SECRET.search(str(k)) and v else _redacted(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_redacted(v) for v in tree]
    return tree


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError as e:
        raise ValueError(f"observe.wandb = true needs the wandb package ({e}): "
                         "pip install 'miles-async[wandb]'") from e
    return wandb


def check_trackers(config: ObserveConfig) -> None:
    """What can be known of the trackers `[observe]` asks for before a run folder exists (the
    pre-flight): wandb importable, and, unless it logs offline, a key to log with (WANDB_API_KEY or
    `wandb login`'s netrc entry; its value is never read out). ValueError naming the fix."""
    if not config.wandb:
        return
    _import_wandb()
    mode = os.environ.get("WANDB_MODE", "").lower()
    if mode in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return
    host = urllib.parse.urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or ""
    try:
        logged_in = netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):  # no netrc file (the usual case), or one wandb cannot read either
        logged_in = False
    if not logged_in:
        raise ValueError(f"observe.wandb = true, but no wandb key is set for {host}: set WANDB_API_KEY (or run "
                         "`wandb login`), set WANDB_MODE=offline to log with no network (then `wandb sync`), or "
                         "observe.wandb = false")


class WandbTracker:
    """A wandb run (module docstring); `resume`: continue the run whose id RUN_DIR holds."""

    def __init__(self, config: ObserveConfig, run_dir: str | Path, *, recipe: dict[str, Any],
                 resume: bool = False) -> None:
        wandb = self._wandb = _import_wandb()
        run_dir = Path(run_dir)
        id_file = run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else ""
        if not run_id:
            run_id = secrets.token_hex(6)  # wandb's ids: lowercase letters and digits
            run_dir.mkdir(parents=True, exist_ok=True)
            id_file.write_text(run_id + "\n")
        try:
            self.run = wandb.init(project=config.wandb_project, entity=config.wandb_entity or None,
                                  name=config.wandb_name or run_dir.name, tags=list(config.wandb_tags),
                                  config=_redacted(recipe), dir=str(run_dir), id=run_id, resume="allow")
        except wandb.errors.Error as e:
            raise TrackerError(f"wandb could not start a run ({type(e).__name__}: {e}); set WANDB_MODE=offline to "
                               "log with no network (then `wandb sync`), or observe.wandb = false") from e
        # Plot against our step: wandb's own counts log calls, and refuses a step it has passed.
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        log.info("wandb run %s, its files in %s", run_id, self.run.dir)

    def log(self, row: dict[str, Any]) -> None:
        self.run.log(_numbers(row))

    def log_samples(self, step: int, samples: Sequence[SampleText]) -> None:
        table = self._wandb.Table(columns=list(SAMPLE_COLUMNS))
        for s in samples:
            cells = [getattr(s, name) for name in SAMPLE_COLUMNS]
            table.add_data(*(", ".join(map(str, c)) if isinstance(c, list) else c for c in cells))
        self.run.log({"step": step, SAMPLES_KEY: table})

    def close(self) -> None:
        run, self.run = self.run, None
        if run is not None:
            run.finish()


_tensorboard_missing_said = False


def _summary_writer() -> Any | None:
    """torch's SummaryWriter class, or None (said once per process, at INFO) without tensorboard."""
    global _tensorboard_missing_said
    try:
        import tensorboard  # noqa: F401 - torch.utils.tensorboard needs it; the message names it
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        if not _tensorboard_missing_said:
            _tensorboard_missing_said = True
            log.info("observe.tensorboard = true, but TensorBoard cannot be used (%s): pip install "
                     "'miles-async[tensorboard]'; the metrics go to metrics.jsonl only", e)
        return None
    return SummaryWriter


class TensorBoardTracker:
    """Scalars and the samples' text in `log_dir`; `purge_step`: the first step this writer writes
    (TensorBoard hides what earlier writers wrote from it on)."""

    def __init__(self, writer_class: Any, log_dir: str | Path, *, purge_step: int = 0) -> None:
        self.writer = writer_class(log_dir=str(log_dir), purge_step=purge_step)

    def log(self, row: dict[str, Any]) -> None:
        step = row.get("step")
        for key, value in _numbers(row).items():
            if key != "step":
                self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()  # one row per step: cheap, and a crash loses nothing written

    def log_samples(self, step: int, samples: Sequence[SampleText]) -> None:
        blocks = [f"**prompt {s.prompt_id} #{s.index}**: reward {s.reward:g}, versions {s.versions}, "
                  f"{s.finish_reason}\n\n```\n{s.prompt}\n```\n\n```\n{s.completion}\n```" for s in samples]
        self.writer.add_text(SAMPLES_KEY, "\n\n---\n\n".join(blocks), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.close()


def open_trackers(config: ObserveConfig, run_dir: str | Path, *, recipe: dict[str, Any],
                  resume_step: int | None = None) -> list[Tracker]:
    """The trackers `[observe]` asks for, open. `recipe`: the resolved recipe (wandb's config);
    `resume_step`: for a resumed run, the last step kept (the next rows start after it; 0: the
    run starts over), None for a new run."""
    run_dir = Path(run_dir)
    trackers: list[Tracker] = []
    if config.tensorboard:
        writer_class = _summary_writer()
        if writer_class is not None:
            # Every writer marks its start (a SessionLog START at purge_step): TensorBoard takes the
            # first as the run's start and each later one as a restart, hiding the steps from it on.
            purge = resume_step + 1 if resume_step else 0
            trackers.append(TensorBoardTracker(writer_class, run_dir / "tensorboard", purge_step=purge))
    if config.wandb:
        try:
            trackers.append(WandbTracker(config, run_dir, recipe=recipe, resume=resume_step is not None))
        except BaseException:
            for tracker in trackers:
                tracker.close()
            raise
    return trackers
