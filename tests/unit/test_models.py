"""miles_async.models without transformers: config parsing and its refusals, the attention-backend
contract the engine relies on, packed masks, MoE replay checks, save/load round trips, init_model
and the tokenizer. (Logit parity with transformers is in test_models_parity.py.)

Tensor names: B batch, T tokens, N query heads, K kv heads, H head dim, V vocab.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles_async.models import (
    FAMILIES,
    CausalLM,
    DenseCausalAttention,
    ModelConfig,
    build_tokenizer,
    init_model,
    load_pretrained,
    load_tokenizer,
    save_pretrained,
)
from miles_async.models.attention import AttentionBackend, packed_causal_mask, sample_ids
from miles_async.models.random_init import preset_config

LLAMA_HF = {
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rope_theta": 5000.0,
}


def tiny(family: str) -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(preset_config(family, "tiny", vocab_size=100)).eval()


# --- config -----------------------------------------------------------------------------------


def test_config_reads_the_transformers_4_layout() -> None:
    config = ModelConfig.from_hf({**LLAMA_HF, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert config.head_dim == 8 and config.rope_theta == 5000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert not config.tie_word_embeddings and not config.qk_norm


def test_config_reads_the_transformers_5_layout() -> None:
    hf = {
        **LLAMA_HF,
        "model_type": "qwen3_moe",
        "head_dim": 16,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "mlp_only_layers": [0],
    }
    config = ModelConfig.from_hf(hf)
    assert config.rope_theta == 1e6 and config.rope_scaling is None and config.qk_norm
    assert config.num_experts == 8 and config.moe_layer_indices == (1,)


def test_llama3_rope_defaults_its_original_length() -> None:
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    config = ModelConfig.from_hf({**LLAMA_HF, "max_position_embeddings": 512, "rope_scaling": rope})
    assert config.rope_scaling["original_max_position_embeddings"] == 512


@pytest.mark.parametrize("family", FAMILIES)
def test_config_round_trips_through_hf_json(family: str) -> None:
    config = preset_config(family, "tiny", vocab_size=100)
    assert ModelConfig.from_hf(json.loads(json.dumps(config.to_hf()))) == config


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling type 'dynamic' is not supported"),
        ({"rope_scaling": {"type": "longrope"}}, "rope_scaling type 'longrope' is not supported"),
        ({"rope_scaling": {"rope_type": "linear"}}, "lacks factor"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"use_sliding_window": True}, "sliding-window attention"),
        ({"num_key_value_heads": 3}, "must be a multiple of num_key_value_heads"),
    ],
)
def test_config_refuses_what_it_cannot_run(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**LLAMA_HF, **change})


def test_config_refuses_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no Hugging Face config"):
        ModelConfig.from_hf(tmp_path)


# --- attention --------------------------------------------------------------------------------


def test_sample_ids_and_mask_follow_position_restarts() -> None:
    positions_BT = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    assert sample_ids(positions_BT).tolist() == [[1, 1, 1, 2, 2, 3], [1, 1, 1, 1, 1, 1]]
    # Any break in the run starts a sample, not only a restart at 0 (a chunk that continues one).
    assert sample_ids(torch.tensor([[5, 6, 0, 1, 9, 10]])).tolist() == [[1, 1, 2, 2, 3, 3]]
    mask = packed_causal_mask(positions_BT)[:, 0]
    assert mask[0, 4].tolist() == [False, False, False, True, True, False]
    assert mask[1].equal(torch.ones(6, 6, dtype=torch.bool).tril())
    assert packed_causal_mask(torch.arange(5)[None]) is None  # unpacked rows take SDPA's causal path


def test_the_model_hands_backends_what_the_protocol_says() -> None:
    # The engine's paged-cache backend relies on exactly these calls: one per layer, in order,
    # q [B, T, N, H] and k/v [B, T, K, H] with the caller's positions.
    model = tiny("qwen3")
    calls: list[tuple] = []
    dense = DenseCausalAttention()

    def recording(layer_idx, q_BTNH, k_BTKH, v_BTKH, positions_BT):
        calls.append((layer_idx, q_BTNH.shape, k_BTKH.shape, v_BTKH.shape, positions_BT.tolist()))
        return dense(layer_idx, q_BTNH, k_BTKH, v_BTKH, positions_BT)

    assert isinstance(recording, AttentionBackend)
    ids_BT, positions_BT = torch.tensor([[5, 6, 7]]), torch.tensor([[10, 11, 12]])
    with torch.no_grad():
        logits_BTV = model(ids_BT, positions_BT, attn=recording)
    assert [c[0] for c in calls] == [0, 1]
    n, k, h = model.config.num_attention_heads, model.config.num_key_value_heads, model.config.head_dim
    assert (n, k, h) == (4, 2, 32)  # the tiny preset: grouped queries, vLLM's smallest CPU head size
    assert calls[0][1:] == ((1, 3, n, h), (1, 3, k, h), (1, 3, k, h), [[10, 11, 12]])
    assert logits_BTV.shape == (1, 3, 100)


def test_rope_is_relative() -> None:
    # Shifting every position of a sample leaves its logits unchanged (up to rounding): RoPE sees
    # only distances. It also shows positions_BT reaches the rotary embedding.
    model = tiny("llama")
    ids_BT = torch.tensor([[3, 1, 4, 1, 5, 9]])
    with torch.no_grad():
        base_BTV = model(ids_BT)
        shifted_BTV = model(ids_BT, torch.arange(100, 106)[None])
    torch.testing.assert_close(shifted_BTV, base_BTV, atol=1e-4, rtol=0)


def test_bad_inputs_are_named() -> None:
    model = tiny("qwen3_moe")
    ids_BT = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, tokens\]"):
        model(ids_BT[0])
    with pytest.raises(ValueError, match="positions shape"):
        model(ids_BT, torch.arange(2)[None])
    with pytest.raises(ValueError, match=r"routed_experts shape \(1, 1, 3, 2\)"):
        model(ids_BT, routed_experts=torch.zeros(1, 1, 3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="outside"):
        model(ids_BT, routed_experts=torch.full((2, 1, 3, 2), 8))
    with pytest.raises(ValueError, match="integer tensor"):
        model(ids_BT, routed_experts=torch.zeros(2, 1, 3, 2))


def test_dense_models_ignore_replay_and_return_no_experts() -> None:
    model = tiny("llama")
    ids_BT = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        logits_BTV, experts = model(ids_BT, routed_experts=torch.zeros(1), return_routed_experts=True)
    assert experts is None and logits_BTV.equal(model(ids_BT))


# --- loading and saving -----------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_save_then_load_round_trips(tmp_path: Path, family: str) -> None:
    model = tiny(family)
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path)
    ids_BT = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert loaded(ids_BT).equal(model(ids_BT))


@pytest.mark.parametrize("family", FAMILIES)
def test_load_is_bit_exact_wherever_the_file_puts_the_tensors(tmp_path: Path, family: str) -> None:
    # A tensor lies in the file at 8 + header length + its offset: padding the header by 0-15
    # bytes puts every tensor both 16-byte aligned and not. Weights left as views of the mmapped
    # file at an address not 16-byte aligned made MKL's one-row matmul (one token, or an expert
    # with one token) sum in another order; the loaded model must own aligned copies.
    model = tiny(family)
    save_pretrained(model, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    inputs = [torch.tensor([[7]]), torch.tensor([[1, 2, 3, 4]])]
    with torch.no_grad():
        expected = [model(ids_BT) for ids_BT in inputs]
    for pad in range(16):
        save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt", "pad": "x" * pad})
        loaded = load_pretrained(tmp_path)
        with torch.no_grad():
            for ids_BT, logits_BTV in zip(inputs, expected):
                assert loaded(ids_BT).equal(logits_BTV), f"header padded by {pad} bytes, input {ids_BT.tolist()}"


def test_load_names_missing_and_misshapen_tensors(tmp_path: Path) -> None:
    save_pretrained(tiny("qwen3"), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.q_norm.weight"]
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="missing model.layers.1.self_attn.q_norm.weight"):
        load_pretrained(tmp_path)
    tensors["model.layers.1.self_attn.q_norm.weight"] = torch.ones(32)  # the head size: right again
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(3,\)"):
        load_pretrained(tmp_path)


def test_load_refuses_a_folder_without_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_HF))
    with pytest.raises(ValueError, match="neither model.safetensors nor model.safetensors.index.json"):
        load_pretrained(tmp_path)


# --- init_model and the tokenizer -------------------------------------------------------------


def test_init_model_is_reproducible(tmp_path: Path) -> None:
    first, again, other = (init_model("qwen3", "tiny", tmp_path / name, seed=seed)
                           for name, seed in (("a", 0), ("b", 0), ("c", 1)))

    def read(folder: Path) -> bytes:
        return (folder / "model.safetensors").read_bytes()

    assert read(first) == read(again) != read(other)
    assert (first / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()
    names = {p.name for p in first.iterdir()}
    assert names == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                     "generation_config.json"}


def test_init_model_refuses_bad_names_before_writing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown preset 'huge'; choose one of tiny, small"):
        init_model("qwen3", "huge", tmp_path / "x")
    with pytest.raises(ValueError, match="unknown model family 'gpt2'"):
        init_model("gpt2", "tiny", tmp_path / "x")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("family", FAMILIES)
def test_init_model_folders_load(tmp_path: Path, family: str) -> None:
    folder = init_model(family, "tiny", tmp_path)
    model, tokenizer = load_pretrained(folder), load_tokenizer(folder)
    assert model.config.vocab_size == tokenizer.vocab_size
    with torch.no_grad():
        logits_BTV = model(torch.tensor([tokenizer.encode("What is 2 + 2?")]))
    assert torch.isfinite(logits_BTV).all()


@pytest.mark.parametrize(
    "text",
    ["What is 12 + 30? 42.", "héllo wörld 🙂\n\ttabs  and  spaces", "<|im_start|>user\nhi<|im_end|>\n<think>",
     ""],
)
def test_tokenizer_round_trips_any_text(tmp_path: Path, text: str) -> None:
    init_model("llama", "tiny", tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_tokenizer_specials_and_digits(tmp_path: Path) -> None:
    init_model("qwen2", "tiny", tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    assert [tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert tokenizer.eos_token_id == 2 and tokenizer.pad_token_id == 0 and tokenizer.eos_token_ids == [2, 0]
    ids = tokenizer.encode("<|im_start|>1234<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 6  # one token per digit
    assert tokenizer.decode(tokenizer.encode("<tool_call>x<|im_end|>"), skip_special_tokens=True) == "<tool_call>x"
    assert build_tokenizer().to_str() == build_tokenizer().to_str()


def test_chat_template_renders_chatml_with_tools(tmp_path: Path) -> None:
    init_model("qwen3", "tiny", tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "calc", "arguments": {"expression": "2+2"}}}]},
        {"role": "tool", "content": "4"},
    ]
    tool = {"type": "function", "function": {"name": "calc", "parameters": {}}}
    text = tokenizer.apply_chat_template(messages, tools=[tool], add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '\n{"type": "function", "function": {"name": "calc", "parameters": {}}}\n</tools>' in text
    assert text.endswith(
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
        '{"name": "calc", "arguments": {"expression": "2+2"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    plain = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert plain == "<|im_start|>user\nhi<|im_end|>\n"


def test_load_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        load_tokenizer(tmp_path)
    build_tokenizer().save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="has no chat template"):
        load_tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])


def test_many_short_packed_samples_attend_padded_exactly_as_with_the_block_mask():
    from miles_async.models.attention import DenseCausalAttention, PaddedLayout, sample_starts

    gen = torch.Generator().manual_seed(0)
    lengths = [5, 3, 7, 1, 6, 4, 2, 5]
    positions_BT = torch.cat([torch.arange(n) for n in lengths])[None]
    assert PaddedLayout(sample_starts(positions_BT)).worth_it()
    q, k, v = (torch.randn(1, sum(lengths), 4, 8, generator=gen, requires_grad=True) for _ in range(3))
    padded = DenseCausalAttention()(0, q, k, v, positions_BT)
    mask = packed_causal_mask(positions_BT)
    reference = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask).transpose(1, 2)
    torch.testing.assert_close(padded, reference, atol=1e-6, rtol=1e-5)
    grads = torch.autograd.grad(padded.sum(), (q, k, v))
    reference_grads = torch.autograd.grad(reference.sum(), (q, k, v))
    for got, want in zip(grads, reference_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_shared_prefix_documents_attend_as_each_sample_alone():
    """Two documents: a 4-token trunk with branches of 3, 0 (the sample is the trunk itself) and
    2 tokens, then a lone 5-token sample. Every token's output, and the gradients through them,
    equal those of the samples run one by one."""
    from miles_async.models.attention import DenseCausalAttention, shared_prefix_mask

    gen = torch.Generator().manual_seed(0)
    trunk, branches, lone = 4, [3, 0, 2], 5
    rows = trunk + sum(branches) + lone
    q, k, v = (torch.randn(1, rows, 4, 8, generator=gen, requires_grad=True) for _ in range(3))
    positions = list(range(trunk))
    labels = [0] * trunk
    for b, n in enumerate(branches, start=1):
        positions += range(trunk, trunk + n)
        labels += [b] * n
    positions += range(lone)
    labels += [0] * lone
    positions_BT, branches_BT = torch.tensor([positions]), torch.tensor([labels])
    shared = DenseCausalAttention(branches_BT=branches_BT)(0, q, k, v, positions_BT)

    def alone(rows_idx: list[int]) -> torch.Tensor:
        index = torch.tensor(rows_idx)
        sub = [x[:, index] for x in (q, k, v)]
        return DenseCausalAttention()(0, *sub, torch.arange(len(rows_idx))[None])

    starts = [trunk + sum(branches[:b]) for b in range(len(branches))]
    samples = [list(range(trunk)) + list(range(s, s + n)) for s, n in zip(starts, branches)]
    for sample in samples:  # each branch token (and the trunk) as in its own sample
        torch.testing.assert_close(shared[:, sample], alone(sample), atol=1e-6, rtol=1e-5)
    lone_rows = list(range(rows - lone, rows))
    torch.testing.assert_close(shared[:, lone_rows], alone(lone_rows), atol=1e-6, rtol=1e-5)
    weights = torch.randn(shared.shape, generator=gen)
    grads = torch.autograd.grad((shared * weights).sum(), (q, k, v))
    reference = sum((alone(s) * weights[:, s]).sum() for s in samples[:1]) + \
        sum((alone(s)[:, trunk:] * weights[:, s[trunk:]]).sum() for s in samples[1:]) + \
        (alone(lone_rows) * weights[:, lone_rows]).sum()
    for got, want in zip(grads, torch.autograd.grad(reference, (q, k, v))):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    mask = shared_prefix_mask(torch.tensor([[0, 0, 1, 1, 2, -1]]))[0, 0]
    assert mask.tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                             [1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 1, 0], [1, 1, 0, 0, 0, 1]]
    with pytest.raises(ValueError, match="shared prefixes"):
        DenseCausalAttention(batch_invariant=True, branches_BT=branches_BT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_grouped_matmul_attention_equals_sdpa_with_gradients(dtype: torch.dtype, masked: bool) -> None:
    """The bf16 CPU training path (query heads grouped per kv head, fp32 scores) against SDPA on
    expanded kv heads, forward and gradients; the masks are shared-prefix documents."""
    from miles_async.models.attention import expand_kv, grouped_matmul_attention, shared_prefix_mask

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 6, 7, 16, generator=gen).to(dtype).requires_grad_()
    k, v = (torch.randn(3, 2, 7, 16, generator=gen).to(dtype).requires_grad_() for _ in range(2))
    mask = shared_prefix_mask(torch.tensor([[0, 0, 1, 1, 2, 2, -1]] * 3)) if masked else None
    out = grouped_matmul_attention(q, k, v, mask)
    expanded = [expand_kv(x.transpose(1, 2), 6).transpose(1, 2) for x in (k, v)]
    reference = torch.nn.functional.scaled_dot_product_attention(
        q.float(), expanded[0].float(), expanded[1].float(), attn_mask=mask, is_causal=mask is None)
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    torch.testing.assert_close(out.float(), reference, **tolerance)
    weights = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad((out.float() * weights).sum(), (q, k, v))
    reference_grads = torch.autograd.grad((reference * weights).sum(), (q, k, v))
    for got, want in zip(grads, reference_grads):
        torch.testing.assert_close(got.float(), want.float(), **tolerance)


def test_dense_attention_under_cpu_autocast_matches_fp32() -> None:
    """Padded packed samples under bf16 autocast take the grouped matmul path; the result is the
    fp32 attention's within bf16 rounding."""
    from miles_async.models.attention import DenseCausalAttention

    gen = torch.Generator().manual_seed(0)
    lengths = [5, 3, 7, 1, 6, 4, 2, 5]
    positions_BT = torch.cat([torch.arange(n) for n in lengths])[None]
    q = torch.randn(1, sum(lengths), 4, 8, generator=gen)
    k, v = (torch.randn(1, sum(lengths), 2, 8, generator=gen) for _ in range(2))
    exact = DenseCausalAttention()(0, q, k, v, positions_BT)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = DenseCausalAttention()(0, q, k, v, positions_BT)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), exact, atol=3e-2, rtol=3e-2)
