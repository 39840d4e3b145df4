"""Low-rank adapters (LoRA) on the attention and MLP projections of every model family.

    y = x W^T + b + scale * (x A^T) B^T        A: [rank, in], B: [out, rank], scale = alpha / rank

`add_lora(model, config)` gives each targeted `Linear` (by its attribute name: q_proj, k_proj,
v_proj, o_proj, gate_proj, up_proj, down_proj by default; a MoE model's experts are MLPs and get
them too) two new parameters, `lora_A` (PEFT's Kaiming-uniform init) and `lora_B` (zeros, so the
adapted model starts as the base), and freezes every other parameter: the optimizer then holds
state for the adapters only. Names follow the module: `model.layers.0.self_attn.q_proj.lora_A`;
`peft_names` maps them to PEFT's saved-adapter names (`base_model.model.<module>.lora_A.weight`).

Two ways to run an adapted layer, chosen per model:
- unmerged (the trainer's default): the formula above as PEFT computes it (`F.linear` of
  `F.linear(x, A)` by B, times scale, added to the base output), gradients to A and B only;
- merged (`merge_lora`: the engine, and the trainer in batch-invariant mode): the layer's weight
  is W0 + scale * (B A), computed by `lora_delta`. The engine keeps a copy of the base W0 and
  merges again after every adapter update, so its fast paths (prepacked and stacked weights) run
  one matmul per layer as without adapters; the trainer in batch-invariant mode computes the same
  merged weight inside its forward (with gradient), so both sides run the same weight through the
  same kernels and their log-probs agree bit for bit.

Try it: `model = load_pretrained(folder); add_lora(model, LoraConfig(rank=8))`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import msgspec
import torch
from torch import nn

from miles_async.kernels import batch_invariant

__all__ = ["DEFAULT_TARGETS", "LoraConfig", "adapted", "add_lora", "lora_delta", "lora_state", "merge_lora",
           "merged_state", "peft_names", "write_peft_adapter"]

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The trainer's `[trainer.lora]`: rank 0 trains every weight (no adapters)."""

    rank: int = 0  # the adapters' rank; > 0 freezes the base and trains adapters on `targets` alone
    alpha: float = 16.0  # scale = alpha / rank (PEFT's lora_alpha)
    targets: tuple[str, ...] = DEFAULT_TARGETS  # the projections' attribute names

    def __post_init__(self) -> None:
        if self.rank < 0 or not self.alpha > 0:
            raise ValueError(f"lora.rank must be >= 0 and lora.alpha > 0, got {self.rank} and {self.alpha}")
        if self.rank and not self.targets:
            raise ValueError("lora.targets is empty: name the projections to adapt (e.g. q_proj, v_proj)")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank if self.rank else 0.0


def adapted(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    """(module name, layer) of every adapted layer, in module order."""
    for name, module in model.named_modules():
        if getattr(module, "lora_rank", 0):
            yield name, module  # type: ignore[misc]


def add_lora(model: nn.Module, config: LoraConfig, *, generator: torch.Generator | None = None) -> list[str]:
    """Adapt the targeted linear layers and freeze everything else (module docstring); the adapted
    modules' names. ValueError when no layer matches `config.targets`."""
    if not config.enabled:
        raise ValueError("add_lora needs lora.rank > 0")
    names = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in config.targets:
            names.append(name)
    if not names:
        raise ValueError(f"no linear layer is named one of lora.targets {list(config.targets)}")
    for param in model.parameters():
        param.requires_grad_(False)
    modules = dict(model.named_modules())
    for name in names:
        layer = modules[name]
        weight = layer.weight
        a = torch.empty(config.rank, layer.in_features, dtype=weight.dtype, device=weight.device)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)  # as PEFT's init_lora_weights=True
        layer.lora_A = nn.Parameter(a)
        layer.lora_B = nn.Parameter(torch.zeros(layer.out_features, config.rank, dtype=weight.dtype,
                                                device=weight.device))
        layer.lora_rank = config.rank
        layer.lora_scale = config.scale
        layer.lora_base = None  # the base weight kept by merge_lora (the engine's)
    return names


def lora_delta(lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float) -> torch.Tensor:
    """scale * (B A), the change an adapter makes to its layer's weight: one batch-invariant matmul
    (fixed row tiles), so the trainer's merged forward and the engine's merge agree bit for bit."""
    return batch_invariant.linear(lora_B, lora_A.t()) * scale


def merge_lora(model: nn.Module) -> int:
    """Set every adapted layer's weight to base + `lora_delta` (the first call keeps a copy of the
    base) and run the layers from that weight alone; the number of layers merged. Call again after
    the adapters change (the engine does, after each update)."""
    count = 0
    with torch.no_grad():
        for _, layer in adapted(model):
            if layer.lora_base is None:
                layer.lora_base = layer.weight.detach().clone()
            layer.weight.copy_(layer.lora_base + lora_delta(layer.lora_A, layer.lora_B, layer.lora_scale))
            count += 1
    return count


def lora_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors by parameter name (what an adapter-only update moves)."""
    return {name: param for name, param in model.named_parameters() if name.endswith((".lora_A", ".lora_B"))}


def merged_state(named: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """Full weights from `named` (base weights plus `<module>.lora_A` / `.lora_B` pairs): each
    adapted `<module>.weight` merged, the adapter tensors left out (a plain Hugging Face model)."""
    out = {name: t for name, t in named.items() if not name.endswith((".lora_A", ".lora_B"))}
    for name, a in named.items():
        if name.endswith(".lora_A"):
            module = name[:-len(".lora_A")]
            base = out[f"{module}.weight"]
            out[f"{module}.weight"] = base + lora_delta(a, named[f"{module}.lora_B"], scale).to(base.dtype)
    return out


def peft_names(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adapter tensors under PEFT's saved names (`base_model.model.<module>.lora_A.weight`), what
    `PeftModel.from_pretrained`, SGLang's `load_lora_adapter` and vLLM's LoRA loading read."""
    return {f"base_model.model.{name}.weight": t for name, t in named.items() if name.endswith((".lora_A", ".lora_B"))}


def write_peft_adapter(folder: str | Path, named: dict[str, torch.Tensor], config: LoraConfig) -> Path:
    """A PEFT adapter folder (adapter_config.json, adapter_model.safetensors) from the adapter
    tensors `named` (our names): what `PeftModel.from_pretrained`, vLLM's `/v1/load_lora_adapter`
    and SGLang's `/load_lora_adapter` read. Written to a temporary name, then renamed into place."""
    from safetensors.torch import save_file

    folder = Path(folder)
    tmp = folder.with_name(f".tmp-{folder.name}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in peft_names(named).items()}, str(tmp / "adapter_model.safetensors"))
    modules = sorted({name.rsplit(".", 2)[-2] for name in named if name.endswith(".lora_A")})
    (tmp / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": config.rank, "lora_alpha": config.alpha,
        "target_modules": modules, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "init_lora_weights": True}, indent=1))
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder
