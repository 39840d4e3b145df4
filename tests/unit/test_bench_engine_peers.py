"""The vLLM peer of `miles-async bench engine` is set up at its best before it starts: compiled (its
default), our batch limit as its `--max-num-seqs`, its own core reservation and none, TCMalloc
preloaded where the system has it, and each setting reaches vLLM's command line and environment.
The runs themselves: tests/e2e/test_engine_bench.py."""

from __future__ import annotations

import msgspec

from miles_async.bench.engine import VllmChoice
from miles_async.bench.engine_peers import VllmSettings, vllm_candidates
from miles_async.engine import EngineConfig
from miles_async.engine.vllm import VllmServer, cpu_env, find_tcmalloc
from miles_async.models import init_model


def test_the_candidates_are_compiled_with_our_batch_limit_under_both_placements():
    candidates = vllm_candidates("server", 2, 256, "float32", 2**29)
    assert [c.reserved_cpus for c in candidates] == [None, 0]
    for c in candidates:
        assert c.torch_compile and c.max_num_seqs == 256 and c.threads == 2 and c.kv_cache_bytes == 2**29
        assert c.preload == ((find_tcmalloc(),) if find_tcmalloc() else ())
    config = EngineConfig(max_running_requests=64, dtype="bfloat16")
    own = VllmChoice(placements=("own",)).candidates("offline", 1, config)
    assert [(c.api, c.reserved_cpus, c.max_num_seqs, c.dtype) for c in own] == [("offline", None, 64, "bfloat16")]
    assert not VllmChoice(torch_compile=False).candidates("server", 1, config)[0].torch_compile


def test_the_settings_reach_vllms_command_line_and_environment(tmp_path):
    python = tmp_path / "python"
    python.touch()
    model = init_model("qwen3", "tiny", tmp_path / "m", seed=0)
    compiled = VllmServer(model, port=8123, python=python, threads=2, reserved_cpus=None, torch_compile=True,
                          max_num_seqs=256, preload=("/lib/libtcmalloc_minimal.so.4",))
    argv = compiled.argv()
    assert "--enforce-eager" not in argv and argv[argv.index("--max-num-seqs") + 1] == "256"
    assert compiled.env is not None and compiled.env["VLLM_CPU_OMP_THREADS_BIND"] == "auto"
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in compiled.env and "OMP_NUM_THREADS" not in compiled.env
    assert compiled.env["LD_PRELOAD"].split(":")[0] == "/lib/libtcmalloc_minimal.so.4"
    eager = VllmServer(model, port=8123, python=python, threads=2)
    assert "--enforce-eager" in eager.argv() and "--max-num-seqs" not in eager.argv()
    assert eager.env is not None and "LD_PRELOAD" not in eager.env


def test_cpu_env_keeps_what_the_reservation_asks_for():
    assert cpu_env(2)["OMP_NUM_THREADS"] == "2" and cpu_env(2)["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert cpu_env(2)["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert cpu_env(1, cpus="0")["VLLM_CPU_OMP_THREADS_BIND"] == "0" and "OMP_NUM_THREADS" not in cpu_env(1, cpus="0")
    assert cpu_env(1, reserved_cpus=1)["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    assert cpu_env(1, reserved_cpus=1)["VLLM_CPU_OMP_THREADS_BIND"] == "auto"


def test_the_settings_round_trip_as_the_json_records_them():
    settings = vllm_candidates("offline", 1, 8, "float32", 2**20)[1]
    assert msgspec.convert(msgspec.to_builtins(settings), VllmSettings) == settings
    assert "0 cores reserved, 1 thread(s)" in settings.label() and "compiled" in settings.label()
