"""The engine's model runner: the forward over a scheduled step, drafting and verification, output reading.

    runner = ModelRunner(model, config, device)  # the model's features switched on for the engine
    runner.prepare()                             # after every weight change: what the forward serves from
    result = runner.execute(step)                # on the compute thread; step from scheduler.py

What a model feature needs from the engine lives here, switched on once at construction: true
on-policy mode (batch-invariant kernels), the draft head (speculative decoding), LoRA adapters,
a quantized weight format, the fused CPU kernels, and oneDNN-prepacked weights. Whatever is
derived from the weights (the LoRA merge, the per-update dequantized copy, the prepacked copies)
is made by `prepare()`, which the engine calls once after each change of the weights (and at
the start), so a step runs the forward alone and checks nothing about the weights.

How a step runs (`execute`): the model runs on one packed row of all scheduled tokens, then
samples; the vocabulary projection covers the sampled rows, plus the prompt positions a request
asked log-probs of (the scheduler never takes those from the prefix cache, whose KV holds no
logits). What it reads back from the device is its results only (`.tolist()` of the sampled ids
and log-probs, of scored prompt log-probs and of the top-k lists asked for).

Tensor names (STYLE rule 10): T packed tokens, X the rows projected (R sampled, then S scored),
P the sampled rows without drafts, S also speculating requests, K drafts, V vocabulary, D hidden
size, L layers, k experts per token.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, cast

import torch

from miles_async.engine import compute, speculative
from miles_async.engine.attention import GatherWorkspace, PagedAttention, StepPlan, build_plan
from miles_async.engine.config import EngineConfig
from miles_async.engine.kv_cache import KVCache
from miles_async.engine.request import Request, TopLogprobs
from miles_async.engine.sampling import filtered_log_probs, make_generator, sample
from miles_async.engine.scheduler import Step
from miles_async.kernels import cpu_kernels, onednn, quant
from miles_async.models.lora import add_lora, lora_state, merge_lora


@dataclass(frozen=True, slots=True)
class StepResult:
    # Per sampled chunk: the tokens it emits (one; with drafts, the accepted ones and one more), the
    # log-prob of each and, when its request asked, the k most likely tokens at each.
    tokens: list[list[int]]
    logprobs: list[list[float]]
    top: list[list[TopLogprobs | None]]
    scored_logprobs: list[float]  # one per Step.scored row
    scored_top: list[TopLogprobs | None]
    hidden: list[torch.Tensor | None]  # per sampled chunk: the policy's hidden state at its last kept position


def _config_int(config: Any, name: str, default: int = 0) -> int:
    value = getattr(config, name, None)
    return default if value is None else int(value)


class ModelRunner:
    """One model on one device, with its KV cache; see the module docstring. `config.device` is
    the resolved device; the model is moved there if it is elsewhere."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        # The model's optional methods (CausalLM's: set_batch_invariant, add_draft_head,
        # hold_quantized, prepack_weights, dequantize_served, use_cpu_kernels), each checked before use.
        self._features: Any = cast(Any, model)
        if any(p.device != device for p in model.parameters()):
            compute.run_sync(model.to, device)
        if device.type == "cuda":  # the compute thread's current GPU: NCCL groups use it
            compute.run_sync(torch.cuda.set_device, device)
        if config.batch_invariant:
            if not hasattr(model, "set_batch_invariant"):
                raise ValueError(f"EngineConfig.batch_invariant needs a model with set_batch_invariant "
                                 f"(miles_async.models.CausalLM), got {type(model).__name__}")
            self._features.set_batch_invariant(True)
        self.speculative = config.speculative_tokens
        if self.speculative:  # the draft head's weights are then part of every update
            if not (hasattr(model, "add_draft_head") and hasattr(model, "model") and hasattr(model, "lm_head")):
                raise ValueError(f"EngineConfig.speculative_tokens needs a model with a draft head "
                                 f"(miles_async.models.CausalLM), got {type(model).__name__}")
            compute.run_sync(self._features.add_draft_head)
        elif getattr(model, "mtp", None) is not None:  # a checkpoint's draft head, unused: not held, not updated
            self._features.mtp = None
        self.model = model.eval()
        self.lora = config.lora.enabled
        if self.lora:  # the adapters (B = 0: the base as it is) are what updates write
            compute.run_sync(add_lora, model, config.lora)
        self.weight_format = "" if config.weight_format == "none" else config.weight_format
        if self.weight_format:  # the projections held as the format's tensors: what updates write
            if not hasattr(model, "hold_quantized"):
                raise ValueError(f"EngineConfig.weight_format = {config.weight_format!r} needs a model with "
                                 f"hold_quantized (miles_async.models.CausalLM), got {type(model).__name__}")
            compute.run_sync(self._features.hold_quantized, self.weight_format)
        mc = model.config
        self.vocab_size = _config_int(mc, "vocab_size")
        num_heads = _config_int(mc, "num_attention_heads")
        head_dim = _config_int(mc, "head_dim") or _config_int(mc, "hidden_size") // num_heads
        model_max = _config_int(mc, "max_position_embeddings", 2048)
        self.max_seq_len = min(config.max_seq_len or model_max, model_max)
        self.is_moe = bool(getattr(mc, "is_moe", _config_int(mc, "num_experts") > 0))
        # The KV blocks hold keys and values in the model's dtype (those of a bf16 model are bf16
        # already: storing them wider would only double the memory and the bytes each step reads).
        kv_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        layer_shape: dict[str, Any] = {"num_layers": _config_int(mc, "num_hidden_layers"), "block_size": config.block_size,
                       "num_kv_heads": _config_int(mc, "num_key_value_heads") or num_heads, "head_dim": head_dim,
                       "dtype": kv_dtype}
        num_blocks = int(config.kv_cache_mib * 2**20) // KVCache.bytes_per_block(**layer_shape)
        needed = -(-self.max_seq_len // config.block_size)
        if num_blocks < needed:
            raise ValueError(f"kv_cache_mib={config.kv_cache_mib} holds {num_blocks} blocks but one request of "
                             f"max_seq_len={self.max_seq_len} tokens needs {needed}; raise kv_cache_mib or lower "
                             "max_seq_len")
        self.cache = compute.run_sync(KVCache, num_blocks=num_blocks, device=device, **layer_shape)
        self.workspace = GatherWorkspace()
        self.shared_generator = make_generator(config.seed, device)
        # Prepacked weights (EngineConfig.prepack_weights), made again by every `prepare()`
        # (not from a weight_format's blocks: no dense weight exists to prepack; nor for a W8A8
        # format: the layers quantize their inputs first)
        self.prepack = (config.prepack_weights and not config.batch_invariant and hasattr(model, "prepack_weights")
                        and not (self.weight_format and (config.dequantize == "blocks"
                                                         or self.weight_format in quant.ACTIVATION_FORMATS))
                        and compute.run_sync(onednn.supported, kv_dtype, device))
        # weight_format "per_update": `prepare()` gives the layers a dequantized copy of the weights
        self.dequantize_per_update = bool(self.weight_format) and config.dequantize == "per_update"
        self.fused = (config.fused_cpu_kernels and not config.batch_invariant and hasattr(model, "use_cpu_kernels")
                      and compute.run_sync(cpu_kernels.supports, kv_dtype, device))
        if self.fused:
            self._features.use_cpu_kernels(True)

    def update_names(self) -> list[str] | None:
        """The weights an update writes: with LoRA the adapters alone; None: all of them."""
        return list(lora_state(self.model)) if self.lora else None

    # ----- after a weight change -----

    def prepare(self) -> None:
        """Make what the forward serves from the weights as they are now (on the compute thread):
        LoRA's base + adapter merged into each layer, a quantized format's dequantized copy, the
        prepacked copies. The engine calls it once after each change of the weights."""
        if self.lora:
            merge_lora(self.model)
        if self.dequantize_per_update:
            self._features.dequantize_served()
        if self.prepack:
            self._features.prepack_weights()

    def unprepare(self) -> None:
        """Drop the copies `prepare` made (their memory goes back with the weights'; a release)."""
        if self.prepack:
            self._features.prepack_weights(False)
        if self.dequantize_per_update:
            self._features.dequantize_served(False)

    # ----- one step -----

    def execute(self, step: Step) -> StepResult:
        """On the compute thread: index tensors, the forward over the packed row, then sampling.

        The prompt positions being scored get their logits from the same projection as the
        sampled rows, and their log-probs as the sampler takes a greedy token's (float32
        log_softmax of the logits): row for row what a trainer's forward gives, bit for bit in
        batch-invariant mode.
        """
        device = self.device
        with torch.inference_mode():
            plan = build_plan(step.chunks, self.cache.block_size, device, per_token=self.fused)
            rows = [i for i, s in enumerate(step.sampled) if s]
            # The packed rows whose logits are needed: each sampled chunk's last one (a speculating
            # chunk's last drafts + 1: x_n and its drafts), then the scored prompt positions.
            sampled_rows = [list(range(plan.last_rows[i] - step.drafts[i], plan.last_rows[i] + 1)) for i in rows]
            rows_X = torch.tensor([row for chunk in sampled_rows for row in chunk] + [row for _, row, _ in step.scored],
                                  dtype=torch.long, device=device)
            ids_1T = torch.tensor([step.input_ids], dtype=torch.long, device=device)
            speculating = [r for r, i in enumerate(rows) if step.drafts[i]]  # indices into rows
            drafted = self._draft(step, [rows[r] for r in speculating], plan, ids_1T) if speculating else None
            logits_XV, experts_L1Tk, hidden_XD = self._forward(ids_1T, plan, rows_X)
            if experts_L1Tk is not None:
                self.cache.enable_expert_capture(experts_L1Tk.shape[0], experts_L1Tk.shape[-1])
                assert self.cache.expert_slots_TLk is not None
                self.cache.expert_slots_TLk[plan.write_slots_T] = experts_L1Tk[:, 0].transpose(0, 1).to(torch.int32)
            num_sampled = sum(len(chunk) for chunk in sampled_rows)
            logits_RV, logits_SV = logits_XV[:num_sampled], logits_XV[num_sampled:]
            scored_logprobs: list[float] = []
            scored_top: list[TopLogprobs | None] = []
            if step.scored:
                logp_SV = torch.log_softmax(logits_SV.float(), dim=-1)
                targets_S = torch.tensor([target for _, _, target in step.scored], dtype=torch.long, device=device)
                scored_logprobs = logp_SV.gather(1, targets_S[:, None]).squeeze(1).tolist()
                scored_top = _top(logp_SV, [step.requests[i].top_logprobs_num for i, _, _ in step.scored])
            if not rows:
                return StepResult([], [], [], scored_logprobs, scored_top, [])
            picked = [step.requests[i] for i in rows]
            starts = list(itertools.accumulate((len(chunk) for chunk in sampled_rows), initial=0))
            tokens: list[list[int]] = [[] for _ in rows]
            logprobs: list[list[float]] = [[] for _ in rows]
            kept = starts[:-1]  # per sampled chunk: its row (in logits_RV) of the last kept position
            plain = [r for r in range(len(rows)) if not step.drafts[rows[r]]]
            if plain:
                if len(plain) == len(rows) and drafted is None:  # one row each, in order: no copy of the logits
                    logits_PV = logits_RV
                else:
                    logits_PV = logits_RV[torch.tensor([starts[r] for r in plain], dtype=torch.long, device=device)]
                tokens_P, logprobs_P = sample(logits_PV, [picked[r].params for r in plain],
                                              [picked[r].generator for r in plain], self.shared_generator,
                                              fused=self.fused)
                for r, token, logprob in zip(plain, tokens_P.tolist(), logprobs_P.tolist()):
                    tokens[r], logprobs[r] = [token], [logprob]
            if drafted is not None:
                verdict = self._verify(logits_RV, [sampled_rows[r] for r in speculating],
                                       [starts[r] for r in speculating], [picked[r] for r in speculating], drafted)
                for r, emitted, emitted_logprobs in zip(speculating, verdict.tokens, verdict.logprobs):
                    tokens[r], logprobs[r] = emitted, emitted_logprobs
                    kept[r] = starts[r] + len(emitted) - 1
            top = self._output_top(logits_RV, picked, [[start + j for j in range(len(t))]
                                                       for start, t in zip(starts, tokens)])
            hidden: list[torch.Tensor | None] = [None] * len(rows)
            if self.speculative and hidden_XD is not None:  # what the next step drafts from
                kept_D = hidden_XD[torch.tensor(kept, dtype=torch.long, device=device)]
                hidden = list(kept_D.unbind(0))
            return StepResult(tokens, logprobs, top, scored_logprobs, scored_top, hidden)

    def _draft(self, step: Step, chunks: list[int], plan: StepPlan, ids_1T: torch.Tensor) -> speculative.Drafts:
        """Draft the speculating chunks' tokens with the draft head, from each request's kept
        hidden state and its last token, and write them into their places in `ids_1T`."""
        requests = [step.requests[i] for i in chunks]
        num_drafts = max(step.drafts[i] for i in chunks)
        hidden_SD = torch.stack([r.draft_hidden for r in requests])  # type: ignore[misc]
        last_S = torch.tensor([r.output_ids[-1] if r.output_ids else r.prompt_ids[-1] for r in requests],
                              dtype=torch.long, device=self.device)
        drafts = speculative.draft(self.model, hidden_SD, last_S, num_drafts, [r.params for r in requests],
                                   [r.generator for r in requests], self.shared_generator)
        for s, i in enumerate(chunks):
            d = step.drafts[i]
            ids_1T[0, plan.last_rows[i] - d + 1:plan.last_rows[i] + 1] = drafts.tokens_SK[s, :d]
        return drafts

    def _verify(self, logits_RV: torch.Tensor, chunk_rows: list[list[int]], starts: list[int],
                requests: list[Request], drafts: speculative.Drafts) -> speculative.Verdict:
        """The speculating chunks' verdicts (engine/speculative.py) from their rows of the verify's logits."""
        width = drafts.tokens_SK.shape[1] + 1
        index = [[start + min(j, len(rows) - 1) for j in range(width)] for start, rows in zip(starts, chunk_rows)]
        logits_SKV = logits_RV[torch.tensor(index, dtype=torch.long, device=self.device)]
        return speculative.verify(logits_SKV, drafts, [len(rows) - 1 for rows in chunk_rows],
                                  [r.params for r in requests], [r.generator for r in requests],
                                  self.shared_generator, fused=self.fused)

    @staticmethod
    def _output_top(logits_RV: torch.Tensor, picked: list[Request],
                    emitted_rows: list[list[int]]) -> list[list[TopLogprobs | None]]:
        """Per request, per token it emits (at the rows `emitted_rows` of `logits_RV`), the k most
        likely next tokens if it asked, under the distribution the sampler took the chosen token's
        log-prob from (greedy: the model's; else temperature and top-k/top-p applied), so a chosen
        token in the top k shows the same log-prob in both."""
        top: list[list[TopLogprobs | None]] = [[None] * len(rows) for rows in emitted_rows]
        for i, request in enumerate(picked):
            if not request.top_logprobs_num:
                continue
            params = request.params
            for j, row in enumerate(emitted_rows[i]):
                row_1V = logits_RV[row:row + 1].float()
                logp_1V = torch.log_softmax(row_1V, dim=-1) if params.greedy else filtered_log_probs(row_1V, [params])
                top[i][j] = _top(logp_1V, [request.top_logprobs_num])[0]
        return top

    def _forward(self, input_ids_1T: torch.Tensor, plan: StepPlan,
                 rows_R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Logits of the packed rows `rows_R` only, the routed experts of every token (MoE), and the
        final hidden states of the rows (what the draft head reads; None for a model without a backbone).

        CausalLM exposes its backbone (`model.model`, final hidden states) for exactly this: a
        prefill chunk needs the vocabulary projection of its last token only, not of all of them.
        Any other model with the spec'd forward gets the full logits, then the rows.
        """
        attn = PagedAttention(self.cache, plan, self.workspace, batch_invariant=self.config.batch_invariant)
        positions_1T = plan.positions_T[None]
        backbone, lm_head = getattr(self.model, "model", None), getattr(self.model, "lm_head", None)
        if backbone is not None and lm_head is not None:
            h_1TD, used = backbone(input_ids_1T, positions_1T, attn, None)
            h_RD = h_1TD[0, rows_R]
            return lm_head(h_RD), (torch.stack(used) if used else None), h_RD
        out = self.model(input_ids_1T, positions_1T, attn=attn, return_routed_experts=self.is_moe)
        logits_1TV, experts_L1Tk = out if isinstance(out, tuple) else (out, None)
        return logits_1TV[0, rows_R], experts_L1Tk, None

    def routed_experts(self, request: Request) -> torch.Tensor | None:
        """Experts of every token with KV (prompt + output - 1 rows), read from the slots they were written to."""
        slots_cache = self.cache.expert_slots_TLk
        if slots_cache is None or request.num_computed == 0:
            return None
        size = self.cache.block_size
        slots = [request.blocks[p // size] * size + p % size for p in range(request.num_computed)]
        return compute.serial_index_select(slots_cache, torch.tensor(slots, dtype=torch.long))  # a host tensor


def _top(logp_RV: torch.Tensor, ks: list[int]) -> list[TopLogprobs | None]:
    """The k most likely (log-prob, token id) of each row, k per row (0: None)."""
    k_max = max(ks, default=0)
    if k_max == 0:
        return [None] * len(ks)
    values_RK, ids_RK = logp_RV.topk(min(k_max, logp_RV.shape[-1]), dim=-1)
    values, ids = values_RK.tolist(), ids_RK.tolist()  # one read each, not one per row
    return [list(zip(v[:k], i[:k])) if k else None for v, i, k in zip(values, ids, ks)]
