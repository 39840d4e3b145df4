"""kernels.batch_invariant: each row's (each query's) result is bit for bit the same whatever else
shares the call, and close to the plain torch op it replaces; the models' switch to it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from miles_async.kernels import batch_invariant as bi
from miles_async.models import CausalLM, DenseCausalAttention
from miles_async.models.random_init import preset_config


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_linear_rows_do_not_depend_on_the_batch():
    g = gen()
    x_MD, w_FD, b_F = torch.randn(300, 64, generator=g), torch.randn(128, 64, generator=g), torch.randn(128, generator=g)
    full_MF = bi.linear(x_MD, w_FD, b_F)
    torch.testing.assert_close(full_MF, F.linear(x_MD, w_FD, b_F))
    for num_rows in (1, 2, 3, 5, 31, 33, 64, 100):
        for offset in (0, 1, 7, 50):
            rows = slice(offset, offset + num_rows)
            assert torch.equal(bi.linear(x_MD[rows], w_FD, b_F), full_MF[rows]), (num_rows, offset)
    assert torch.equal(bi.linear(x_MD[:6].view(2, 3, 64), w_FD)[1, 2], bi.linear(x_MD[5:6], w_FD)[0])
    assert bi.linear(x_MD[:0], w_FD).shape == (0, 128)


def test_silu_does_not_depend_on_where_an_element_falls():
    x = torch.randn(50_000, generator=gen()) * 4
    full = bi.silu(x)
    torch.testing.assert_close(full, F.silu(x))
    for offset in range(0, 40, 3):
        for length in (1, 5, 17, 33, 1000, 20_001):
            assert torch.equal(bi.silu(x[offset:offset + length]), full[offset:offset + length])


def test_token_logprobs_rows_do_not_depend_on_the_batch():
    g = gen()
    logits_TV, targets_T = torch.randn(20, 5000, generator=g), torch.randint(0, 5000, (20,), generator=g)
    full_T = bi.token_logprobs(logits_TV, targets_T)
    torch.testing.assert_close(full_T, F.log_softmax(logits_TV, -1).gather(-1, targets_T[:, None]).squeeze(-1))
    for i in (0, 7, 19):
        assert torch.equal(bi.token_logprobs(logits_TV[i:i + 1], targets_T[i:i + 1]), full_T[i:i + 1])


def reference_attention(q_NQH, k_KSH, v_KSH, positions_Q):
    """SDPA over keys 0..p for each query at position p (float64 for a tight reference)."""
    n, k = q_NQH.shape[0], k_KSH.shape[0]
    sees_QS = torch.arange(k_KSH.shape[1])[None, :] <= positions_Q[:, None]
    return F.scaled_dot_product_attention(
        q_NQH.double(), k_KSH.double().repeat_interleave(n // k, 0), v_KSH.double().repeat_interleave(n // k, 0),
        attn_mask=sees_QS).float()


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (2, 2)])
def test_attention_per_query_does_not_depend_on_layout(num_heads, num_kv_heads):
    g = gen()
    length, head_dim = 150, 16  # three key tiles, the last one partial
    q_NLH = torch.randn(num_heads, length, head_dim, generator=g)
    k_KLH, v_KLH = (torch.randn(num_kv_heads, length, head_dim, generator=g) for _ in range(2))
    positions_L = torch.arange(length)
    # The trainer's way: every query of the sequence in one call.
    full_NLH = bi.attention(q_NLH[None], k_KLH[None], v_KLH[None], positions_L[None])[0]
    torch.testing.assert_close(full_NLH, reference_attention(q_NLH, k_KLH, v_KLH, positions_L), atol=1e-5, rtol=1e-5)
    # The engine's way: one decode query (or a chunk) over keys padded with junk past its position,
    # in a batch with another, longer request.
    for start, count in ((0, 1), (37, 1), (64, 1), (149, 1), (20, 50), (100, 7)):
        padded_keys = length + 40
        k_KSH, v_KSH = (torch.randn(num_kv_heads, padded_keys, head_dim, generator=g) for _ in range(2))
        k_KSH[:, :start + count], v_KSH[:, :start + count] = k_KLH[:, :start + count], v_KLH[:, :start + count]
        other_q = torch.randn(1, num_heads, count, head_dim, generator=g)
        q_2NQH = torch.cat([q_NLH[None, :, start:start + count], other_q])
        other_k = torch.randn(1, num_kv_heads, padded_keys, head_dim, generator=g)
        positions_2Q = torch.stack([torch.arange(start, start + count), torch.arange(count) + 150])
        out_2NQH = bi.attention(q_2NQH, torch.cat([k_KSH[None], other_k]), torch.cat([v_KSH[None], other_k]),
                                positions_2Q)
        assert torch.equal(out_2NQH[0], full_NLH[:, start:start + count]), (start, count)


def test_packed_attention_equals_each_sample_alone():
    g = gen()
    lengths = (5, 70, 33, 130)
    total = sum(lengths)
    q_1TNH = torch.randn(1, total, 4, 16, generator=g)
    k_1TKH, v_1TKH = (torch.randn(1, total, 2, 16, generator=g) for _ in range(2))
    positions_1T = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = DenseCausalAttention(batch_invariant=True)(0, q_1TNH, k_1TKH, v_1TKH, positions_1T)
    torch.testing.assert_close(packed, DenseCausalAttention()(0, q_1TNH, k_1TKH, v_1TKH, positions_1T),
                               atol=1e-5, rtol=1e-5)
    offset = 0
    for n in lengths:
        rows = slice(offset, offset + n)
        alone = DenseCausalAttention(batch_invariant=True)(
            0, q_1TNH[:, rows], k_1TKH[:, rows], v_1TKH[:, rows], torch.arange(n)[None])
        assert torch.equal(packed[:, rows], alone), n
        offset += n


def tiny_model(**kwargs) -> CausalLM:
    model = CausalLM(preset_config("qwen3", "tiny", vocab_size=300), **kwargs)
    g = gen(2)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.3 if param.dim() == 2 else param)
    return model


def test_model_switch_packed_forward_equals_single_forwards_and_default_is_unchanged():
    model = tiny_model()
    g = gen(1)
    seqs = [torch.randint(0, 300, (n,), generator=g) for n in (9, 80, 40)]
    ids_1T = torch.cat(seqs)[None]
    positions_1T = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    with torch.no_grad():
        default_1TV = model(ids_1T, positions_1T)
        model.set_batch_invariant(True)
        packed_1TV = model(ids_1T, positions_1T)
        singles = [model(s[None]) for s in seqs]
        model.set_batch_invariant(False)
        assert torch.equal(model(ids_1T, positions_1T), default_1TV)  # the switch leaves no trace
        assert torch.equal(tiny_model(batch_invariant=True)(ids_1T, positions_1T), packed_1TV)
    torch.testing.assert_close(packed_1TV, default_1TV, atol=1e-4, rtol=1e-4)
    assert torch.equal(packed_1TV[0], torch.cat([s[0] for s in singles]))
