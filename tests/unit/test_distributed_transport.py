"""The `distributed` weight transport's own logic (miles_async/actors/distributed.py): rank offsets, the request
fields of each bucket, SGLang's wire from rank 0 over a real gloo group, and what the recipe and the
pusher refuse. The whole path in a run: tests/e2e/test_sglang_attach.py."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from miles_async.actors.distributed import rank_offsets, send_tensors
from miles_async.actors.external import bucket_requests
from miles_async.actors.fleet import resolve_transport
from miles_async.actors.recipe import load_recipe
from miles_async.actors.weights import WeightPusher, WeightSyncConfig
from miles_async.transport.broadcast import layout_of, layout_to_json
from miles_async.transport.groups import WeightGroup

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "reverse.toml"


def test_each_server_gets_a_rank_offset_after_the_pushers_rank_0():
    assert rank_offsets([1]) == ([1], 2)
    assert rank_offsets([2, 1, 4]) == ([1, 3, 4], 8)  # tensor-parallel servers take tp_size ranks each
    with pytest.raises(ValueError, match="at least one rank"):
        rank_offsets([1, 0])


def test_only_the_last_bucket_carries_the_label_and_the_flush():
    buckets = [[("a", torch.zeros(2, 3)), ("b", torch.zeros(4, dtype=torch.bfloat16))], [("c", torch.zeros(1))]]
    requests = bucket_requests(layout_to_json(layout_of(buckets)), "7", flush_cache=True)
    assert requests == [
        {"names": ["a", "b"], "dtypes": ["float32", "bfloat16"], "shapes": [[2, 3], [4]], "flush_cache": False},
        {"names": ["c"], "dtypes": ["float32"], "shapes": [[1]], "flush_cache": True, "weight_version": "7"}]
    assert bucket_requests(layout_to_json(layout_of(buckets)), "8", flush_cache=False)[-1]["flush_cache"] is False
    assert bucket_requests("[]", "1", flush_cache=True) == []


@pytest.mark.timeout(60)
def test_rank_0_sends_one_broadcast_per_tensor_in_order():
    """What an SGLang server receives (receive_weights_from_distributed): one tensor per name, in
    the request's order, each of its own dtype and shape."""
    buckets = [[("a", torch.arange(6.0).view(2, 3)), ("b", torch.arange(4, dtype=torch.int64))],
               [("c", torch.full((5,), 2.5, dtype=torch.bfloat16))]]
    store = WeightGroup.open_store("127.0.0.1", 2, 30)
    received: list[torch.Tensor] = []

    def server() -> None:
        group = WeightGroup.join("127.0.0.1", store.port, 1, 2, name="g", sglang=True, timeout_s=30)
        for _, tensor in (item for bucket in buckets for item in bucket):
            out = torch.empty_like(tensor)
            group.broadcast(out, src=0)
            received.append(out)
        group.close()

    thread = threading.Thread(target=server)
    thread.start()
    group = WeightGroup.join("127.0.0.1", store.port, 0, 2, store=store, name="g", sglang=True, timeout_s=30)
    send_tensors(buckets, group, "cpu")
    thread.join(30)
    group.close()
    assert [t.dtype for t in received] == [torch.float32, torch.int64, torch.bfloat16]
    assert all(torch.equal(a, t) for a, (_, t) in zip(received, (i for b in buckets for i in b)))


def test_auto_stays_disk_for_sglang_and_distributed_is_taken_as_given():
    assert resolve_transport(load_recipe(RECIPE, ["rollout.backend=sglang"])) == "disk"
    assert resolve_transport(load_recipe(RECIPE, ["rollout.backend=sglang", "weights.transport=distributed"])) \
        == "distributed"


@pytest.mark.parametrize(("overrides", "message"), [
    (["rollout.backend=vllm", "weights.transport=distributed"],
     'weights.transport = "distributed" is SGLang\'s weight-update group, for rollout.backend = "sglang"; vllm '
     'engines cannot join it: use "disk"'),
    (["weights.transport=distributed"], 'embedded engines cannot join it: use "broadcast"'),
    (["rollout.backend=sglang", "weights.transport=stream"], '"distributed" for SGLang\'s weight-update group'),
])
def test_the_recipe_refuses_the_distributed_transport_off_sglang_naming_the_fix(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_recipe(RECIPE, overrides)


def test_a_verifying_distributed_pusher_needs_the_model_folder():
    config = WeightSyncConfig(family="qwen3", transport="distributed")
    with pytest.raises(ValueError, match="model_dir is required"):
        WeightPusher(["engine-0"], config)
    WeightPusher(["engine-0"], WeightSyncConfig(family="qwen3", transport="distributed", verify="never"))
