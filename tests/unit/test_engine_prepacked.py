"""The engine's fast CPU paths against its plain ones: linears from prepacked oneDNN weights
(`EngineConfig.prepack_weights`, miles_async/kernels/onednn.py), the fused kernels (`fused_cpu_kernels`:
RMSNorm, rotary, attention of decoding and prompt tokens over the blocks in place,
miles_async/kernels/cpu_kernels.py), and attention as batched matmuls (`matmul_attention`, for decoding groups
and short bf16 chunks) instead of SDPA.

Stated tolerances: greedy outputs identical, token for token; the reported log-probs within 1e-5
(fp32) and 0.02 (bf16, where the plain path itself rounds differently from SDPA) of the plain
engine's. After a weight update the prepacked copies must follow the new weights: a stale copy
would serve the old model silently.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from miles_async.engine import Engine, EngineConfig, GenerateRequest, SamplingParams, compute
from miles_async.engine.attention import matmul_attention
from miles_async.kernels import cpu_kernels, onednn
from miles_async.models import init_model, load_pretrained
from miles_async.models.transformer import MLP, Attention

pytestmark = pytest.mark.skipif(not onednn.supported(torch.float32, torch.device("cpu")),
                                reason="this torch build cannot prepack weights for oneDNN")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("model") / "tiny", seed=0)


def prompts(count: int = 12) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 500, (3 + 5 * i,), generator=gen).tolist() for i in range(count)]


def greedy(engine: Engine, batch: list[list[int]], num_tokens: int = 24) -> list:
    async def run() -> list:
        async with engine:
            return await asyncio.gather(*(engine.generate(GenerateRequest(
                input_ids=p, return_logprob=True, sampling_params=SamplingParams(
                    temperature=0.0, max_new_tokens=num_tokens, ignore_eos=True))) for p in batch))

    return asyncio.run(run())


def engine(folder: Path, dtype: str, fast: bool) -> Engine:
    return Engine.from_pretrained(str(folder), config=EngineConfig(  # type: ignore[arg-type]
        kv_cache_mib=8, dtype=dtype, prepack_weights=fast, fused_cpu_kernels=fast))  # type: ignore[arg-type]


@pytest.mark.parametrize("threads", [1, 2])  # the fused kernels serial and on an OpenMP team
@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-5), ("bfloat16", 0.02)])
def test_fast_engine_generates_what_the_plain_engine_does(folder: Path, dtype: str, tolerance: float,
                                                          threads: int) -> None:
    before = compute.run_sync(torch.get_num_threads)
    compute.run_sync(torch.set_num_threads, threads)
    try:
        fast, plain = engine(folder, dtype, True), engine(folder, dtype, False)
        fast_outs, plain_outs = greedy(fast, prompts()), greedy(plain, prompts())
    finally:
        compute.run_sync(torch.set_num_threads, before)
    # Prepacking needs oneDNN's kernels for the dtype on this CPU (bf16: AVX512-BF16 or AMX); where
    # they are missing the engine keeps the plain linears, and the fused kernels are still compared.
    prepacks = onednn.supported(getattr(torch, dtype), torch.device("cpu"))
    assert fast.runner.prepack == prepacks and not plain.runner.prepack and not plain.runner.fused
    assert fast.runner.fused == cpu_kernels.supports(getattr(torch, dtype), torch.device("cpu"))
    packed = [m.qkv_prepacked for m in fast.model.modules() if isinstance(m, Attention)]
    packed += [m.gate_up_prepacked for m in fast.model.modules() if isinstance(m, MLP)]
    packed += [m.prepacked for name, m in fast.model.named_modules()
               if name.endswith(("o_proj", "down_proj", "lm_head"))]
    assert len(packed) == 4 * fast.model.config.num_hidden_layers + 1  # qkv, gate_up, o, down; lm_head
    assert all((p is not None) == prepacks for p in packed)  # the fast path really ran where it can
    assert all(getattr(m, "prepacked", None) is None and getattr(m, "qkv_prepacked", None) is None
               for m in plain.model.modules())
    # fp32: every greedy sequence identical. bf16: the two paths round differently (attention
    # scores kept in fp32 by the kernel, rounded to bf16 by the matmuls), so a near-tie may flip a
    # token on another CPU's kernels: at most one sequence of 12 may part (none did here), and
    # log-probs agree over the tokens the two share.
    parted = 0
    for a, b in zip(fast_outs, plain_outs):
        same = next((i for i, (x, y) in enumerate(zip(a.output_ids, b.output_ids)) if x != y), len(a.output_ids))
        parted += same < len(a.output_ids)
        shared = slice(0, same + 1)  # the first differing token's log-prob is still of the same context
        gap = (torch.tensor(a.output_token_logprobs[shared]) - torch.tensor(b.output_token_logprobs[shared])).abs()
        assert float(gap.max()) < tolerance
    assert parted <= (1 if dtype == "bfloat16" else 0), f"{parted} of {len(fast_outs)} greedy sequences parted"


def test_prepacked_copies_follow_a_weight_update(folder: Path, tmp_path: Path) -> None:
    other = init_model("qwen3", "tiny", tmp_path / "other", seed=7)
    fast = engine(folder, "float32", True)
    prompt = prompts()[3]

    async def run() -> tuple:
        async with fast:
            request = GenerateRequest(input_ids=prompt, return_logprob=True, sampling_params=SamplingParams(
                temperature=0.0, max_new_tokens=16, ignore_eos=True))
            before = await fast.generate(request)
            await fast.weights.update_from_tensors(load_pretrained(other).state_dict(), weight_version=1)
            return before, await fast.generate(request)

    def trace(out: object) -> tuple[list[int], torch.Tensor]:
        return out.output_ids, torch.tensor(out.output_token_logprobs)  # type: ignore[attr-defined]

    before, after = map(trace, asyncio.run(run()))
    old_model, new_model = (trace(greedy(engine(f, "float32", False), [prompt], 16)[0]) for f in (folder, other))
    for (ids, logprobs), (ref_ids, ref_logprobs) in ((before, old_model), (after, new_model)):
        assert ids == ref_ids and torch.allclose(logprobs, ref_logprobs, atol=1e-5)
    assert not torch.allclose(old_model[1], new_model[1], atol=1e-3)  # the check could not pass by accident


def test_batch_invariant_engines_take_neither_fast_path(folder: Path) -> None:
    config = EngineConfig(kv_cache_mib=8, batch_invariant=True)
    batch_invariant = Engine.from_pretrained(str(folder), config=config)
    assert not batch_invariant.runner.prepack and not batch_invariant.runner.fused


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_rows", "num_queries", "num_positions"), [(16, 1, 48), (4, 7, 32)])
def test_matmul_attention_equals_sdpa(dtype: torch.dtype, num_rows: int, num_queries: int,
                                      num_positions: int) -> None:
    gen = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head_dim = 6, 2, 16
    q_GQNH = torch.randn(num_rows, num_queries, num_heads, head_dim, generator=gen).to(dtype)
    k_KGSH = torch.randn(num_kv_heads, num_rows, num_positions, head_dim, generator=gen).to(dtype)
    v_KGSH = torch.randn(num_kv_heads, num_rows, num_positions, head_dim, generator=gen).to(dtype)
    last_G = torch.randint(num_queries, num_positions, (num_rows,), generator=gen)
    pos_GQ = last_G[:, None] - torch.arange(num_queries - 1, -1, -1)[None]  # each row's queries end at last_G
    mask_GQS = torch.zeros(num_rows, num_queries, num_positions).masked_fill_(
        torch.arange(num_positions)[None, None] > pos_GQ[:, :, None], float("-inf"))
    out = matmul_attention(q_GQNH, k_KGSH, v_KGSH, mask_GQS)
    ref = F.scaled_dot_product_attention(
        q_GQNH.float().transpose(1, 2), k_KGSH.float().transpose(0, 1), v_KGSH.float().transpose(0, 1),
        attn_mask=mask_GQS[:, None], enable_gqa=True).transpose(1, 2)
    assert out.dtype == dtype and out.shape == q_GQNH.shape
    # fp32: the same sums in another order; bf16: scores and probabilities rounded to bf16 once each
    tolerance = 1e-5 if dtype == torch.float32 else 0.05
    assert float((out.float() - ref).abs().max()) < tolerance
