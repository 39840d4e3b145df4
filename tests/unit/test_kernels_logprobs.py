"""Chunked log-probs and entropy (miles_async.kernels.logprobs): values and gradients equal the
unchunked reference, and the peak memory of a forward+backward is measured against it.

Tensor names: T tokens, V vocab, D hidden, B batch.
"""

from __future__ import annotations

import pytest
import torch
from _support_memory import peak_allocated_bytes

from miles_async.kernels.logprobs import (
    token_logprobs_from_hidden,
    token_logprobs_from_logits,
    token_logprobs_unchunked,
)


def _inputs(dtype: torch.dtype, num_tokens: int = 300, vocab: int = 5000, hidden: int = 32):
    gen = torch.Generator().manual_seed(0)
    # Logits of a few units, as a trained model's are (std ~2 here).
    hidden_TD = (0.35 * torch.randn(num_tokens, hidden, generator=gen, dtype=dtype)).requires_grad_()
    weight_VD = torch.randn(vocab, hidden, generator=gen, dtype=dtype).requires_grad_()
    targets_T = torch.randint(0, vocab, (num_tokens,), generator=gen)
    # Random upstream gradients for both outputs, so the entropy path's gradient is checked too.
    grad_logp_T = torch.randn(num_tokens, generator=gen, dtype=dtype)
    grad_entropy_T = torch.randn(num_tokens, generator=gen, dtype=dtype)
    return hidden_TD, weight_VD, targets_T, grad_logp_T, grad_entropy_T


# float64 shows the chunked math is the reference's (to rounding); float32 shows the usual fp32 error.
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_from_hidden_matches_unchunked_values_and_gradients(dtype: torch.dtype, tol: float,
                                                           temperature: float) -> None:
    hidden_TD, weight_VD, targets_T, g_logp_T, g_ent_T = _inputs(dtype)
    logp_T, ent_T = token_logprobs_from_hidden(hidden_TD, weight_VD, targets_T, temperature=temperature,
                                               chunk_tokens=64)  # 300 tokens: 4 full chunks + a partial one
    grads = torch.autograd.grad((logp_T * g_logp_T).sum() + (ent_T * g_ent_T).sum(), (hidden_TD, weight_VD))
    ref_logp_T, ref_ent_T = token_logprobs_unchunked(hidden_TD @ weight_VD.T, targets_T, temperature=temperature)
    ref_grads = torch.autograd.grad((ref_logp_T * g_logp_T).sum() + (ref_ent_T * g_ent_T).sum(),
                                    (hidden_TD, weight_VD))
    for got, want in [(logp_T, ref_logp_T), (ent_T, ref_ent_T), *zip(grads, ref_grads)]:
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


