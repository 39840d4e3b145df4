"""The fused CPU kernels (miles_async/kernels/cpu_kernels.py) against the eager torch code they replace.

Stated tolerances: rotary bit for bit in bf16 (every intermediate rounded where the eager code
rounds), RMSNorm within one bf16 unit in the last place (bit for bit here), both within 1e-5 in
fp32 (a sum in another order); attention over the paged blocks
within 1e-5 (fp32) and 0.01 (bf16 output rounding) of SDPA over the same keys, gathered, and its
KV write equal to `index_copy_`'s; silu(gate) * up within 1e-6 (fp32) or equal but for one in a
thousand elements at most, one bf16 unit apart (bf16). Without a compiler the engine falls back to its torch ops, which a subprocess checks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from miles_async.kernels import cpu_kernels
from miles_async.models.rope import apply_rotary
from miles_async.models.transformer import RMSNorm

CPU = torch.device("cpu")
needs_kernels = pytest.mark.skipif(not cpu_kernels.supports(torch.float32, CPU),
                                   reason=f"fused CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 0.0)]


def test_the_kernels_build_wherever_there_is_a_compiler() -> None:
    # The other tests here skip where the kernels are unavailable; a compiler that fails on the
    # source must fail this one instead of skipping them.
    if os.environ.get("MILES_ASYNC_CPU_KERNELS", "1") == "0":
        pytest.skip("MILES_ASYNC_CPU_KERNELS=0")
    if not (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")):
        pytest.skip("no C++ compiler on this machine")
    assert cpu_kernels.library() is not None, cpu_kernels.unavailable_reason()


@needs_kernels
# bf16: one unit in the last place at most (identical here; the fp32 mean of the squares is a sum
# whose order follows the CPU's vector width, so on another CPU an output can round the other way)
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2**-7)])
def test_rms_norm_matches_the_module(dtype: torch.dtype, tolerance: float) -> None:
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=gen))
        x = (torch.randn(2, 7, 96, generator=gen) * 4).to(dtype)
        fused, eager = cpu_kernels.rms_norm(x, norm.weight, norm.eps), norm(x)
    assert fused.dtype == dtype and fused.shape == x.shape
    assert torch.allclose(fused.float(), eager.float(), rtol=tolerance, atol=0.0)


@needs_kernels
@pytest.mark.parametrize(("dtype", "tolerance"), DTYPES)
def test_rotary_matches_apply_rotary(dtype: torch.dtype, tolerance: float) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 5, 6, 32, generator=gen).to(dtype)[:, :, :3]  # a non-contiguous view, as q/k can be
    cos, sin = (torch.randn(1, 5, 32, generator=gen).to(dtype) for _ in range(2))
    fused, eager = cpu_kernels.rotary(x, cos, sin), apply_rotary(x, cos, sin)
    assert torch.equal(fused, eager) if tolerance == 0.0 else torch.allclose(fused, eager, atol=tolerance)


@needs_kernels
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 0.01)])
# head dim 16: the portable loops; 64 and 128: the AVX-512 kernel where the CPU has AVX-512 BF16
# (else the portable ones again). 9 heads over 3 kv heads (GQA, SmolLM2's), 4 over 4 (MHA).
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"),
                         [(6, 2, 16, 4), (9, 3, 64, 16), (4, 4, 128, 8)])
def test_paged_attention_matches_sdpa_over_the_gathered_keys(dtype: torch.dtype, tolerance: float, num_heads: int,
                                                             num_kv_heads: int, head_dim: int,
                                                             block_size: int) -> None:
    gen = torch.Generator().manual_seed(2)
    width, num_blocks = 5, 40
    k_blocks, v_blocks = (torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
                          for _ in range(2))
    positions = width * block_size
    # One key, a full block, just past one, 16 and 17 keys (the vector kernel's tiles), the whole
    # table; rows 6-8 are a prompt chunk: one request's consecutive tokens over one table.
    lengths = torch.tensor([1, block_size, block_size + 1, 16, 17, positions, 5, 6, 7])
    num_requests = lengths.numel()
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in range(num_requests)])
    tables[7:] = tables[6]
    q = torch.randn(num_requests + 3, num_heads, head_dim, generator=gen).to(dtype)  # packed rows, some not ours
    q_rows = torch.randperm(num_requests + 3, generator=gen)[:num_requests]
    out_rows = torch.randperm(num_requests + 3, generator=gen)[:num_requests]
    out = torch.full_like(q, 7.0)
    cpu_kernels.paged_attention(q, q_rows, k_blocks, v_blocks, tables, lengths, out, out_rows, head_dim ** -0.5)

    k_KGSH = k_blocks[:, tables.flatten()].reshape(num_kv_heads, num_requests, positions, head_dim).float()
    v_KGSH = v_blocks[:, tables.flatten()].reshape(num_kv_heads, num_requests, positions, head_dim).float()
    sees = torch.arange(positions)[None, None, None] < lengths[:, None, None, None]
    expected = F.scaled_dot_product_attention(q[q_rows].float()[:, :, None], k_KGSH.transpose(0, 1),
                                              v_KGSH.transpose(0, 1), attn_mask=sees, enable_gqa=True)[:, :, 0]
    assert float((out[out_rows].float() - expected).abs().max()) < tolerance
    untouched = torch.ones(num_requests + 3, dtype=torch.bool)
    untouched[out_rows] = False
    assert bool((out[untouched] == 7.0).all())  # only the output rows are written


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_writes_the_new_keys_and_values_first(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    num_kv_heads, num_heads, head_dim, num_blocks, block_size = 3, 9, 64, 12, 16
    k_blocks, v_blocks = (torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
                          for _ in range(2))
    qkv = torch.randn(5, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)  # one matmul's rows
    q, k_new, v_new = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    q = q.contiguous().view(5, num_heads, head_dim)
    k_new = k_new.contiguous().view(5, num_kv_heads, head_dim)  # contiguous, as rotary leaves it
    v_new = v_new.view(5, num_kv_heads, head_dim)  # a view with the qkv row's stride
    slots = torch.tensor([3, 17, 18, 19, 150])  # flat positions: block 0, block 1, ..., block 9
    tables = torch.tensor([[0, 1, 2], [0, 1, 2], [0, 1, 2], [0, 1, 2], [8, 9, 10]])
    lengths = torch.tensor([4, 18, 19, 20, 23])
    rows = torch.arange(5)
    expected_k, expected_v = k_blocks.clone(), v_blocks.clone()
    expected_k.view(num_kv_heads, -1, head_dim).index_copy_(1, slots, k_new.transpose(0, 1))
    expected_v.view(num_kv_heads, -1, head_dim).index_copy_(1, slots, v_new.transpose(0, 1))
    expected_out = torch.empty_like(q)
    cpu_kernels.paged_attention(q, rows, expected_k, expected_v, tables, lengths, expected_out, rows, 0.125)

    out = torch.empty_like(q)
    cpu_kernels.paged_attention(q, rows, k_blocks, v_blocks, tables, lengths, out, rows, 0.125,
                                new_kv=(k_new, v_new, slots))
    assert torch.equal(k_blocks, expected_k) and torch.equal(v_blocks, expected_v)
    assert torch.equal(out, expected_out)
    with pytest.raises(ValueError, match="dtype"):
        cpu_kernels.paged_attention(q, rows, k_blocks, v_blocks, tables, lengths, out, rows, 0.125,
                                    new_kv=(k_new.double(), v_new, slots))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_silu_of_gate_times_up(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    gate_up = (torch.randn(7, 2 * 1536, generator=gen) * 4).to(dtype)
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 30.0, -30.0, 100.0, -100.0, 1e-30, -1e-30]).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    got = cpu_kernels.silu_mul(gate_up)
    assert got.shape == expected.shape and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-30)
    else:  # silu rounded to bf16 before the product, as eager: equal but where e^x's last bits tip a rounding
        differs = got != expected
        assert int(differs.sum()) <= got.numel() // 1000
        torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=0.0)


def test_without_a_compiler_the_kernels_say_why_and_the_engine_runs_plain_torch(tmp_path: Path) -> None:
    code = (
        "import asyncio, torch\n"
        "from miles_async.kernels import cpu_kernels\n"
        "from miles_async.engine import Engine, EngineConfig, GenerateRequest, SamplingParams\n"
        "from miles_async.models import init_model\n"
        "assert cpu_kernels.library() is None and not cpu_kernels.supports(torch.float32, torch.device('cpu'))\n"
        "print(cpu_kernels.unavailable_reason())\n"
        f"engine = Engine.from_pretrained(str(init_model('qwen3', 'tiny', {str(tmp_path / 'm')!r}, seed=0)),\n"
        "                                config=EngineConfig(kv_cache_mib=8))\n"
        "assert not engine.runner.fused\n"
        "async def main():\n"
        "    async with engine:\n"
        "        out = await engine.generate(GenerateRequest(input_ids=[5, 6, 7], sampling_params=SamplingParams(\n"
        "            temperature=0.0, max_new_tokens=4, ignore_eos=True)))\n"
        "        assert len(out.output_ids) == 4\n"
        "asyncio.run(main())\n"
    )
    env = {**os.environ, "CXX": "/bin/false", "MILES_ASYNC_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "/bin/false failed" in done.stdout
    assert "fused CPU kernels unavailable" in done.stderr  # said once, in the log


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_picks_the_first_maximum_with_the_log_softmax_log_prob(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 5003, generator=gen) * 5).to(dtype)  # a vocabulary not a multiple of a chunk
    logits[1, 100] = logits[1, 4000] = logits[1].max() + 1  # a tie: the first index wins, as torch.argmax
    logits[2, -1] = logits[2].max() + 1  # the maximum in the last, partial chunk
    tokens, logprobs = cpu_kernels.greedy(logits)
    expected = torch.log_softmax(logits.float(), dim=-1)
    best = expected.argmax(dim=-1)
    assert torch.equal(tokens, best) and tokens[1] == 100 and tokens[2] == 5002
    assert float((logprobs - expected.gather(1, best[:, None])[:, 0]).abs().max()) < 2e-5
