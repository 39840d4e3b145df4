"""Online training of the draft head (trainer.draft, trainer/loss.py, models/draft.py), on one
trainer rank in this process: the head learns from the step's own samples, the policy's update is
the same as without it, "frozen" trains it only in SFT, and its weights are exported with the policy's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_trainer_step import sample, step

from miles_async.models import init_model
from miles_async.trainer.config import TrainerConfig
from miles_async.trainer.fsdp import single_process_group
from miles_async.trainer.step import Trainer
from miles_async.trajectory import Trajectory

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, torch.device]]:
    folder = init_model("qwen3", "tiny", tmp_path_factory.mktemp("model") / "tiny")
    with single_process_group("gloo", timeout_s=30) as device:
        yield folder, device


def samples() -> list[Trajectory]:
    """Two groups of four sharing their prompt (the trainer packs the prompt once per group)."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 250, (6,), generator=gen).tolist() for _ in range(2)]
    return [sample(prompt + torch.randint(1, 250, (8 + i,), generator=gen).tolist(), [0] * 6 + [1] * (8 + i),
                   [-5.0] * (14 + i), reward=float(i % 2), prompt_id=p) for p, prompt in enumerate(prompts)
            for i in range(4)]


def policy_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: t for name, t in trainer.full_state().items() if not name.startswith("mtp.")}


def test_online_draft_learns_and_leaves_the_policys_update_alone(setup: tuple[Path, torch.device],
                                                                 tmp_path: Path) -> None:
    folder, device = setup
    runs = {}
    for draft in ("none", "online"):
        trainer = Trainer(TrainerConfig(model_dir=str(folder), lr=1e-2, micro_batch_tokens=64, draft=draft), device)
        head_before = {n: t.clone() for n, t in trainer.full_state().items() if n.startswith("mtp.")}
        metrics = [step(trainer, samples(), advantage=None) for _ in range(4)]
        runs[draft] = (trainer, metrics, head_before)
    (plain, plain_metrics, _), (online, online_metrics, head_before) = runs["none"], runs["online"]
    # the policy: the same losses and the same weights, bit for bit (the head's term and its
    # gradient clipping are its own)
    assert [m.loss for m in plain_metrics] == [m.loss for m in online_metrics]
    assert [m.grad_norm for m in plain_metrics] == [m.grad_norm for m in online_metrics]
    for name, tensor in policy_state(plain).items():
        assert torch.equal(tensor, policy_state(online)[name]), name
    # the head: trained on the drafted positions (each trained token after a trained token)
    assert plain_metrics[0].draft_ce == 0.0 and not head_before.keys() & set(plain.full_state())
    assert online_metrics[0].draft_ce > online_metrics[-1].draft_ce > 0
    assert online_metrics[0].draft_loss > 0
    after = online.full_state()
    assert set(head_before) == {n for n in after if n.startswith("mtp.")} and len(head_before) == 8
    assert any(not torch.equal(head_before[n], after[n]) for n in head_before)
    # exported with the policy's weights (what the pusher sends to speculating engines)
    buckets = online.export_weights(tmp_path / "weights", 1 << 20)
    names = {n for b in buckets for n in load_file(b.path)}
    assert {n for n in head_before} <= names


def test_a_frozen_draft_trains_in_sft_only(setup: tuple[Path, torch.device]) -> None:
    folder, device = setup
    trainer = Trainer(TrainerConfig(model_dir=str(folder), lr=1e-2, micro_batch_tokens=64, draft="frozen"), device)

    def head() -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in trainer.full_state().items() if n.startswith("mtp.")}

    start = head()
    rl = step(trainer, samples(), advantage=None)
    assert rl.draft_ce == 0.0 and all(torch.equal(start[n], t) for n, t in head().items())
    sft = trainer.train_step(samples(), [0.0] * 8, num_micro_batches=4, denominator=60.0, objective="sft")
    assert sft.draft_ce > 0 and any(not torch.equal(start[n], t) for n, t in head().items())


def test_draft_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="draft must be"):
        TrainerConfig(draft="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="draft_coef"):
        TrainerConfig(draft="online", draft_coef=0.0)