# float64 shows the chunked math is the reference's (to rounding); float32 shows the usual fp32 error.
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_from_logits_matches_unchunked_values_and_gradients(dtype: torch.dtype, tol: float) -> None:
    hidden_TD, weight_VD, targets_T, g_logp_T, g_ent_T = _inputs(dtype)
    logits_TV = (hidden_TD @ weight_VD.T).detach().requires_grad_()
    logp_T, ent_T = token_logprobs_from_logits(logits_TV, targets_T, temperature=0.8, chunk_tokens=100)
    (grad_TV,) = torch.autograd.grad((logp_T * g_logp_T).sum() + (ent_T * g_ent_T).sum(), (logits_TV,))
    ref_logp_T, ref_ent_T = token_logprobs_unchunked(logits_TV, targets_T, temperature=0.8)
    (ref_grad_TV,) = torch.autograd.grad((ref_logp_T * g_logp_T).sum() + (ref_ent_T * g_ent_T).sum(),
                                         (logits_TV,))
    for got, want in [(logp_T, ref_logp_T), (ent_T, ref_ent_T), (grad_TV, ref_grad_TV)]:
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_bf16_matmuls_stay_within_bf16_input_rounding_and_restore_the_setting() -> None:
    # The vocabulary matmuls may take bf16 inputs (oneDNN's math mode): results must lie within what
    # rounding every matmul's inputs to bf16 can move them (h and W forward; the logits' gradient,
    # h and W in the two backward matmuls), measured on a float64 reference that rounds just those;
    # logits and log-probs stay float32, and the process-wide setting is back as it was after both
    # passes. On a CPU without native bf16 the matmuls stay fp32 and land well inside the bound.
    hidden_TD, weight_VD, targets_T, g_logp_T, g_ent_T = _inputs(torch.float32)
    settings = torch.backends.mkldnn.matmul
    assert settings.fp32_precision == "none"
    logp_T, ent_T = token_logprobs_from_hidden(hidden_TD, weight_VD, targets_T, chunk_tokens=64, bf16_matmuls=True)
    assert settings.fp32_precision == "none" and logp_T.dtype == torch.float32
    grads = torch.autograd.grad((logp_T * g_logp_T).sum() + (ent_T * g_ent_T).sum(), (hidden_TD, weight_VD))
    assert settings.fp32_precision == "none"

    def reference(h: torch.Tensor, w: torch.Tensor, bf16_inputs: bool) -> list[torch.Tensor]:
        if bf16_inputs:
            h, w = h.bfloat16(), w.bfloat16()
        h, w = h.detach().double(), w.detach().double()
        logits_TV = (h @ w.T).requires_grad_()
        ref_logp_T, ref_ent_T = token_logprobs_unchunked(logits_TV, targets_T)
        (g_logits_TV,) = torch.autograd.grad(
            (ref_logp_T * g_logp_T.double()).sum() + (ref_ent_T * g_ent_T.double()).sum(), (logits_TV,))
        if bf16_inputs:  # the backward matmuls' own input, rounded as oneDNN rounds it
            g_logits_TV = g_logits_TV.float().bfloat16().double()
        return [ref_logp_T, ref_ent_T, g_logits_TV @ w, g_logits_TV.T @ h]

    exact = reference(hidden_TD, weight_VD, bf16_inputs=False)
    rounded = reference(hidden_TD, weight_VD, bf16_inputs=True)
    for got, want, worst in zip([logp_T, ent_T, *grads], exact, rounded):
        # slack: fp32 accumulation, and the few gradient entries whose fp32 value rounds the other
        # way in bf16 (~1e-4 here, against bf16 errors of 1e-2)
        bound = float((worst - want).detach().abs().max()) + 1e-4
        assert float((got.double() - want).detach().abs().max()) <= bound


def test_bfloat16_logits_give_float32_results_close_to_the_reference() -> None:
    hidden_TD, weight_VD, targets_T, _, _ = _inputs(torch.float32)
    logits_TV = (hidden_TD @ weight_VD.T).detach().to(torch.bfloat16).requires_grad_()
    logp_T, ent_T = token_logprobs_from_logits(logits_TV, targets_T, chunk_tokens=64)
    ref_logp_T, _ = token_logprobs_unchunked(logits_TV, targets_T)
    assert logp_T.dtype == ent_T.dtype == torch.float32
    torch.testing.assert_close(logp_T, ref_logp_T, rtol=1e-6, atol=1e-5)
    logp_T.sum().backward()
    assert logits_TV.grad is not None and logits_TV.grad.dtype == torch.bfloat16


def test_leading_dims_are_kept_and_values_are_true_log_probs() -> None:
    gen = torch.Generator().manual_seed(1)
    logits_BTV = torch.randn(2, 5, 7, generator=gen)
    targets_BT = torch.randint(0, 7, (2, 5), generator=gen)
    logp_BT, ent_BT = token_logprobs_from_logits(logits_BTV, targets_BT, chunk_tokens=3)
    assert logp_BT.shape == ent_BT.shape == (2, 5)
    probs_BTV = torch.softmax(logits_BTV, -1)
    torch.testing.assert_close(logp_BT.exp(), probs_BTV.gather(-1, targets_BT[..., None]).squeeze(-1))
    # Uniform logits: entropy is log V for every token.
    _, ent_T = token_logprobs_from_logits(torch.zeros(4, 7), torch.zeros(4, dtype=torch.int64))
    torch.testing.assert_close(ent_T, torch.full((4,), torch.log(torch.tensor(7.0)).item()))


