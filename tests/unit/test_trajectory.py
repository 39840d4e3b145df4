"""The one sample record: TokenData's arrays, the Trajectory's metadata, and their wire forms."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import numpy as np
import pytest

from miles_async.runtime import BlobRef
from miles_async.trajectory import TokenData, Trajectory, VersionSpan, decode_data, encode_data, spans_of


def test_token_data_round_trips_its_arrays_and_checks_lengths() -> None:
    data = TokenData.build(tokens=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1], logprobs=[0, 0, -0.5, -0.25],
                           ref_logprobs=[0, 0, -0.75, -1.0])
    assert data.num_tokens == 4
    assert data.token_ids().tolist() == [1, 2, 3, 4] and data.token_ids().dtype == np.dtype("<i4")
    assert data.mask().tolist() == [0, 0, 1, 1]
    assert data.logprob_array().tolist() == [0, 0, -0.5, -0.25]
    assert data.ref_logprob_array().tolist() == [0, 0, -0.75, -1.0]
    assert data.experts() is None
    assert decode_data(encode_data(data)) == data
    assert decode_data(memoryview(encode_data(data))) == data  # what a data-plane read gives
    with pytest.raises(ValueError, match="logprobs has 3 entries for 4 tokens"):
        TokenData.build(tokens=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1], logprobs=[0, 0, 0])


@pytest.mark.parametrize(("max_id", "dtype", "bytes_per_id"), [(127, "uint8", 1), (255, "uint8", 1),
                                                                (256, "int16", 2), (70000, "int32", 4)])
def test_routed_experts_are_kept_in_the_smallest_dtype_that_holds_them(max_id, dtype, bytes_per_id) -> None:
    experts_RLk = np.random.default_rng(0).integers(0, max_id + 1, size=(3, 5, 2))
    experts_RLk[0, 0, 0] = max_id
    data = TokenData.build(tokens=[1, 2, 3, 4], loss_mask=[0, 1, 1, 1], logprobs=[0.0] * 4,
                           routed_experts=experts_RLk)
    assert data.experts_dtype == dtype and data.experts_shape == (5, 2)
    assert len(data.routed_experts) == 3 * 5 * 2 * bytes_per_id  # R3 costs L * k * bytes_per_id a token
    np.testing.assert_array_equal(data.experts(), experts_RLk)
    assert decode_data(encode_data(data)).experts().tolist() == experts_RLk.tolist()


def test_routed_experts_must_cover_every_token_or_all_but_the_last() -> None:
    with pytest.raises(ValueError, match=r"expected \[tokens \(4\) or tokens - 1, 5, 2\]"):
        TokenData.build(tokens=[1, 2, 3, 4], loss_mask=[0, 1, 1, 1], logprobs=[0.0] * 4,
                        routed_experts=np.zeros((2, 5, 2), dtype=np.int32))
    with pytest.raises(ValueError, match="must be \\[tokens, MoE layers, top_k\\]"):
        TokenData.build(tokens=[1, 2], loss_mask=[0, 1], logprobs=[0.0] * 2, routed_experts=np.zeros((2, 5)))


def test_version_spans_give_the_versions_a_sample_saw_in_order() -> None:
    assert spans_of([3, 4], [2, 5], start=7) == (VersionSpan(3, 7, 9), VersionSpan(4, 9, 14))
    assert spans_of([3, 4], [0, 5], start=7) == (VersionSpan(4, 7, 12),)  # no token under 3: no span
    t = Trajectory(prompt_id=1, versions=(VersionSpan(3, 7, 9), VersionSpan(4, 9, 14), VersionSpan(4, 20, 22)))
    assert t.weight_versions == (3, 4) and t.oldest_version == 3
    assert not t.aborted and Trajectory(finish_reason="reward_error").aborted


def test_a_trajectory_carries_its_arrays_inline_or_by_reference_on_every_wire() -> None:
    data = TokenData.build(tokens=[5, 6, 7], loss_mask=[0, 1, 1], logprobs=[0.0, -1.0, -2.0])
    inline = Trajectory(prompt_id=3, index=1, reward=1.0, versions=(VersionSpan(2, 1, 3),), num_tokens=3,
                        num_prompt_tokens=1, num_generated_tokens=2, data=data)
    ref = msgspec.structs.replace(inline, data=BlobRef(owner="ipc:///x.sock", segment="miles-dp-1-ab-0", token=9,
                                                       offset=64, size=123))
    for record in (inline, ref, msgspec.structs.replace(inline, data=None)):
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(record), type=Trajectory) == record
        assert msgspec.json.decode(msgspec.json.encode(record), type=Trajectory) == record  # bytes as base64
    assert len(msgspec.msgpack.encode(ref)) < 300  # a reference, not the arrays (default fields left out)


def test_the_policies_and_the_simulator_pull_in_no_sockets_or_torch() -> None:
    """The pure policies (and the simulator that drives them) use the trajectory record without
    importing ZeroMQ, torch or the actor runtime's system: docs/design.md, who may import whom."""
    code = ("import sys, miles_async.policies, miles_async.sim, miles_async.trajectory\n"
            "print(sorted({'zmq', 'torch', 'miles_async.runtime.system'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
