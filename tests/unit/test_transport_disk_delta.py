"""Disk-delta transport (miles_async.transport.disk_delta): exact, checked, ordered, small.

Tensor names: R rows, C columns, N flat elements.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch

from miles_async.transport.disk_delta import apply_delta, write_delta
from miles_async.transport.errors import TransportError
from miles_async.transport.verify import checksums, compare


def _weights(seed: int, shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = shapes or {"model.embed_tokens.weight": (512, 256), "model.layers.0.mlp.up_proj.weight": (1024, 256),
                        "model.layers.0.input_layernorm.weight": (256,)}
    return {name: torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=g) * 0.02
            for name, shape in shapes.items()}


def _step(master: dict[str, torch.Tensor], seed: int, lr: float = 1e-6) -> dict[str, torch.Tensor]:
    """Adam's first step on the fp32 master: lr * sign(gradient) per element, whatever the gradient's scale."""
    g = torch.Generator().manual_seed(seed)
    return {name: w - lr * torch.randn(w.shape, generator=g).sign() for name, w in master.items()}


def _bf16(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.to(torch.bfloat16) for name, t in named.items()}


def _rewrite_payload(folder: Path, blob: bytes) -> None:
    """Put `blob` in place of the payload and make the manifest agree on its length."""
    (folder / "payload.bin").write_bytes(blob)
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**manifest, "payload_bytes": len(blob)}))


def test_bf16_delta_reconstructs_bit_for_bit_and_chains(tmp_path: Path) -> None:
    master_v0 = _weights(0)
    engine = _bf16(master_v0)
    master_v1 = _step(master_v0, seed=1)
    stats = write_delta(tmp_path, engine, master_v1, old_version=0, new_version=1)
    assert stats.folder == tmp_path / "delta_v0_to_v1" and not list(tmp_path.glob(".tmp-*"))
    assert 0 < stats.changed_fraction < 0.06
    assert apply_delta(stats.folder, engine, engine_version=0) == 1
    assert compare(checksums(_bf16(master_v1)), checksums(engine)) == []

    master_v2 = _step(master_v1, seed=2)  # the next version chains on the applied one
    stats2 = write_delta(tmp_path, engine, master_v2, old_version=1, new_version=2, codec="lzma")
    assert apply_delta(stats2.folder, engine, engine_version=1) == 2
    assert compare(checksums(_bf16(master_v2)), checksums(engine)) == []


@pytest.mark.parametrize("codec", ["zlib", "lzma"])
def test_one_adam_step_at_rl_lr_costs_at_most_2_percent_of_the_bf16_weights(tmp_path: Path, codec: str) -> None:
    shapes = {"embed.weight": (2048, 512), "layers.0.mlp.up_proj.weight": (1408, 512),
              "layers.0.mlp.down_proj.weight": (512, 1408), "layers.0.self_attn.q_proj.weight": (512, 512),
              "layers.0.input_layernorm.weight": (512,), "norm.weight": (512,)}
    master = _weights(0, shapes)
    engine = _bf16(master)
    new = _step(master, seed=1)
    stats = write_delta(tmp_path, engine, new, 0, 1, codec=codec)
    print(f"\n{codec}: changed {stats.changed_fraction:.4%} of {stats.num_elements} bf16 elements; payload "
          f"{stats.payload_bytes} B = {stats.payload_fraction:.4%} of {stats.full_bytes} B full weights")
    assert stats.num_elements > 2_000_000
    assert 0.03 < stats.changed_fraction < 0.06  # the step moves a realistic share of elements
    assert stats.payload_fraction <= 0.02  # the target, manifest included
    apply_delta(stats.folder, engine, engine_version=0)
    assert compare(checksums(_bf16(new)), checksums(engine)) == []


def _special_bf16_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """Old and new bf16 tensors with every kind of change the format escapes, and long unchanged runs."""
    g = torch.Generator().manual_seed(3)
    old_N = (torch.randn(5000, generator=g) * 0.02).to(torch.bfloat16)
    new_N = old_N.clone()
    bits_N = new_N.view(torch.int16)
    bits_N[0] += 1  # the very first element, one ulp
    bits_N[1] -= 1
    bits_N[2] += 7  # several ulps
    bits_N[3] += 300  # a step outside int8
    new_N[4] = -old_N[4]  # a sign change: the bit pattern jumps by 0x8000
    new_N[5:9] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0])
    bits_N[9] = 0x7FC1  # a NaN with another payload
    bits_N[4000] += 1  # after a skip of thousands (beyond one byte)
    bits_N[-1] -= 1  # the very last element
    return old_N, new_N


def test_escaped_steps_and_long_skips_reconstruct_exactly(tmp_path: Path) -> None:
    old_N, new_N = _special_bf16_pair()
    nan_old = old_N.clone()
    nan_old[10:20] = float("nan")  # NaN in the base: compared by bits, so NaN -> same NaN is "unchanged"
    old = {"x_N": old_N, "nan_base_N": nan_old, "empty_RC": torch.empty(0, 7, dtype=torch.bfloat16),
           "ints_N": torch.arange(-1000, 1000, dtype=torch.int32), "flags_N": torch.zeros(64, dtype=torch.bool)}
    new_ints = old["ints_N"].clone()
    new_ints[::97] = torch.randint(-2**31, 2**31 - 1, new_ints[::97].shape, generator=torch.Generator().manual_seed(4),
                                   dtype=torch.int32)
    new_flags = old["flags_N"].clone()
    new_flags[[0, 63]] = True
    nan_new = nan_old.clone()
    nan_new[15] = 1.0
    new = {"x_N": new_N, "nan_base_N": nan_new, "empty_RC": torch.empty(0, 7), "ints_N": new_ints,
           "flags_N": new_flags}
    engine = {name: t.clone() for name, t in old.items()}
    for codec in ("zlib", "lzma"):
        engine = {name: t.clone() for name, t in old.items()}
        stats = write_delta(tmp_path, engine, new, 0, 1, codec=codec)
        apply_delta(stats.folder, engine, engine_version=0)
        want = {name: t.to(old[name].dtype) for name, t in new.items()}
        assert compare(checksums(want), checksums(engine)) == []


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn,
                                   torch.int8, torch.uint8, torch.int64, torch.bool])
def test_other_dtypes_and_special_values_round_trip(tmp_path: Path, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    old = {"x_N": (torch.randn(1000, generator=g) * 3).to(dtype)}
    new_N = (torch.randn(1000, generator=g) * 3).to(dtype)
    if dtype.is_floating_point:
        new_N[:3] = torch.tensor([float("nan"), -0.0, float("-inf")]).to(dtype)
    elif dtype == torch.int8:
        old["x_N"][:2], new_N[:2] = torch.tensor([0, -128]), torch.tensor([-128, 127])  # steps -128 and wrap-around
    stats = write_delta(tmp_path, old, {"x_N": new_N}, 0, 1)
    apply_delta(stats.folder, old, engine_version=0)
    assert compare(checksums({"x_N": new_N}), checksums(old)) == []


def test_corrupt_payload_is_detected_and_leaves_the_engine_untouched(tmp_path: Path) -> None:
    engine = _bf16(_weights(0))
    stats = write_delta(tmp_path, engine, _step(_weights(0), seed=1), 0, 1)
    before = checksums(engine)
    blob = (stats.folder / "payload.bin").read_bytes()
    skips_bytes = json.loads((stats.folder / "manifest.json").read_text())["skips_bytes"]
    raw = bytearray(zlib.decompress(blob))
    one_ulp = next(i for i in range(skips_bytes, len(raw)) if raw[i] in (0x01, 0xFF))  # a step of +-1
    # valid zlib, a wrong step (+-1 becomes +-3): only the per-tensor checksum can tell
    raw[one_ulp] ^= 0x02
    _rewrite_payload(stats.folder, zlib.compress(bytes(raw)))
    with pytest.raises(TransportError, match="checksum mismatch"):
        apply_delta(stats.folder, engine, engine_version=0)
    assert checksums(engine) == before

    raw = bytearray(zlib.decompress(blob))
    raw[one_ulp] = 0x80  # an extra escape: every escaped value after it shifts
    _rewrite_payload(stats.folder, zlib.compress(bytes(raw)))
    with pytest.raises(TransportError, match="corrupt"):
        apply_delta(stats.folder, engine, engine_version=0)

    _rewrite_payload(stats.folder, b"\x00" * len(blob))  # garbage bytes of the right length
    with pytest.raises(TransportError, match="cannot read"):
        apply_delta(stats.folder, engine, engine_version=0)
    (stats.folder / "payload.bin").write_bytes(b"\x00" * (len(blob) - 3))  # truncated
    with pytest.raises(TransportError, match="partial"):
        apply_delta(stats.folder, engine, engine_version=0)
    assert checksums(engine) == before


def test_a_delta_on_the_wrong_base_is_refused(tmp_path: Path) -> None:
    engine = _bf16(_weights(0))
    stats = write_delta(tmp_path, engine, _step(_weights(0), seed=1), 0, 1)
    other = _bf16(_weights(5))  # claims version 0 but holds other weights
    before = checksums(other)
    with pytest.raises(TransportError, match="checksum mismatch"):
        apply_delta(stats.folder, other, engine_version=0)
    assert checksums(other) == before


def test_versions_must_follow_the_engines(tmp_path: Path) -> None:
    engine = _bf16(_weights(0))
    stats = write_delta(tmp_path, engine, _step(_weights(0), seed=1), 3, 4)
    with pytest.raises(TransportError, match="not newer than the engine's v5"):
        apply_delta(stats.folder, engine, engine_version=5)
    with pytest.raises(TransportError, match="not newer than the engine's v4"):
        apply_delta(stats.folder, engine, engine_version=4)
    with pytest.raises(TransportError, match="skip versions"):
        apply_delta(stats.folder, engine, engine_version=2)
    with pytest.raises(ValueError, match="must be above"):
        write_delta(tmp_path, engine, engine, 4, 4)
    bad = {**engine, "model.layers.0.input_layernorm.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match="new shape"):
        write_delta(tmp_path, engine, bad, 4, 5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["delta_v3_to_v4"]  # no half-written folder left


def test_missing_or_partial_folder_is_refused(tmp_path: Path) -> None:
    engine = _bf16(_weights(0))
    with pytest.raises(TransportError, match="does not exist"):
        apply_delta(tmp_path / "delta_v0_to_v1", engine, engine_version=0)
    stats = write_delta(tmp_path, engine, _step(_weights(0), seed=1), 0, 1)
    (stats.folder / "manifest.json").unlink()
    with pytest.raises(TransportError, match="partial"):
        apply_delta(stats.folder, engine, engine_version=0)
    stats = write_delta(tmp_path, engine, _step(_weights(0), seed=1), 0, 1)
    fewer = dict(list(engine.items())[:2])
    with pytest.raises(TransportError, match="does not cover"):
        apply_delta(stats.folder, fewer, engine_version=0)
