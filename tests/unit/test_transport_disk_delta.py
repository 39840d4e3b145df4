"""Disk-delta transport (miles_async.transport.disk_delta): exact, checked, ordered.

Tensor names: R rows, C columns.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch

from miles_async.transport.disk_delta import apply_delta, write_delta
from miles_async.transport.errors import TransportError
from miles_async.transport.verify import checksums, compare


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (512, 256), "model.layers.0.mlp.up_proj.weight": (1024, 256),
              "model.layers.0.input_layernorm.weight": (256,)}
    return {name: torch.randn(shape, generator=g) * 0.02 for name, shape in shapes.items()}


def _step(master: dict[str, torch.Tensor], seed: int, lr: float = 1e-6) -> dict[str, torch.Tensor]:
    """An optimizer-like update on the fp32 master copy (Adam's step is ~lr per element)."""
    g = torch.Generator().manual_seed(seed)
    return {name: w - lr * torch.randn(w.shape, generator=g) for name, w in master.items()}


def _bf16(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.to(torch.bfloat16) for name, t in named.items()}


def test_bf16_delta_reconstructs_bit_for_bit_and_is_small(tmp_path: Path) -> None:
    master_v0 = _weights(0)
    engine = _bf16(master_v0)
    master_v1 = _step(master_v0, seed=1)
    stats = write_delta(tmp_path, engine, master_v1, old_version=0, new_version=1)
    assert stats.folder == tmp_path / "delta_v0_to_v1" and not list(tmp_path.glob(".tmp-*"))
    print(f"\nchanged {stats.changed_fraction:.4%} of {stats.num_elements} bf16 elements; "
          f"payload {stats.payload_bytes} B = {stats.payload_fraction:.4%} of {stats.full_bytes} B full weights")
    assert 0 < stats.changed_fraction < 0.05
    assert stats.payload_fraction < 0.10
    assert apply_delta(stats.folder, engine, engine_version=0) == 1
    assert compare(checksums(_bf16(master_v1)), checksums(engine)) == []

    master_v2 = _step(master_v1, seed=2)  # the next version chains on the applied one
    stats2 = write_delta(tmp_path, engine, master_v2, old_version=1, new_version=2, codec="lzma")
    assert apply_delta(stats2.folder, engine, engine_version=1) == 2
    assert compare(checksums(_bf16(master_v2)), checksums(engine)) == []


def test_corrupt_file_is_detected_and_leaves_the_engine_untouched(tmp_path: Path) -> None:
    engine = _bf16(_weights(0))
    stats = write_delta(tmp_path, engine, _step(_weights(0), seed=1), 0, 1)
    before = checksums(engine)
    file = stats.folder / "t00001.bin"
    # valid zlib, wrong values: only the per-tensor checksum can tell
    raw = bytearray(zlib.decompress(file.read_bytes()))
    raw[-1] ^= 0x01
    blob = zlib.compress(bytes(raw))
    manifest = (stats.folder / "manifest.json").read_text()
    old_len = len(file.read_bytes())
    file.write_bytes(blob)
    (stats.folder / "manifest.json").write_text(manifest.replace(f'"file_bytes": {old_len},', f'"file_bytes": {len(blob)},', 1))
    with pytest.raises(TransportError, match="checksum mismatch"):
        apply_delta(stats.folder, engine, engine_version=0)
    assert checksums(engine) == before

    file.write_bytes(b"\x00" * len(blob))  # garbage bytes of the right length
    with pytest.raises(TransportError, match="cannot read"):
        apply_delta(stats.folder, engine, engine_version=0)
    file.write_bytes(blob[:-3])  # truncated
    with pytest.raises(TransportError, match="partial"):
        apply_delta(stats.folder, engine, engine_version=0)
    assert checksums(engine) == before


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


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64, torch.int8, torch.bool])
def test_other_dtypes_and_special_values_round_trip(tmp_path: Path, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    old = {"x_N": (torch.randn(1000, generator=g) * 3).to(dtype)}
    new_N = (torch.randn(1000, generator=g) * 3).to(dtype)
    if dtype.is_floating_point:
        new_N[:3] = torch.tensor([float("nan"), -0.0, float("-inf")], dtype=dtype)
    stats = write_delta(tmp_path, old, {"x_N": new_N}, 0, 1)
    apply_delta(stats.folder, old, engine_version=0)
    assert compare(checksums({"x_N": new_N}), checksums(old)) == []
