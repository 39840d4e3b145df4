"""The layers the policy and its draft head are built of: `Linear`, `RMSNorm` and the SwiGLU `MLP`.

`models/transformer.py` assembles them into the decoder (and sets their switches: batch-invariant,
prepacked, fused CPU kernels, LoRA, quantized formats); `models/draft.py` builds the draft head of
the same ones. They live here, below both, so neither of those imports the other's module for them.
Parameter names are Hugging Face's (`weight`, `bias`, `gate_proj`, `up_proj`, `down_proj`).

Tensor names (STYLE rule 10): x any leading shape with the layer's input width last.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from miles_async.kernels import batch_invariant, cpu_kernels, onednn, quant
from miles_async.models.lora import lora_delta

_DEQUANT_BLOCK_BYTES = 4 << 20  # Linear._dequantizing: the most full-precision weight made at once


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and names) that can run batch-invariant (true on-policy mode),
    or from a prepacked copy of its weight (`kernels.onednn`, the engine's, inference only), with
    a low-rank adapter when `models.lora.add_lora` gave it one (`lora_A`, `lora_B`)."""

    batch_invariant = False  # set per module by CausalLM.set_batch_invariant
    prepacked: torch.Tensor | None = None  # set per module by CausalLM.prepack_weights
    lora_rank = 0  # set per module by add_lora; 0: no adapter
    lora_base: torch.Tensor | None = None  # set by merge_lora: the weight holds base + the adapter's delta
    fake_quant = ""  # set by CausalLM.set_fake_quant: the trainer's quantization-aware format
    # set by CausalLM.hold_quantized: the weight is held only as this format's tensors
    # (weight_packed, weight_scale[, weight_global_scale]: kernels.quant.to_named), of dtype qdtype
    qformat = ""
    qdtype = torch.float32
    served: torch.Tensor | None = None  # set by CausalLM.dequantize_served: the held weight, dequantized

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        matmul = batch_invariant.linear if self.batch_invariant else F.linear
        if self.fake_quant:  # quantization-aware training: the layer as an engine serving the format runs it
            if self.fake_quant == "fp8_block":  # and the backward's matmuls on FP8 values too
                return quant.fp8_linear(x, self.weight, self.bias, matmul=matmul)
            if self.fake_quant in quant.ACTIVATION_FORMATS:
                x = quant.fake_quant(x, self.fake_quant, kind="activation")
            return matmul(x, quant.fake_quant(self.weight, self.fake_quant), self.bias)
        if self.qformat and self.prepacked is None:  # the engine, serving a quantized format
            if self.qformat in quant.ACTIVATION_FORMATS:  # W8A8: the activations quantized per token
                x = quant.dequantize(quant.quantize(x, self.qformat, kind="activation"))
            if self.served is None:
                return self._dequantizing(x)
            return matmul(x, self.served, self.bias)
        if self.lora_rank and self.lora_base is None:  # an adapter, unmerged (the trainer's)
            if self.batch_invariant:  # the merged weight, as the engine serves it (bit for bit), with gradient
                return batch_invariant.linear(x, self.weight + lora_delta(self.lora_A, self.lora_B, self.lora_scale),
                                              self.bias)
            lora = F.linear(F.linear(x, self.lora_A), self.lora_B) * self.lora_scale  # PEFT's order
            return F.linear(x, self.weight, self.bias) + lora
        if self.batch_invariant:
            return batch_invariant.linear(x, self.weight, self.bias)
        if self.prepacked is not None:
            return onednn.linear(x, self.prepacked, self.bias)
        return F.linear(x, self.weight, self.bias)

    def quantized(self) -> quant.QTensor:
        """The weight as held (`CausalLM.hold_quantized`), a view of the module's tensors."""
        return quant.from_named(self.qformat, (self.out_features, self.in_features), self.qdtype,
                                self.weight_packed, self.weight_scale, getattr(self, quant.GLOBAL_SCALE, None))

    def _dequantizing(self, x: torch.Tensor) -> torch.Tensor:
        """The layer from its quantized weight alone: dequantize a block of output rows at a time
        (at most ~4 MiB of them in fp32), so the full-precision weight never exists whole."""
        q = self.quantized()
        step = max(q.block[0], (_DEQUANT_BLOCK_BYTES // (4 * self.in_features)) // q.block[0] * q.block[0])
        outs = []
        for start in range(0, self.out_features, step):
            stop = min(start + step, self.out_features)
            weight = quant.dequantize(q.rows(start, stop)).to(x.dtype)
            bias = None if self.bias is None else self.bias[start:stop]
            outs.append(batch_invariant.linear(x, weight, bias) if self.batch_invariant else F.linear(x, weight, bias))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    fused = False  # set by CausalLM.use_cpu_kernels: one kernel (miles_async/kernels/cpu_kernels.py), inference only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and not x.requires_grad:
            return cpu_kernels.rms_norm(x, self.weight, self.eps)
        # Normalise in fp32, cast back, then scale: transformers' order, which matters in bf16.
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    batch_invariant = False  # set by CausalLM.set_batch_invariant: torch's fused silu is not
    fused = False  # set by CausalLM.use_cpu_kernels: silu(gate) * up in one kernel (with gate_up_prepacked)

    def __init__(self, hidden_size: int, width: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, width, bias=bias)
        self.up_proj = Linear(hidden_size, width, bias=bias)
        self.down_proj = Linear(width, hidden_size, bias=bias)

    # (weight, bias) of gate and up stacked and prepacked: set by CausalLM.prepack_weights
    gate_up_prepacked: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_prepacked is not None and not x.requires_grad:  # one matmul for gate and up
            gate_up = onednn.linear(x, *self.gate_up_prepacked)
            if self.fused:
                return self.down_proj(cpu_kernels.silu_mul(gate_up))
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        act = batch_invariant.silu if self.batch_invariant else F.silu
        return self.down_proj(act(self.gate_proj(x)) * self.up_proj(x))
