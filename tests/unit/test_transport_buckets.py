"""Bucketing and the per-family conversion table (miles_async.transport.buckets)."""

from __future__ import annotations

import pytest
import torch

from miles_async.models import FAMILIES
from miles_async.transport.buckets import CONVERTERS, convert, fuse_qkv, split_buckets, split_sizes


def test_buckets_keep_order_and_respect_the_limit() -> None:
    named = {"a": torch.zeros(4), "b": torch.zeros(4), "c": torch.zeros(2), "d": torch.zeros(8)}  # 16, 16, 8, 32 B
    buckets = split_buckets(named, bucket_bytes=32)
    assert [[n for n, _ in b] for b in buckets] == [["a", "b"], ["c"], ["d"]]
    assert [n for b in buckets for n, _ in b] == list(named)
    assert buckets[0][0][1] is named["a"]  # no copies


def test_an_oversized_tensor_travels_alone() -> None:
    sizes = [("small", 10), ("huge", 100), ("tail", 10), ("tail2", 10)]
    assert split_sizes(sizes, 30) == [[("small", 10)], [("huge", 100)], [("tail", 10), ("tail2", 10)]]


def test_bad_inputs_are_named() -> None:
    with pytest.raises(ValueError, match="bucket_bytes"):
        split_sizes([("a", 1)], 0)
    with pytest.raises(ValueError, match="'a' appears twice"):
        split_sizes([("a", 1), ("a", 1)], 10)
    with pytest.raises(ValueError, match="no weight converter for family 'gpt2'"):
        convert("gpt2", {})


def test_every_family_has_an_explicit_converter_and_ours_are_identity() -> None:
    assert set(CONVERTERS) == set(FAMILIES)
    name = "model.layers.0.self_attn.q_proj.weight"
    named = {name: torch.randn(4, 4)}
    for family in FAMILIES:
        out = convert(family, named)
        assert list(out) == [name] and out[name] is named[name]


def test_fuse_qkv_concatenates_rows_and_passes_the_rest_through() -> None:
    p = "model.layers.0.self_attn"
    q_QD, k_KD, v_KD = torch.randn(8, 4), torch.randn(2, 4), torch.randn(2, 4)
    named = {"model.embed_tokens.weight": torch.randn(3, 4), f"{p}.q_proj.weight": q_QD,
             f"{p}.k_proj.weight": k_KD, f"{p}.v_proj.weight": v_KD, f"{p}.q_proj.bias": torch.ones(8),
             f"{p}.k_proj.bias": torch.zeros(2), f"{p}.v_proj.bias": torch.zeros(2), f"{p}.o_proj.weight": torch.eye(4)}
    out = fuse_qkv(named)
    assert list(out) == ["model.embed_tokens.weight", f"{p}.qkv_proj.weight", f"{p}.qkv_proj.bias", f"{p}.o_proj.weight"]
    assert torch.equal(out[f"{p}.qkv_proj.weight"], torch.cat([q_QD, k_KD, v_KD]))
    assert out[f"{p}.qkv_proj.bias"].shape == (12,)
    with pytest.raises(ValueError, match="no matching"):
        fuse_qkv({f"{p}.q_proj.weight": q_QD})
    custom = {**CONVERTERS, "qwen2": fuse_qkv}
    assert f"{p}.qkv_proj.weight" in convert("qwen2", named, custom)
