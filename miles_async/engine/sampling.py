"""Sampling parameters (SGLang's names) and the batched sampler of the embedded engine.

`SamplingParams.from_json` checks one request's `sampling_params` object field by field and raises
`ValueError` naming the bad field, which the HTTP server turns into a 400. `sample` draws one
token per row of a batch of logits, each row with its own temperature, top-k, top-p and, when the
request gave `sampling_seed`, its own `torch.Generator`, so a seeded request draws the same tokens
whatever else shares its batch.

Log-probabilities: a sampled token's log-prob is taken under the distribution it was drawn from
(temperature applied, top-k/top-p filtered and renormalised); a greedy token's (temperature 0)
under the model's own distribution, `log_softmax(logits)`, since the degenerate one-hot
distribution would always say 0.

Device: everything runs on the logits' device; generators are made for that device
(`make_generator(seed, device)`: a CUDA generator draws a different stream than a CPU one with the
same seed, so a seeded request repeats its tokens on the same kind of device). Which rows are greedy
is decided on the host, from the parameters, so sampling never reads a tensor back.

Tensor names (STYLE rule 10): R rows (requests sampled this step), V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from miles_async.kernels import cpu_kernels

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
# Fields SGLang accepts that this engine implements only at their neutral value: a request that
# sets one to anything else gets a 400 rather than silently different outputs.
NEUTRAL_FIELDS: dict[str, Any] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "min_new_tokens": 0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
    "logit_bias": None,
    "custom_params": None,
}
# Fields that only shape how text is returned; accepted and ignored (the text is decoded in full).
COSMETIC_FIELDS = ("spaces_between_special_tokens", "no_stop_trim", "stream_interval")


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """One request's sampling parameters, with SGLang's field names and defaults.

    temperature 0 means greedy; top_k -1 means the whole vocabulary; `stop` holds stop strings,
    `stop_token_ids` stop tokens (the tokenizer's EOS also stops unless `ignore_eos`).
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # in the returned text
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_json(cls, obj: Any, vocab_size: int) -> SamplingParams:
        """Check a request's `sampling_params` (a JSON object or None) and build the params."""
        if obj is None:
            return cls()
        if not isinstance(obj, dict):
            raise TypeError(f"sampling_params must be a JSON object, got {type(obj).__name__}")
        fields = {}
        for key, value in obj.items():
            if key in COSMETIC_FIELDS:
                continue
            if key in NEUTRAL_FIELDS:
                if value is not None and value != NEUTRAL_FIELDS[key]:
                    raise ValueError(f"sampling_params.{key}={value!r} is not supported by the embedded engine "
                                     f"(only {NEUTRAL_FIELDS[key]!r}); use a SGLang server for it")
                continue
            if key not in cls.__struct_fields__:
                raise ValueError(f"sampling_params.{key} is not a sampling parameter; known: "
                                 f"{', '.join(cls.__struct_fields__ + tuple(NEUTRAL_FIELDS) + COSMETIC_FIELDS)}")
            if value is not None:  # SGLang treats null as "use the default"
                fields[key] = value
        fields = _normalise_fields(fields)
        try:
            params = msgspec.convert(fields, cls, strict=True)
        except msgspec.ValidationError as e:
            raise ValueError(f"sampling_params: {e}") from None
        params.check(vocab_size)
        return params

    def check(self, vocab_size: int) -> None:
        """Raise `ValueError` naming the first parameter out of its range."""
        if self.max_new_tokens < 0:
            raise ValueError(f"sampling_params.max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            raise ValueError(f"sampling_params.temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling_params.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"sampling_params.top_k must be -1 (whole vocabulary) or >= 1, got {self.top_k}")
        for token_id in self.stop_token_ids:
            if not 0 <= token_id < vocab_size:
                raise ValueError(f"sampling_params.stop_token_ids holds {token_id}, outside the vocabulary "
                                 f"[0, {vocab_size})")
        if any(not s for s in self.stop):
            raise ValueError("sampling_params.stop holds an empty string; every stop string needs a character")
        if self.sampling_seed is not None and not 0 <= self.sampling_seed < 2**63:
            raise ValueError(f"sampling_params.sampling_seed must be in [0, 2**63), got {self.sampling_seed}")


def _normalise_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """SGLang accepts `stop` as one string or a list, and ints for float fields."""
    stop = fields.get("stop")
    if isinstance(stop, str):
        fields["stop"] = [stop]
    for key in ("temperature", "top_p"):
        value = fields.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            fields[key] = float(value)
    return fields


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def sample(
    logits_RV: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    shared_generator: torch.Generator,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; return (token_ids_R, logprobs_R).

    `fused=True` (a CPU engine with the fused kernels, miles_async/kernels/cpu_kernels.py): rows that are all
    greedy take argmax and log-prob in one pass over the logits as they are (bf16 too), equal to
    the eager path's up to the order of a float32 sum.

    Rows with a generator of their own draw their noise from it; the others share one draw from
    `shared_generator`. Sampling uses the exponential race (argmax of p / E, E ~ Exp(1)), which
    draws exactly from p and lets the noise be made per row.
    """
    if fused and params and all(p.greedy for p in params):
        return cpu_kernels.greedy(logits_RV)
    logits_RV = logits_RV.float()
    device = logits_RV.device
    num_rows = logits_RV.shape[0]
    greedy = [i for i, p in enumerate(params) if p.greedy]
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if num_rows == 0:
        return torch.empty(0, dtype=torch.long, device=device), torch.empty(0, dtype=torch.float32, device=device)
    if len(greedy) == num_rows or len(drawn) == num_rows:  # one kind: no copies of [R, V] rows
        return _sample_rows(logits_RV, params, generators, shared_generator)
    tokens_R = torch.empty(num_rows, dtype=torch.long, device=device)
    logprobs_R = torch.empty(num_rows, dtype=torch.float32, device=device)
    for kind in (greedy, drawn):
        rows = torch.tensor(kind, dtype=torch.long, device=device)
        tokens_R[rows], logprobs_R[rows] = _sample_rows(logits_RV[rows], [params[i] for i in kind],
                                                        [generators[i] for i in kind], shared_generator)
    return tokens_R, logprobs_R


def _sample_rows(logits_RV: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None],
                 shared_generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` for rows that are all greedy or all drawn (float32 logits)."""
    if params[0].greedy:
        logp_RV = torch.log_softmax(logits_RV, dim=-1)
        best_R = logp_RV.argmax(dim=-1)
        return best_R, logp_RV.gather(1, best_R[:, None]).squeeze(1)
    logp_RV = filtered_log_probs(logits_RV, params)
    picked_R = race(logp_RV, generators, shared_generator)
    return picked_R, logp_RV.gather(1, picked_R[:, None]).squeeze(1)


def race(logp_RV: torch.Tensor, generators: Sequence[torch.Generator | None],
         shared_generator: torch.Generator) -> torch.Tensor:
    """One token per row drawn from the (unnormalised) distribution exp(logp_RV): the exponential
    race, argmax of log p - log E with E ~ Exp(1), each row's noise from its own generator or the
    shared one."""
    noise_RV = _exponential_noise(logp_RV.shape, generators, shared_generator, logp_RV.device)
    return (logp_RV - noise_RV.log()).argmax(dim=-1)  # log p - log E: the race in log space


def filtered_log_probs(logits_SV: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """log_softmax of logits / temperature after top-k and top-p, per row (-inf where filtered)."""
    device = logits_SV.device
    temps_S1 = torch.tensor([[p.temperature] for p in params], dtype=logits_SV.dtype, device=device)
    scaled_SV = logits_SV / temps_S1
    vocab_size = scaled_SV.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    top_p = [p.top_p for p in params]
    if all(k == vocab_size for k in top_k) and all(p >= 1.0 for p in top_p):
        return torch.log_softmax(scaled_SV, dim=-1)
    sorted_SV, order_SV = scaled_SV.sort(dim=-1, descending=True)
    rank_V = torch.arange(vocab_size, device=device)
    drop_SV = rank_V[None, :] >= torch.tensor(top_k, device=device)[:, None]
    probs_SV = torch.softmax(sorted_SV.masked_fill(drop_SV, float("-inf")), dim=-1)
    mass_before_SV = probs_SV.cumsum(dim=-1) - probs_SV  # keep a token while the mass before it < top_p
    drop_SV |= mass_before_SV >= torch.tensor(top_p, dtype=probs_SV.dtype, device=device)[:, None]
    drop_SV[:, 0] = False
    dropped_SV = torch.zeros_like(drop_SV).scatter_(1, order_SV, drop_SV)
    return torch.log_softmax(scaled_SV.masked_fill(dropped_SV, float("-inf")), dim=-1)


def _exponential_noise(
    shape: torch.Size, generators: Sequence[torch.Generator | None], shared: torch.Generator,
    device: torch.device,
) -> torch.Tensor:
    # Exp(1) as -log(U): torch's CPU `exponential_` took 556 us for [64, 512] here, `rand` 89 us.
    uniform_SV = uniform(shape, generators, shared, device)
    tiny = torch.finfo(uniform_SV.dtype).tiny
    return uniform_SV.clamp_(min=tiny).log_().neg_().clamp_(min=tiny)


def uniform(shape: torch.Size | tuple[int, int], generators: Sequence[torch.Generator | None],
            shared: torch.Generator, device: torch.device | str) -> torch.Tensor:
    """U(0, 1) of `shape` (rows, width): a row with a generator of its own draws from it, the
    others from one draw of `shared`."""
    uniform_SV = torch.empty(shape, device=device)
    own = [i for i, g in enumerate(generators) if g is not None]
    rest = [i for i, g in enumerate(generators) if g is None]
    for i in own:
        torch.rand(shape[1], generator=generators[i], out=uniform_SV[i])
    if rest:
        uniform_SV[rest] = torch.rand(len(rest), shape[1], generator=shared, device=device)
    return uniform_SV
