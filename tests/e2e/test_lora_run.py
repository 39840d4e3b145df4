"""LoRA RL in the loop: the pushes move the adapters alone (over each transport an embedded engine
takes), the engines serve them merged, and the run's model folder is a plain model with them merged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _support_run import SHORT, run_cli

from miles_async.models import load_pretrained
from miles_async.observe import UpdateTrace, decode_trace

pytestmark = pytest.mark.slow
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "reverse.toml"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["shm", "broadcast", "disk_delta", "stream"])
def test_a_lora_run_pushes_adapters_only_and_ends_in_a_merged_model(tmp_path: Path, transport: str) -> None:
    out = tmp_path / "run"
    proc = run_cli(["run", str(RECIPE), "--out", str(out), "--quiet", *SHORT, "loop.num_steps=4", "eval.mode=none",
                    "trainer.lora.rank=8", "trainer.lora.alpha=16", "trainer.lr=1e-3", f'weights.transport="{transport}"'])
    assert proc.returncode == 0, proc.stderr[-3000:]
    base = load_pretrained(out / "model")
    full_bytes = sum(p.numel() * p.element_size() for p in base.state_dict().values()) - \
        base.lm_head.weight.numel() * 4 * int(base.config.tie_word_embeddings)
    rank, layers = 8, base.config.num_hidden_layers
    adapter_bytes = 0
    for name, module in base.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in (
                "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            adapter_bytes += 4 * rank * (module.in_features + module.out_features)
    assert layers > 0 and adapter_bytes < full_bytes / 6  # rank 8 on the tiny model: 15% of a full push
    updates = [r for r in decode_trace(out / "trace.jsonl") if isinstance(r, UpdateTrace) and r.target == "rollout"]
    assert updates and all(u.num_bytes == adapter_bytes for u in updates if u.transport != "disk_delta"), \
        [(u.transport, u.num_bytes, adapter_bytes) for u in updates]
    assert all(u.num_bytes <= adapter_bytes for u in updates)
    final = load_pretrained(out / "final_model")  # a plain model: no adapter tensors
    changed = [n for n, p in final.state_dict().items() if not torch.equal(p, base.state_dict()[n])]
    assert changed and all(n.endswith("_proj.weight") for n in changed)  # only the adapted projections moved
