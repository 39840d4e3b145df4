"""One compact decoder-only transformer for the Llama, Qwen2, Qwen3 and Qwen3-MoE families.

The families differ in three switches, all read from `ModelConfig`: biases on q/k/v (Qwen2),
a per-head RMSNorm on q and k (Qwen3), and a sparse MoE block in place of the MLP (Qwen3-MoE).
Module and parameter names are Hugging Face's (`model.layers.3.self_attn.q_proj.weight`,
`model.layers.3.mlp.experts.5.up_proj.weight`, ...), so a checkpoint's tensors load by name and
the weights an engine receives in an update are named as the trainer's are. The numerics follow
transformers' own modeling code step by step (fp32 RMSNorm, fp32 RoPE tables, router softmax in
fp32), so logits agree with it to float rounding. `Linear`, `RMSNorm` and `MLP`, which the draft
head is built of too, are in models/layers.py.

Tensor names (STYLE rule 10): B batch, T tokens, V vocab, D hidden, N query heads, K kv heads,
H head dim, F MLP width, E experts, k experts per token, M tokens flattened (B*T), m the tokens
routed to one expert, L MoE layers.

Try it:
    model = CausalLM(ModelConfig.from_hf("DIR"))          # random weights; load_pretrained loads
    logits_BTV = model(torch.tensor([[1, 2, 3]]))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from miles_async.kernels import cpu_kernels, onednn, quant
from miles_async.models.attention import AttentionBackend, DenseCausalAttention
from miles_async.models.config import ModelConfig
from miles_async.models.draft import DraftHead
from miles_async.models.layers import MLP, Linear, RMSNorm
from miles_async.models.lora import DEFAULT_TARGETS
from miles_async.models.rope import Rotary, apply_rotary


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = Linear(config.hidden_size, q_width, bias=bias)
        self.k_proj = Linear(config.hidden_size, kv_width, bias=bias)
        self.v_proj = Linear(config.hidden_size, kv_width, bias=bias)
        # Qwen2's attention_bias covers q/k/v only; Llama's and Qwen3's cover o_proj too.
        self.o_proj = Linear(q_width, config.hidden_size, bias=bias and config.family != "qwen2")
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.fused = False  # set by CausalLM.use_cpu_kernels
        # (weight, bias) of q, k and v stacked and prepacked: set by CausalLM.prepack_weights
        self.qkv_prepacked: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        positions_BT: torch.Tensor,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        batch, num_tokens, _ = x_BTD.shape
        if self.qkv_prepacked is not None and not x_BTD.requires_grad:  # one matmul for q, k and v
            q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q_BTX, k_BTX, v_BTX = onednn.linear(x_BTD, *self.qkv_prepacked).split([q_width, kv_width, kv_width], -1)
        else:
            q_BTX, k_BTX, v_BTX = self.q_proj(x_BTD), self.k_proj(x_BTD), self.v_proj(x_BTD)
        q_BTNH = q_BTX.view(batch, num_tokens, self.num_heads, self.head_dim)
        k_BTKH = k_BTX.view(batch, num_tokens, self.num_kv_heads, self.head_dim)
        v_BTKH = v_BTX.view(batch, num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
        rotate = cpu_kernels.rotary if self.fused and not x_BTD.requires_grad else apply_rotary
        q_BTNH, k_BTKH = rotate(q_BTNH, *cos_sin), rotate(k_BTKH, *cos_sin)
        out_BTNH = attn(self.layer_idx, q_BTNH, k_BTKH, v_BTKH, positions_BT)
        return self.o_proj(out_BTNH.reshape(batch, num_tokens, self.num_heads * self.head_dim))


class SparseMoE(nn.Module):
    """Top-k routed experts (Qwen3-MoE): softmax over all experts in fp32, keep the top k,
    renormalise them when `norm_topk_prob`, and sum the chosen experts' outputs by those weights.

    Replay (R3): given the experts to use, the weights are recomputed from this router's logits
    for exactly those experts (softmax over all, gather, renormalise), so a replayed forward is
    differentiable in the router as a normal one is, and equals it when the experts are the same.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, self.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(config.hidden_size, config.moe_intermediate_size) for _ in range(self.num_experts)
        )

    def route(
        self, x_MD: torch.Tensor, experts_Mk: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights_Mk in x's dtype, experts_Mk): the router's choice, or the given experts' weights."""
        probs_ME = F.softmax(self.gate(x_MD), dim=-1, dtype=torch.float32)
        if experts_Mk is None:
            weights_Mk, experts_Mk = torch.topk(probs_ME, self.top_k, dim=-1)
        else:
            weights_Mk = probs_ME.gather(-1, experts_Mk)
        if self.norm_topk_prob:
            weights_Mk = weights_Mk / weights_Mk.sum(dim=-1, keepdim=True)
        return weights_Mk.to(x_MD.dtype), experts_Mk

    def forward(
        self, x_BTD: torch.Tensor, experts_BTk: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(out_BTD, experts_BTk); experts_BTk given means replay exactly those experts."""
        batch, num_tokens, hidden = x_BTD.shape
        x_MD = x_BTD.reshape(-1, hidden)
        given_Mk = None if experts_BTk is None else experts_BTk.reshape(-1, self.top_k).to(torch.int64)
        weights_Mk, experts_Mk = self.route(x_MD, given_Mk)
        out_MD = torch.zeros_like(x_MD)
        # Loop over the experts that got at least one token; each runs one matmul on its tokens.
        for expert in torch.unique(experts_Mk).tolist():
            token_idx, slot_idx = torch.where(experts_Mk == expert)
            y_mD = self.experts[expert](x_MD[token_idx]) * weights_Mk[token_idx, slot_idx, None]
            out_MD.index_add_(0, token_idx, y_mD)
        return out_MD.view(batch, num_tokens, hidden), experts_Mk.view(batch, num_tokens, self.top_k)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.is_moe = config.is_moe_layer(layer_idx)
        self.mlp: nn.Module = (
            SparseMoE(config)
            if self.is_moe
            else MLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        positions_BT: torch.Tensor,
        attn: AttentionBackend,
        experts_BTk: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x_BTD = x_BTD + self.self_attn(self.input_layernorm(x_BTD), cos_sin, positions_BT, attn)
        h_BTD = self.post_attention_layernorm(x_BTD)
        if self.is_moe:
            h_BTD, experts_BTk = self.mlp(h_BTD, experts_BTk)
        else:
            h_BTD = self.mlp(h_BTD)
        return x_BTD + h_BTD, experts_BTk


class Backbone(nn.Module):
    """Embedding, decoder layers and final norm: Hugging Face's `model.` prefix."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config)

    def forward(
        self,
        input_ids_BT: torch.Tensor,
        positions_BT: torch.Tensor,
        attn: AttentionBackend,
        routed_experts_LBTk: torch.Tensor | None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(final hidden states h_BTD, the experts each MoE layer used, in layer order)."""
        x_BTD = self.embed_tokens(input_ids_BT)
        cos_sin = self.rotary(positions_BT, x_BTD.dtype)
        used: list[torch.Tensor] = []
        for layer in self.layers:
            given_BTk = None
            if layer.is_moe and routed_experts_LBTk is not None:
                given_BTk = routed_experts_LBTk[len(used)]
            x_BTD, experts_BTk = layer(x_BTD, cos_sin, positions_BT, attn, given_BTk)
            if layer.is_moe:
                used.append(experts_BTk)
        return self.norm(x_BTD), used


class CausalLM(nn.Module):
    """A causal language model of one of the supported families.

    `model(input_ids_BT)` returns logits_BTV. Packed rows pass `positions_BT` restarting at 0 at
    each sample (see attention.py for the exact rule); `attn` replaces the default dense causal
    attention (the engine's paged KV cache). For MoE models `return_routed_experts=True` also
    returns experts_LBTk (int64, [number of MoE layers, B, T, k], layers in the order of
    `config.moe_layer_indices`), and `routed_experts=experts_LBTk` replays exactly those experts.
    Dense models ignore `routed_experts` and return None for the experts.

    `model.model(input_ids_BT, positions_BT, attn, routed_experts)` returns (h_BTD, experts per
    MoE layer) before `lm_head`, for callers that need logits at a few positions only (an engine's
    prefill keeps only its last token's).

    True on-policy mode (`batch_invariant=True`, or `set_batch_invariant(True)` later): every
    linear, the MLP activation and the default attention run through `kernels.batch_invariant`,
    so a token's logits are bit for bit the same whatever else shares the batch; the embedded
    engine's paged attention follows the same rule (`EngineConfig(batch_invariant=True)`).
    """

    def __init__(self, config: ModelConfig, *, batch_invariant: bool = False) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp: DraftHead | None = None  # the draft head of speculative decoding (add_draft_head)
        self.set_batch_invariant(batch_invariant)

    def add_draft_head(self) -> DraftHead:
        """Give the model a draft head (`mtp.*`, models/draft.py) with its seeded first weights, on
        the model's device and dtype, under the model's current modes; return it (the one it has, if
        it has one)."""
        if self.mtp is None:
            weight = self.lm_head.weight
            with torch.device(weight.device):
                head = DraftHead(self.config).to(weight.dtype)
            if weight.device.type != "meta":
                head.reset_parameters()
            self.mtp = head
            self.set_batch_invariant(self.batch_invariant)
        return self.mtp

    def prepack_weights(self, enabled: bool = True) -> None:
        """Give the linear layers prepacked copies of their weights (`kernels.onednn`), made from the
        weights as they are now, or drop the copies (`enabled=False`). Attention's q, k and v
        projections get one copy of the three stacked (one matmul), as do an MLP's gate and up
        projections; o_proj, down_proj and lm_head a copy each. Inference only (no gradient flows
        through a copy), and made again after any change to the weights: the embedded engine does
        both. Raises ValueError where the weights' dtype and device cannot be prepacked."""
        weight = self.lm_head.weight
        if enabled and not onednn.supported(weight.dtype, weight.device):
            raise ValueError(f"cannot prepack {weight.dtype} weights on {weight.device} with this torch build")

        def pack(*layers: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None] | None:
            """(packed weight, bias) of the layers' outputs stacked, or None when disabled."""
            if not enabled:
                return None
            with torch.no_grad():
                stacked = torch.cat([_serving(layer) for layer in layers])
                bias = None if all(layer.bias is None for layer in layers) else torch.cat([
                    layer.bias if layer.bias is not None else _serving(layer).new_zeros(layer.out_features)
                    for layer in layers])
            return onednn.prepack(stacked), bias

        def pack_one(layer: Linear) -> None:  # a Linear keeps its own bias: its weight's copy only
            layer.prepacked = onednn.prepack(_serving(layer)) if enabled else None

        for module in self.modules():
            if isinstance(module, Attention):
                module.qkv_prepacked = pack(module.q_proj, module.k_proj, module.v_proj)
                pack_one(module.o_proj)
            elif isinstance(module, MLP):
                module.gate_up_prepacked = pack(module.gate_proj, module.up_proj)
                pack_one(module.down_proj)
        pack_one(self.lm_head)

    def use_cpu_kernels(self, enabled: bool = True) -> None:
        """Run RMSNorm, rotary embedding and (with prepacked weights) the MLP's silu(gate) * up
        through the fused CPU kernels (miles_async/kernels/cpu_kernels.py) in forwards without autograd, or
        stop (`enabled=False`). Raises ValueError where they cannot run: not a CPU, a dtype other
        than fp32/bf16, no compiler."""
        if enabled:
            weight = self.lm_head.weight
            if not cpu_kernels.supports(weight.dtype, weight.device):
                why = cpu_kernels.unavailable_reason() or f"{weight.dtype} weights on {weight.device}"
                raise ValueError(f"the fused CPU kernels cannot run here: {why}")
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.fused = enabled

    def set_fake_quant(self, fmt: str = "") -> None:
        """Quantization-aware training (`kernels.quant`): the attention and MLP projections run as
        an engine serving format `fmt` runs them (weights, and for the W8A8 formats fp8_block and
        mxfp8 the activations, as the format holds them), with straight-through gradients;
        "fp8_block" also runs the backward's matmuls on blockwise E4M3 gradients (FP8 training).
        "" turns it off. The embeddings and the output projection stay in full precision."""
        if fmt not in ("", *quant.FORMATS):
            raise ValueError(f"fake quantization trains for one of {', '.join(quant.FORMATS)} (or '' for none), "
                             f"got {fmt!r}")
        for module in _projections(self):
            module.fake_quant = fmt

    def hold_quantized(self, fmt: str) -> int:
        """Hold the attention and MLP projections' weights as format `fmt` does (the engine's
        `weight_format`): each `weight` parameter is quantized and replaced by the format's tensors
        (`kernels.quant.to_named`: `weight_packed`, `weight_scale`[, `weight_global_scale`]), which
        are then what a weight update writes. The layers dequantize a block of rows at a time in
        every forward, or use the copy `dequantize_served` makes. Embeddings, norms and the output
        projection stay as they are. Inference only; returns the number of layers quantized."""
        if fmt not in quant.FORMATS:
            raise ValueError(f"weight format must be one of {', '.join(quant.FORMATS)}, got {fmt!r}")
        layers = [m for m in _projections(self) if not m.qformat]
        with torch.no_grad():
            for module in layers:
                if module.lora_rank:
                    raise ValueError("a model with LoRA adapters cannot hold quantized weights (its base is merged "
                                     "with the adapters in full precision)")
                weight = module.weight
                del module.weight
                for name, tensor in quant.to_named("", quant.quantize(weight, fmt)).items():
                    module.register_buffer(name.lstrip("."), tensor.contiguous())
                module.qformat, module.qdtype = fmt, weight.dtype
        return len(layers)

    def dequantize_served(self, enabled: bool = True) -> None:
        """Give each layer held quantized (`hold_quantized`) a full-precision copy of its weight,
        dequantized from what it holds now (faster forwards, the dense weight's memory back), or
        drop the copies (`enabled=False`): made again after every change of the weights."""
        with torch.no_grad():
            for module in _projections(self):
                if module.qformat:
                    module.served = quant.dequantize(module.quantized()) if enabled else None

    def set_batch_invariant(self, enabled: bool = True) -> None:
        """Switch true on-policy mode on or off (module flags only; weights untouched)."""
        self.batch_invariant = enabled
        for module in self.modules():
            if isinstance(module, (Linear, MLP)):
                module.batch_invariant = enabled

    def forward(
        self,
        input_ids_BT: torch.Tensor,
        positions_BT: torch.Tensor | None = None,
        *,
        attn: AttentionBackend | None = None,
        routed_experts: torch.Tensor | None = None,
        return_routed_experts: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        positions_BT = self._check_inputs(input_ids_BT, positions_BT, routed_experts)
        if not self.config.is_moe:
            routed_experts = None
        # A fresh default backend per call: it keeps the packed mask for this forward's layers only.
        attn = attn or DenseCausalAttention(batch_invariant=self.batch_invariant)
        h_BTD, used = self.model(input_ids_BT, positions_BT, attn, routed_experts)
        logits_BTV = self.lm_head(h_BTD)
        if not return_routed_experts:
            return logits_BTV
        return logits_BTV, (torch.stack(used) if used else None)

    def _check_inputs(
        self,
        input_ids_BT: torch.Tensor,
        positions_BT: torch.Tensor | None,
        routed_experts_LBTk: torch.Tensor | None,
    ) -> torch.Tensor:
        if input_ids_BT.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids_BT.shape)}")
        if positions_BT is None:
            positions_BT = torch.arange(input_ids_BT.shape[1], device=input_ids_BT.device)
            positions_BT = positions_BT.expand_as(input_ids_BT)
        elif positions_BT.shape != input_ids_BT.shape:
            raise ValueError(
                f"positions shape {tuple(positions_BT.shape)} must equal input_ids shape "
                f"{tuple(input_ids_BT.shape)}"
            )
        if routed_experts_LBTk is not None and self.config.is_moe:
            self._check_routed_experts(routed_experts_LBTk, tuple(input_ids_BT.shape))
        return positions_BT

    def _check_routed_experts(self, experts_LBTk: torch.Tensor, shape_BT: tuple[int, int]) -> None:
        config = self.config
        expected = (len(config.moe_layer_indices), *shape_BT, config.num_experts_per_tok)
        if tuple(experts_LBTk.shape) != expected:
            raise ValueError(
                f"routed_experts shape {tuple(experts_LBTk.shape)} must be [moe layers, batch, tokens, "
                f"top_k] = {expected}"
            )
        if experts_LBTk.dtype.is_floating_point or experts_LBTk.dtype == torch.bool:
            raise ValueError(f"routed_experts must be an integer tensor, got {experts_LBTk.dtype}")
        if experts_LBTk.numel():
            lowest, highest = int(experts_LBTk.min()), int(experts_LBTk.max())
            if lowest < 0 or highest >= config.num_experts:
                raise ValueError(
                    f"routed_experts holds ids outside [0, {config.num_experts}): min {lowest}, max {highest}"
                )


def is_projection(module: str) -> bool:
    """Whether the module named `module` (e.g. "model.layers.0.mlp.up_proj") is an attention or MLP
    projection: LoRA's default targets, and the layers a quantized format covers."""
    return module.rsplit(".", 1)[-1] in DEFAULT_TARGETS


def _projections(model: nn.Module) -> list[Linear]:
    return [m for name, m in model.named_modules() if isinstance(m, Linear) and is_projection(name)]


def _serving(layer: nn.Linear) -> torch.Tensor:
    """The weight a layer serves: the dequantized copy of a layer held quantized, else its weight."""
    if getattr(layer, "qformat", ""):
        if layer.served is None:
            raise ValueError("a layer held quantized has no dense weight to prepack: call dequantize_served() first")
        return layer.served
    return layer.weight
