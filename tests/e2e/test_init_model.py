"""`miles-async init-model` as a real process, and the folder it writes read by transformers: the
model (same logits as ours), the tokenizer (same ids) and the chat template (same text)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles_async.models import FAMILIES, init_model, load_pretrained, load_tokenizer

TIMEOUT_S = 120
MESSAGES = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": "42"},
    {"role": "user", "content": "And 7 * 6?"},
]


def miles_async(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "miles_async.launch.cli", *args],
        check=False, capture_output=True, text=True, timeout=TIMEOUT_S,
    )


@pytest.mark.parametrize("family", ["qwen3", "qwen3-moe"])
def test_cli_writes_a_loadable_folder(tmp_path: Path, family: str) -> None:
    out = tmp_path / "tiny"
    result = miles_async("init-model", "--family", family, "--preset", "tiny", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert str(out) in result.stdout
    model, tokenizer = load_pretrained(out), load_tokenizer(out)
    assert model.config.family == family.replace("-", "_")
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([tokenizer.encode(prompt)]))).all()


def test_cli_names_a_bad_preset(tmp_path: Path) -> None:
    result = miles_async("init-model", "--family", "llama", "--preset", "huge", "--out", str(tmp_path / "x"))
    assert result.returncode == 2
    assert result.stderr.strip() == "miles-async init-model: unknown preset 'huge'; choose one of tiny, small"
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_reads_the_folder(tmp_path: Path, family: str) -> None:
    transformers = pytest.importorskip("transformers", reason="needs the dev extra's transformers")
    folder = init_model(family, "tiny", tmp_path, seed=3)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model, tokenizer = load_pretrained(folder), load_tokenizer(folder)

    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert prompt == hf_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(prompt)
    assert ids == hf_tokenizer.encode(prompt, add_special_tokens=False)
    assert hf_tokenizer.eos_token_id == tokenizer.eos_token_id
    with torch.no_grad():
        torch.testing.assert_close(model(torch.tensor([ids])), hf_model(torch.tensor([ids])).logits,
                                   atol=1e-4, rtol=0)
