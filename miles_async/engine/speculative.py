"""Speculative decoding in the embedded engine: the draft head proposes, the policy verifies.

A decoding request whose last token x_n has no KV yet, and which kept the policy's final hidden
state h_{n-1} from its previous step (`Request.draft_hidden`), gets d <= k draft tokens (core.py
schedules d from `EngineConfig.speculative_tokens`, the request's remaining budget and free KV
blocks):

    draft:   g_1 = mtp(h_{n-1}, embed(x_n)),  y_1 ~ q_1 = lm_head(g_1);  g_2 = mtp(g_1, embed(y_1)), ...
    verify:  one policy forward over [x_n, y_1, ..., y_d] at positions n .. n+d (a chunk of d + 1
             tokens, like a prefill chunk, over the paged cache): p_0 .. p_d
    accept:  y_j with probability min(1, p_{j-1}(y_j) / q_j(y_j)), in order, until the first refusal;
             at a refusal at j, the token is drawn from norm(max(0, p_{j-1} - q_j)); when all d are
             accepted, a bonus token from p_d.

This is the standard rejection rule (Leviathan et al. 2023; Chen et al. 2023): every token emitted is
distributed exactly as the policy's sampling distribution at its position (temperature, top-k and
top-p applied to p and to q alike), so nothing downstream can tell the difference. Greedy rows
(temperature 0) draft the head's argmax and keep a draft while it equals the policy's argmax; the
token at the first mismatch is the policy's argmax: the output is the non-speculative greedy output
(bit for bit in batch-invariant mode, where a row's logits do not depend on what shares its
forward; otherwise up to the float rounding any change of batch already brings). The log-prob of
every emitted token is the policy's, computed as the non-speculative sampler computes it
(`sampling.sample` for greedy rows, `filtered_log_probs` for drawn ones), from the verify forward's
logits. A request with its own `sampling_seed` draws from its generator as before, but more draws
per token: its tokens follow the same distribution, not the same sequence as without speculation.

KV: the verify writes KV at all d + 1 positions; the engine keeps as computed x_n and the accepted
drafts (the refused ones' KV is overwritten by the next step's), so the prefix cache, retraction and
pauses see an ordinary request. The kept hidden state is the policy's at the last kept position.

Tensor names (STYLE rule 10): S speculating requests, K drafts (the most of any request this step),
V vocabulary, D hidden.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from miles_async.engine.sampling import SamplingParams, filtered_log_probs, race, sample, uniform

# Adaptive drafting (`EngineConfig.speculative_adaptive`): a request estimates how often the
# policy accepts one of its drafts, from moving sums of the drafts accepted and of the drafts judged
# (a step judges its accepted drafts and the first refused one; those after it are never judged),
# both starting at 1, so that it drafts at once. It drafts all it may while the estimate is at least
# MIN_ACCEPTANCE, and not at all below, except on every PROBE_EVERY-th engine step (all such
# requests at once: one step pays the drafting overhead for them all), so that a draft that gets
# better is followed. Why 0.3: a draft step costs about a third of a decoding step here (the tiny
# model on a CPU), so a draft pays when it passes at least that often.
MIN_ACCEPTANCE = 0.3
PROBE_EVERY = 8
SMOOTHING = 0.3  # the weight of the latest step in the moving sums


def judged(average: tuple[float, float], drafts: int, accepted: int) -> tuple[float, float]:
    """The moving (accepted, judged) sums after a step that drafted `drafts` tokens, `accepted` of them kept."""
    if not drafts:
        return average
    seen = accepted + (accepted < drafts)
    return ((1 - SMOOTHING) * average[0] + SMOOTHING * accepted, (1 - SMOOTHING) * average[1] + SMOOTHING * seen)


def acceptance(average: tuple[float, float]) -> float:
    """The estimated chance that the policy accepts one draft."""
    return average[0] / average[1] if average[1] > 0 else 1.0


@dataclass(frozen=True, slots=True)
class Drafts:
    tokens_SK: torch.Tensor  # the drafted tokens
    logq_SKV: torch.Tensor | None  # the draft's sampling distributions (log), for the drawn rows; None if all greedy


def draft(model: torch.nn.Module, hidden_SD: torch.Tensor, tokens_S: torch.Tensor, num_drafts: int,
          params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
          shared_generator: torch.Generator) -> Drafts:
    """`num_drafts` tokens per row, chained through the model's draft head (`model.mtp`): greedy rows
    take the head's argmax, the others draw from its distribution under their sampling parameters."""
    head, embed, lm_head = model.mtp, model.model.embed_tokens, model.lm_head
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    tokens, logqs = [], []
    for _ in range(num_drafts):
        hidden_SD = head(hidden_SD, embed(tokens_S))
        logits_SV = lm_head(hidden_SD).float()
        if drawn:
            logq_SV = torch.log_softmax(logits_SV, dim=-1)  # greedy rows: unused
            rows = torch.tensor(drawn, dtype=torch.long, device=logits_SV.device)
            logq_SV[rows] = filtered_log_probs(logits_SV[rows], [params[i] for i in drawn])
            tokens_S = logits_SV.argmax(dim=-1)
            tokens_S[rows] = race(logq_SV[rows], [generators[i] for i in drawn], shared_generator)
            logqs.append(logq_SV)
        else:
            tokens_S = logits_SV.argmax(dim=-1)
        tokens.append(tokens_S)
    return Drafts(tokens_SK=torch.stack(tokens, dim=1),
                  logq_SKV=torch.stack(logqs, dim=1) if drawn else None)


