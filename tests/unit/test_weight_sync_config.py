"""`WeightSyncConfig` refuses bad recipes with the field and the choices; rdma names its extra."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from miles_async.actors.weights import WeightPusher, WeightSyncConfig


@pytest.mark.parametrize(("fields", "message"), [
    ({"transport": "pigeon"}, "transport='pigeon' is not one of colocated, broadcast, shm, disk, disk_delta, rdma, stream, distributed, auto"),
    ({"verify": "sometimes"}, "verify='sometimes'"),
    ({"pause_mode": "nap"}, "pause_mode='nap'"),
    ({"family": "gpt2"}, "family='gpt2' is not one of llama"),
    ({"bucket_mib": 0}, "bucket_mib must be > 0"),
])
def test_bad_configs_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        WeightSyncConfig(**{"family": "qwen3", **fields})


def test_defaults_are_a_working_recipe():
    cfg = WeightSyncConfig(family="qwen3")
    assert (cfg.transport, cfg.pause_mode, cfg.verify, cfg.bucket_bytes) == ("shm", "in_place", "first", 64 << 20)


@pytest.mark.skipif(importlib.util.find_spec("pyverbs") is not None, reason="pyverbs is installed here")
def test_rdma_without_pyverbs_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyverbs", None)
    with pytest.raises(ImportError, match=r"miles-async\[rdma\]"):
        WeightPusher(["engine"], WeightSyncConfig(family="qwen3", transport="rdma"))


def test_a_pusher_needs_what_a_run_sets():
    # a recipe leaves the family (the model's config.json) and the delta folder (the run folder) to the run
    assert WeightSyncConfig().family == "" and WeightSyncConfig(transport="disk_delta").delta_dir == ""
    with pytest.raises(ValueError, match="WeightSyncConfig.family is empty"):
        WeightPusher(["engine-0"], WeightSyncConfig())
    for transport in ("disk", "disk_delta"):
        with pytest.raises(ValueError, match=f"delta_dir is required for transport '{transport}'"):
            WeightPusher(["engine-0"], WeightSyncConfig(family="qwen3", transport=transport))
    with pytest.raises(ValueError, match='"auto" is a recipe\'s'):  # the run resolves it (Fleet.sync_config)
        WeightPusher(["engine-0"], WeightSyncConfig(family="qwen3", transport="auto"))
