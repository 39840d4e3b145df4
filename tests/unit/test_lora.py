"""LoRA (models/lora.py) against PEFT's own adapters on the same weights: forward, gradients,
merge and saved names; then the trainer with adapters (only they move, only they have optimizer
state, the export is the adapters) and the merged forward's agreement with the engine's."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from miles_async.models import init_model, load_pretrained
from miles_async.models.lora import (
    DEFAULT_TARGETS,
    LoraConfig,
    add_lora,
    lora_state,
    merge_lora,
    merged_state,
    peft_names,
)

peft = pytest.importorskip("peft", reason="PEFT is the reference: pip install 'miles-async[dev]'")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("lora"), seed=0)


def adapted_pair(folder: Path, family_folder: Path | None = None):
    """Our model with adapters (B made non-zero) and PEFT's adapters injected into a copy of the
    same base, holding the same A and B."""
    ours = load_pretrained(family_folder or folder)
    theirs = copy.deepcopy(ours)
    add_lora(ours, LoraConfig(rank=4, alpha=8.0), generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in lora_state(ours).items():
            if name.endswith("lora_B"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(DEFAULT_TARGETS))
    theirs = peft.inject_adapter_in_model(config, theirs)
    state = {name.removeprefix("base_model.model."): t for name, t in peft_names(lora_state(ours)).items()}
    assert set(state) == set(peft.get_peft_model_state_dict(theirs))  # PEFT's names for the same adapters
    peft.set_peft_model_state_dict(theirs, state)
    return ours, theirs


def forward(model, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens[None], torch.arange(len(tokens))[None])[0]


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe"])
def test_adapters_match_peft_forward_gradients_and_merge(folder: Path, tmp_path: Path, family: str) -> None:
    model_dir = folder if family == "qwen3" else init_model(family, "tiny", tmp_path / family, seed=0)
    ours, theirs = adapted_pair(folder, model_dir)
    tokens = torch.randint(1, 250, (12,), generator=torch.Generator().manual_seed(2))
    out_ours, out_theirs = forward(ours, tokens), forward(theirs, tokens)
    torch.testing.assert_close(out_ours, out_theirs, rtol=0, atol=1e-5)
    out_ours.square().mean().backward()
    out_theirs.square().mean().backward()
    theirs_grads = {n.replace(".default", ""): p.grad for n, p in theirs.named_parameters() if p.requires_grad}
    ours_grads = {f"{n}.weight": p.grad for n, p in ours.named_parameters() if p.requires_grad}
    targets = [n for n, m in ours.named_modules() if isinstance(m, torch.nn.Linear) and n.endswith(DEFAULT_TARGETS)]
    assert set(ours_grads) == set(theirs_grads) and len(ours_grads) == 2 * len(targets) > 0
    for name, grad in ours_grads.items():
        torch.testing.assert_close(grad, theirs_grads[name], rtol=1e-4, atol=1e-7, msg=name)
    # only the adapters train: every base weight is frozen
    assert all(not p.requires_grad for n, p in ours.named_parameters() if not n.endswith(("lora_A", "lora_B")))
    # merged (the engine's way): the same outputs as PEFT's own merge, as the unmerged forward
    with torch.no_grad():
        merged_ours = copy.deepcopy(ours)
        assert merge_lora(merged_ours) == len(ours_grads) // 2
        merged_theirs = copy.deepcopy(theirs)
        for module in merged_theirs.modules():
            if isinstance(module, peft.tuners.lora.LoraLayer):
                module.merge()
        torch.testing.assert_close(forward(merged_ours, tokens), forward(merged_theirs, tokens), rtol=0, atol=1e-5)
        torch.testing.assert_close(forward(merged_ours, tokens), out_ours.detach(), rtol=0, atol=1e-5)
        # merged_state: a plain model's weights (no adapter tensors), loading into a fresh model
        full = merged_state({n: p.detach() for n, p in ours.named_parameters()}, 2.0)
        plain = load_pretrained(model_dir)
        plain.load_state_dict(full, strict=False)
        assert not any(n.endswith(("lora_A", "lora_B")) for n in full)
        torch.testing.assert_close(forward(plain, tokens), out_ours.detach(), rtol=0, atol=1e-5)


def test_bad_lora_configs_are_refused(folder: Path) -> None:
    with pytest.raises(ValueError, match="lora.rank must be >= 0"):
        LoraConfig(rank=-1)
    with pytest.raises(ValueError, match="lora.targets is empty"):
        LoraConfig(rank=2, targets=())
    with pytest.raises(ValueError, match="no linear layer is named one of lora.targets"):
        add_lora(load_pretrained(folder), LoraConfig(rank=2, targets=("qkv",)))
    with pytest.raises(ValueError, match="needs lora.rank > 0"):
        add_lora(load_pretrained(folder), LoraConfig())


def test_a_trainer_with_adapters_trains_and_exports_them_alone(folder: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from miles_async.trainer.config import TrainerConfig
    from miles_async.trainer.fsdp import single_process_group
    from miles_async.trainer.packing import plan_step
    from miles_async.trainer.step import Trainer
    from miles_async.trajectory import TokenData, Trajectory

    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 250, (6,), generator=gen).tolist()
    samples = [Trajectory(prompt_id=0, index=i, reward=float(i % 2), num_tokens=10, num_prompt_tokens=6,
                          num_generated_tokens=4,
                          data=TokenData.build(tokens=prompt + torch.randint(1, 250, (4,), generator=gen).tolist(),
                                               loss_mask=[0] * 6 + [1] * 4, logprobs=[0.0] * 6 + [-2.0] * 4))
               for i in range(4)]
    config = TrainerConfig(model_dir=str(folder), lr=1e-2, lora=LoraConfig(rank=4, alpha=8.0))
    with single_process_group("gloo", timeout_s=30):
        trainer = Trainer(config, torch.device("cpu"))
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        plan = plan_step(samples, 1, config.micro_batch_tokens, "token", config.advantage)
        for _ in range(2):  # the first step moves B off zero; the second moves A too
            metrics = trainer.train_step(samples, plan.advantages, num_micro_batches=plan.num_micro_batches,
                                         denominator=plan.denominator)
        assert metrics.grad_norm > 0 and not metrics.skipped
        after = dict(trainer.model.named_parameters())
        adapters = {n for n in after if n.endswith(("lora_A", "lora_B"))}
        assert adapters and all(not torch.equal(before[n], after[n].detach()) for n in adapters)
        assert all(torch.equal(before[n], after[n].detach()) for n in after if n not in adapters)  # the base is frozen
        # Adam's state for the adapters only
        state = trainer.optimizer.state_dict()["state"]
        assert len(state) == len(adapters) == len(trainer.optimizer.param_groups[0]["params"])
        # the push's export: the adapters alone; the model folder's: the base with them merged, no adapter
        pushed = [b for b in trainer.export_weights(tmp_path / "push", 1 << 20)]
        names = [n for b in pushed for n in b.names]
        assert set(names) == adapters
        full_bytes = sum(p.numel() * 4 for n, p in after.items() if n not in adapters)
        assert sum(b.num_bytes for b in pushed) < full_bytes / 10
        merged = {n: t for b in trainer.export_weights(tmp_path / "full", 1 << 20, merged=True)
                  for n, t in load_file(b.path).items()}
        plain = load_pretrained(folder)
        assert set(merged) == set(plain.state_dict()) - {"lm_head.weight"} or set(merged) == set(plain.state_dict())
        expect = merged_state({n: p.detach() for n, p in after.items()}, config.lora.scale)
        for name, tensor in merged.items():
            assert torch.equal(tensor, expect[name]), name
        layer = "model.layers.0.self_attn.q_proj.weight"
        assert not torch.equal(merged[layer], before[layer])


def test_the_peft_folder_is_what_peft_reads(folder: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from miles_async.models.lora import write_peft_adapter

    ours, theirs = adapted_pair(folder)
    named = {n: p.detach() for n, p in lora_state(ours).items()}
    out = write_peft_adapter(tmp_path / "adapter", named, LoraConfig(rank=4, alpha=8.0))
    config = peft.LoraConfig.from_pretrained(str(out))
    assert (config.r, config.lora_alpha, sorted(config.target_modules)) == (4, 8, sorted(DEFAULT_TARGETS))
    stored = load_file(str(out / "adapter_model.safetensors"))
    assert set(stored) == set(peft_names(named))
    fresh = peft.inject_adapter_in_model(config, load_pretrained(folder))
    peft.set_peft_model_state_dict(fresh, {n.removeprefix("base_model.model."): t for n, t in stored.items()})
    tokens = torch.arange(3, 15)
    with torch.no_grad():
        torch.testing.assert_close(forward(fresh, tokens), forward(theirs, tokens), rtol=0, atol=0)
    write_peft_adapter(out, named, LoraConfig(rank=4, alpha=8.0))  # replaced in place
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]


@pytest.mark.parametrize(("overrides", "adapter", "merged_pushes"), [
    ([], "", False),  # no LoRA: whole models, as always
    (["trainer.lora.rank=8"], "", False),  # embedded engines: the adapters, merged there
    (["trainer.lora.rank=8", "rollout.backend=vllm"], "policy-lora", False),  # an external engine's LoRA endpoint
    (["trainer.lora.rank=8", "rollout.backend=vllm", 'rollout.server.lora="merged"'], "", True),
    (["rollout.backend=vllm"], "", True),
])
def test_which_pushes_a_run_makes(overrides: list[str], adapter: str, merged_pushes: bool) -> None:
    from miles_async.actors.controller import Controller
    from miles_async.actors.fleet import Fleet
    from miles_async.actors.recipe import load_recipe

    config = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "reverse.toml", overrides)
    fleet = Fleet(config, None, None, {})  # type: ignore[arg-type] - only the config is read
    assert fleet.adapter == adapter
    controller = Controller.__new__(Controller)  # the push's export is a function of the config and fleet
    controller.config, controller.fleet = config, fleet
    assert controller._push_export().merged == merged_pushes
    assert fleet.engine_config().lora == config.trainer.lora