def test_only_one_output_used_in_the_loss_still_backpropagates() -> None:
    hidden_TD, weight_VD, targets_T, _, _ = _inputs(torch.float64, num_tokens=20, vocab=50)
    logp_T, _ = token_logprobs_from_hidden(hidden_TD, weight_VD, targets_T, chunk_tokens=8)
    logp_T.sum().backward()
    ref_logp_T, _ = token_logprobs_unchunked(hidden_TD.detach() @ weight_VD.detach().T, targets_T)
    torch.testing.assert_close(logp_T, ref_logp_T)
    assert hidden_TD.grad is not None and weight_VD.grad is not None
    assert torch.autograd.gradcheck(
        lambda h, w: token_logprobs_from_hidden(h, w, targets_T[:6], chunk_tokens=4, temperature=1.3),
        (hidden_TD[:6].detach().requires_grad_(), weight_VD.detach()[:, :].requires_grad_()))


@pytest.mark.parametrize("bad,match", [
    ({"targets_T": torch.tensor([0, 9])}, r"targets must lie in \[0, 8\)"),
    ({"targets_T": torch.tensor([0, -1])}, r"targets must lie"),
    ({"targets_T": torch.tensor([0.0, 1.0])}, "int64"),
    ({"targets_T": torch.tensor([0, 1, 2])}, "targets shape"),
    ({"temperature": 0.0}, "temperature"),
    ({"chunk_tokens": 0}, "chunk_tokens"),
])
def test_bad_inputs_are_refused_by_name(bad: dict, match: str) -> None:
    kwargs = {"targets_T": torch.tensor([0, 1]), "temperature": 1.0, "chunk_tokens": 4} | bad
    with pytest.raises(ValueError, match=match):
        token_logprobs_from_logits(torch.zeros(2, 8), kwargs.pop("targets_T"), **kwargs)
    with pytest.raises(ValueError, match="weight must be"):
        token_logprobs_from_hidden(torch.zeros(2, 4), torch.zeros(8, 5), torch.tensor([0, 1]))


def test_chunked_peak_memory_is_a_fraction_of_the_unchunked_one() -> None:
    num_tokens, vocab, hidden, chunk_tokens = 512, 100_000, 64, 64
    gen = torch.Generator().manual_seed(0)
    hidden_TD = (0.1 * torch.randn(num_tokens, hidden, generator=gen)).requires_grad_()
    weight_VD = torch.randn(vocab, hidden, generator=gen).requires_grad_()
    targets_T = torch.randint(0, vocab, (num_tokens,), generator=gen)

    def chunked() -> None:
        logp_T, ent_T = token_logprobs_from_hidden(hidden_TD, weight_VD, targets_T, chunk_tokens=chunk_tokens)
        (logp_T.sum() + 0.1 * ent_T.sum()).backward()

    def unchunked() -> None:
        logp_T, ent_T = token_logprobs_unchunked(hidden_TD @ weight_VD.T, targets_T)
        (logp_T.sum() + 0.1 * ent_T.sum()).backward()

    full_fp32_logits_bytes = num_tokens * vocab * 4  # 205 MB
    chunked_peak, unchunked_peak = peak_allocated_bytes(chunked), peak_allocated_bytes(unchunked)
    print(f"peak: chunked {chunked_peak / 1e6:.0f} MB, unchunked {unchunked_peak / 1e6:.0f} MB, "
          f"one fp32 [T, V] {full_fp32_logits_bytes / 1e6:.0f} MB")
    # The chunked pass never holds one full float32 [T, V] tensor (its peak is a few chunk buffers
    # plus the weight's gradient); the unchunked one holds several at once.
    assert chunked_peak < full_fp32_logits_bytes / 2
    assert unchunked_peak > 2 * full_fp32_logits_bytes
    assert chunked_peak * 5 < unchunked_peak