@dataclass(frozen=True, slots=True)
class Verdict:
    tokens: list[list[int]]  # per row: the accepted drafts, then one token of the policy's
    logprobs: list[list[float]]  # the policy's log-prob of each (token j came from verify position j)


def verify(logits_SKV: torch.Tensor, drafts: Drafts, num_drafts: Sequence[int], params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None], shared_generator: torch.Generator,
           fused: bool = False) -> Verdict:
    """Accept or refuse each row's drafts against the policy's logits at the K + 1 verify
    positions (`logits_SKV[s, j]`: after x_n and the first j drafts; rows with fewer drafts are
    padded past their own d + 1, and never read there)."""
    num_rows, width, vocab = logits_SKV.shape
    device = logits_SKV.device
    accepted_S = torch.zeros(num_rows, dtype=torch.long, device=device)
    final_S = torch.zeros(num_rows, dtype=torch.long, device=device)
    logp_SK = torch.zeros(num_rows, width, dtype=torch.float32, device=device)  # of the emitted tokens
    limit_SK = torch.arange(width - 1, device=device)[None, :] < torch.tensor(num_drafts, device=device)[:, None]
    greedy = [i for i, p in enumerate(params) if p.greedy]
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if greedy:
        rows = torch.tensor(greedy, dtype=torch.long, device=device)
        flat = logits_SKV[rows].reshape(-1, vocab)
        best, best_logp = sample(flat, [params[i] for i in greedy for _ in range(width)], [None] * flat.shape[0],
                                 shared_generator, fused=fused)  # exactly the non-speculative greedy pick
        best_GK, best_logp_GK = best.view(len(greedy), width), best_logp.view(len(greedy), width)
        match_GK = (drafts.tokens_SK[rows] == best_GK[:, :-1]) & limit_SK[rows]
        accepted_G = match_GK.long().cumprod(dim=1).sum(dim=1)
        accepted_S[rows] = accepted_G
        final_S[rows] = best_GK.gather(1, accepted_G[:, None]).squeeze(1)
        logp_SK[rows] = best_logp_GK.float()
    if drawn:
        assert drafts.logq_SKV is not None, "drawn rows have the draft's distributions"
        rows = torch.tensor(drawn, dtype=torch.long, device=device)
        row_params = [params[i] for i in drawn]
        row_generators = [generators[i] for i in drawn]
        logp_DKV = filtered_log_probs(logits_SKV[rows].float().reshape(-1, vocab),
                                      [p for p in row_params for _ in range(width)]).view(len(drawn), width, vocab)
        logq_DKV = drafts.logq_SKV[rows]
        tokens_DK = drafts.tokens_SK[rows]
        p_DK = logp_DKV[:, :-1].gather(2, tokens_DK[..., None]).squeeze(2)
        q_DK = logq_DKV.gather(2, tokens_DK[..., None]).squeeze(2)
        u_DK = uniform((len(drawn), width - 1), row_generators, shared_generator, device)
        keep_DK = (u_DK.clamp_(min=torch.finfo(torch.float32).tiny).log() + q_DK <= p_DK) & limit_SK[rows]
        accepted_D = keep_DK.long().cumprod(dim=1).sum(dim=1)
        at_D = accepted_D[:, None, None].expand(-1, 1, vocab)
        logp_DV = logp_DKV.gather(1, at_D).squeeze(1)
        # a refusal at j draws from max(0, p - q) at j; past the last draft, p itself (the bonus)
        padded_DKV = torch.cat([logq_DKV, torch.full_like(logq_DKV[:, :1], float("-inf"))], dim=1)
        residual_DV = (logp_DV.exp() - padded_DKV.gather(1, at_D).squeeze(1).exp()).clamp_(min=0)
        empty_D = residual_DV.sum(dim=-1) <= 0  # p == q there: any draw from p is right
        log_residual_DV = torch.where(empty_D[:, None], logp_DV, residual_DV.log())
        final_D = race(log_residual_DV, row_generators, shared_generator)
        accepted_S[rows] = accepted_D
        final_S[rows] = final_D
        emitted_DK = torch.cat([tokens_DK, final_D[:, None]], dim=1)
        emitted_DK.scatter_(1, accepted_D[:, None], final_D[:, None])
        logp_SK[rows] = logp_DKV.gather(2, emitted_DK[..., None]).squeeze(2)
    accepted, finals, logps = accepted_S.tolist(), final_S.tolist(), logp_SK.tolist()
    drafted = drafts.tokens_SK.tolist()
    tokens = [drafted[s][:a] + [finals[s]] for s, a in enumerate(accepted)]
    return Verdict(tokens=tokens, logprobs=[logps[s][:a + 1] for s, a in enumerate(accepted)])
