"""Checksums and the random-fill check (miles_async.transport.verify)."""

from __future__ import annotations

import torch

from miles_async.transport.verify import checksum, checksums, compare, random_fill


def test_checksum_is_exact_in_bits_dtype_and_shape() -> None:
    x = torch.randn(4, 6).to(torch.bfloat16)
    assert checksum(x) == checksum(x.clone())
    assert checksum(x.t()) != checksum(x.t().contiguous().view(4, 6))  # same bytes, different shape
    y = x.clone()
    y.view(torch.int16)[0, 0] ^= 1  # one bit
    assert checksum(y) != checksum(x)
    assert checksum(x.float()) != checksum(x)
    assert checksum(torch.tensor(-0.0)) != checksum(torch.tensor(0.0))


def test_random_fill_then_update_catches_a_dropped_tensor() -> None:
    trainer = {f"w{i}_N": torch.randn(16).to(torch.bfloat16) for i in range(5)}
    engine = {name: torch.zeros_like(t) for name, t in trainer.items()}
    random_fill(engine, seed=1)
    assert all(not torch.equal(engine[n], trainer[n]) for n in trainer)

    def transport(skip: str | None) -> None:  # a toy transport that can "forget" a tensor
        for name, tensor in trainer.items():
            if name != skip:
                engine[name].copy_(tensor)

    transport(skip="w3_N")
    assert compare(checksums(trainer), checksums(engine)) == ["w3_N"]
    transport(skip=None)
    assert compare(checksums(trainer), checksums(engine)) == []


def test_compare_reports_missing_and_extra_names() -> None:
    assert compare({"a": "1", "b": "2"}, {"a": "1", "c": "3"}) == ["b", "c"]


def test_random_fill_is_seeded_and_handles_int_dtypes() -> None:
    a, b = [torch.zeros(8), torch.zeros(3, dtype=torch.int64)], [torch.zeros(8), torch.zeros(3, dtype=torch.int64)]
    random_fill(a, seed=7)
    random_fill(b, seed=7)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
