"""Load and save Hugging Face checkpoint folders (config.json + safetensors) for `CausalLM`.

A folder holds either `model.safetensors` or shards named by `model.safetensors.index.json`.
Tensor names are Hugging Face's and map one to one onto our modules. Two layouts need care:
- tied embeddings: `lm_head.weight` is absent (or a copy of the embedding) and is ignored;
- Qwen3-MoE experts: `save_pretrained` writes one tensor per expert
  (`mlp.experts.N.{gate,up,down}_proj.weight`), which is our layout; a fused layout
  (`mlp.experts.gate_up_proj` [E, 2F, D] and `mlp.experts.down_proj` [E, D, F], transformers 5's
  in-memory form) is split into per-expert tensors on load.
A draft head (`mtp.*`, models/draft.py) in the checkpoint is loaded with the model.
Anything else that is missing or left over is an error that names the tensors.

The model is built on the meta device and the loaded tensors are assigned in, so loading costs
one copy of the weights, not two, and no time on random initialisation. That one copy is made
even when no cast is needed: the model gets aligned memory of its own, not views of the file's
mmap (`read_state_dict` says why).

Tensor names (STYLE rule 10): E experts, F expert MLP width, D hidden.

Try it: `model = load_pretrained("DIR"); model(torch.tensor([[1, 2, 3]]))`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from miles_async.models.config import ModelConfig
from miles_async.models.draft import has_draft
from miles_async.models.transformer import CausalLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
# Older Llama checkpoints stored RoPE's frequencies; they are recomputed from the config.
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint folder, single-file or sharded."""
    folder = Path(path)
    if (folder / INDEX_FILE).is_file():
        weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    raise ValueError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}: not a safetensors checkpoint")


def read_state_dict(path: str | Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint (floating ones cast to `dtype`), fused experts split."""
    tensors: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                # A copy, always: get_tensor returns a view of the file's mmap at 8 + header + offset
                # bytes, often not 16-byte aligned, and MKL's one-row matmul (an expert with one
                # token) sums in another order for such weights, so a loaded model would not be
                # bit for bit the saved one. A fresh tensor is 64-byte aligned and owns its memory.
                tensor = handle.get_tensor(name)
                wanted = dtype if tensor.is_floating_point() else tensor.dtype
                tensors[name] = tensor.to(wanted, copy=True)
    return split_fused_experts(tensors)


def split_fused_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rewrite fused expert tensors into one tensor per expert (no-op for per-expert layouts)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        match = _FUSED_EXPERTS.match(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, kind = match.groups()
        for expert, weight in enumerate(tensor.unbind(0)):
            if kind == "down_proj":  # weight_DF
                out[f"{prefix}.{expert}.down_proj.weight"] = weight.contiguous()
            else:  # weight_2FD: gate rows first, then up rows
                gate_FD, up_FD = weight.chunk(2, dim=0)
                out[f"{prefix}.{expert}.gate_proj.weight"] = gate_FD.contiguous()
                out[f"{prefix}.{expert}.up_proj.weight"] = up_FD.contiguous()
    return out


def load_pretrained(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> CausalLM:
    """Build the model a Hugging Face folder describes and load its weights (eval mode)."""
    config = ModelConfig.from_hf(path)
    tensors = read_state_dict(path, dtype)
    with torch.device("meta"):
        model = CausalLM(config)
        if has_draft(tensors):  # a draft head trained with the model (models/draft.py)
            model.add_draft_head()
    shapes = {name: t.shape for name, t in model.state_dict().items()}
    expected = set(shapes)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    missing = sorted(expected - tensors.keys())
    unexpected = sorted(name for name in tensors.keys() - expected if not _IGNORED.search(name))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match its config ({config.family}): "
            f"missing {_few(missing)}; unexpected {_few(unexpected)}"
        )
    for name in sorted(expected):
        wanted = shapes[name]
        if tensors[name].shape != wanted:
            raise ValueError(
                f"checkpoint {path}: {name} has shape {tuple(tensors[name].shape)}, the config says "
                f"{tuple(wanted)}"
            )
    model.load_state_dict({name: tensors[name] for name in expected}, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight  # assign=True replaced the shared one
    return model.to(device).eval()


def save_pretrained(model: CausalLM, out_dir: str | Path, extra_config: dict | None = None) -> Path:
    """Write config.json and model.safetensors (tied models omit lm_head.weight, as transformers does).

    `extra_config` adds keys to config.json (token ids, for instance).
    """
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    hf_config = {**model.config.to_hf(), **(extra_config or {})}
    hf_config["torch_dtype"] = str(model.lm_head.weight.dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    tensors = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight")
    save_file(tensors, str(folder / SINGLE_FILE), metadata={"format": "pt"})
    return folder


def _few(names: list[str], limit: int = 5) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
