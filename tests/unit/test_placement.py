"""`[placement]` of a multi-node run: which node runs each engine, and which GPU each engine gets."""

from __future__ import annotations

import os

import pytest

from miles_async.actors.controller import Controller
from miles_async.actors.fleet import Fleet, Node, RunFolder
from miles_async.actors.recipe import load_recipe


def fleet(config, tmp_path, nodes) -> Fleet:
    return Fleet(config, RunFolder(run_dir=tmp_path, model_dir=tmp_path, shared_token="t"), None, nodes)


def test_engines_cycle_over_their_nodes_and_node_0_is_always_in() -> None:
    placement = load_recipe(None, ["placement.engines=[1,2]", "rollout.num_engines=5",
                                   "weights.transport=broadcast"]).placement
    assert [placement.engine_node(i) for i in range(5)] == [1, 2, 1, 2, 1]
    assert placement.nodes == {0, 1, 2}
    assert load_recipe(None, ["placement.scheduler=3", "placement.buffer=4"]).placement.nodes == {0, 3, 4}
    assert load_recipe(None).placement.engine_node(3) == 0  # one node: everything on 0


@pytest.mark.parametrize(("overrides", "message"), [
    (["placement.engines=[1]", "weights.transport=shm"], "needs the engines on the controller's node"),
    (["placement.engines=[-1]"], "placement node ranks must be >= 0"),
    (["placement.trainer=-2"], "placement node ranks must be >= 0"),
    (["placement.scheduler=-1"], "placement node ranks must be >= 0"),
    (["placement.trainer=[0,-1]", "trainer.world_size=2"], "placement node ranks must be >= 0"),
    (["placement.trainer=[0,1,1]", "trainer.world_size=2"], "lists 3 node\\(s\\) but trainer.world_size is 2"),
])
def test_bad_placements_are_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_recipe(None, overrides)


def test_a_placement_beyond_the_nodes_is_refused(tmp_path) -> None:
    config = load_recipe(None, ["placement.engines=[3]", "weights.transport=broadcast"])
    with pytest.raises(ValueError, match=r"node\(s\) \[3\] but the run's nodes are \[0, 1\]"):
        Controller(config, tmp_path, nodes={0: Node(rank=0, host="a", spawner=None), 1: Node(rank=1, host="b",
                                                                                                spawner=None)})


def test_each_engine_gets_a_gpu_of_its_node_after_the_trainer_ranks(tmp_path) -> None:
    config = load_recipe(None, ["trainer.world_size=2", "placement.engines=[0,1]", "weights.transport=broadcast"])
    nodes = {0: Node(rank=0, host="a", spawner=None, num_gpus=4), 1: Node(rank=1, host="b", spawner=None, num_gpus=2),
             2: Node(rank=2, host="c", spawner=None)}
    placed = fleet(config, tmp_path, nodes)
    assert [placed._gpu_env(nodes[0])["CUDA_VISIBLE_DEVICES"] for _ in range(3)] == ["2", "3", "0"]
    assert [placed._gpu_env(nodes[1])["CUDA_VISIBLE_DEVICES"] for _ in range(3)] == ["0", "1", "0"]
    assert placed._gpu_env(nodes[2]) is None  # a CPU node: nothing set


def test_trainer_ranks_spread_over_nodes_get_their_local_rank_address_and_gpus(tmp_path) -> None:
    config = load_recipe(None, ["trainer.world_size=3", "placement.trainer=[1,0,1]", "placement.engines=[1]",
                                "weights.transport=stream"])
    assert config.placement.trainer_nodes(3) == [1, 0, 1] and config.placement.nodes == {0, 1}
    nodes = {0: Node(rank=0, host="10.0.0.1", spawner="spawner-0", num_gpus=8),
             1: Node(rank=1, host="10.0.0.2", spawner="spawner-1", num_gpus=8)}
    placed = fleet(config, tmp_path, nodes)
    ranks = placed._trainer_placement()
    assert [(r.spawner, r.local_rank, r.host) for r in ranks] == [
        ("spawner-1", 0, "10.0.0.2"), ("spawner-0", 0, "10.0.0.1"), ("spawner-1", 1, "10.0.0.2")]
    assert placed._gpu_env(nodes[1]) == {"CUDA_VISIBLE_DEVICES": "2"}  # after ranks 0 and 2 (GPUs 0, 1)
    assert placed._gpu_env(nodes[0]) == {"CUDA_VISIBLE_DEVICES": "1"}
    one = load_recipe(None, ["trainer.world_size=2", "placement.trainer=1"])  # one number: every rank there
    assert one.placement.trainer_nodes(2) == [1, 1]
    ranks = fleet(one, tmp_path, nodes)._trainer_placement()
    # all on one node: their process group stays on that node's loopback (no unauthenticated socket outside)
    assert [(r.spawner, r.local_rank, r.host) for r in ranks] == [("spawner-1", 0, "127.0.0.1"),
                                                                   ("spawner-1", 1, "127.0.0.1")]


def test_a_rank_binds_the_interface_holding_its_node_address(monkeypatch) -> None:
    from miles_async.trainer.fsdp import bind_to, interface_of

    assert interface_of("127.0.0.7") == "lo"  # all of 127/8 is lo's
    assert interface_of("203.0.113.77") is None  # an address no interface here holds
    assert interface_of("node-3") is None
    # setenv first, so that monkeypatch undoes what bind_to sets (a bare delenv of an unset name
    # records nothing, and the worker's later subprocesses inherited GLOO_SOCKET_IFNAME=lo)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "unset")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")  # the user's choice stands
    bind_to("127.0.0.2")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo" and os.environ["NCCL_SOCKET_IFNAME"] == "ib0"


def test_starting_the_processes_stops_at_the_first_failure_and_cancels_the_rest() -> None:
    import asyncio

    from miles_async.actors.fleet import _all_or_none

    cancelled = []

    async def slow() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def fails() -> None:
        await asyncio.sleep(0.01)
        raise RuntimeError("trainer-0 failed to start")

    async def value(x: int) -> int:
        await asyncio.sleep(0.01 * x)
        return x

    async def main() -> list[int]:
        with pytest.raises(RuntimeError, match="trainer-0 failed"):
            await asyncio.wait_for(_all_or_none(slow(), fails(), value(1)), 5)
        assert cancelled == [True]  # the engine still loading is not waited for
        return await _all_or_none(value(3), value(1), value(2))

    assert asyncio.run(main()) == [3, 1, 2]
