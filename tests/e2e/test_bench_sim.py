"""`miles-async bench sim` runs in-process at a small size and prints one JSON object (no speed asserted)."""

from __future__ import annotations

import json

import pytest

from miles_async.bench import sim as bench_sim

SCENARIO_KEYS = {
    "scenario", "description", "config", "samples_asked", "samples_generated", "samples_trained", "dropped_groups",
    "num_events", "events_per_sample", "sim_s", "sim_s_median", "sim_s_reps", "floor_s", "floor_s_median",
    "floor_s_reps", "floor_heap_size", "ratio_to_bare_heap", "samples_per_s_of_wall", "events_per_s",
    "floor_events_per_s", "simulated_span_s", "simulated_s_per_wall_s", "s_per_100k_generated", "target_s",
    "target_s_scaled", "meets_target",
}


@pytest.mark.timeout(60)
def test_bench_sim_small_prints_both_scenarios_beside_the_bare_heap(capsys):
    assert bench_sim.main(["--engines", "16", "--samples", "3000", "--repeat", "2", "--json"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert result["bench"] == "sim"
    assert result["settings"] == {"engines": 16, "samples": 3000, "repeat": 2, "per_engine_in_flight": 32}
    assert result["machine"]["cpus_allowed"] is None or result["machine"]["cpus_allowed"] >= 1
    assert set(result["scenarios"]) == {"math-8gpu", "agentic-64gpu"}
    for name, run in result["scenarios"].items():
        assert set(run) == SCENARIO_KEYS, name
        config = run["config"]
        assert config["num_engines"] == 16 and config["max_in_flight_per_engine"] == 32
        assert config["target_in_flight"] == 16 * 32 and config["batch_groups"] == 16
        assert config["capacity_groups"] == 4 * 16
        assert run["samples_asked"] == 3000
        assert run["samples_generated"] >= run["samples_trained"] >= 3000, name
        assert run["samples_trained"] == config["num_steps"] * config["batch_groups"] * config["group_size"]
        assert run["num_events"] > run["samples_generated"], name  # at least a start or tick and a finish each
        assert len(run["sim_s_reps"]) == len(run["floor_s_reps"]) == 2
        assert 0 < run["sim_s"] == min(run["sim_s_reps"]) <= run["sim_s_median"], name
        assert 0 < run["floor_s"] == min(run["floor_s_reps"]) <= run["floor_s_median"], name
        # The simulator does everything the bare heap does, and runs the policies and engines besides.
        assert run["ratio_to_bare_heap"] > 1, name
        assert run["samples_per_s_of_wall"] > 0 and run["events_per_s"] > 0 and run["simulated_s_per_wall_s"] > 0
        assert run["target_s"] == 10.0 and run["target_s_scaled"] == pytest.approx(10.0 * 3000 / 100_000)
        assert run["meets_target"] == (run["sim_s"] < run["target_s_scaled"])
    assert result["scenarios"]["agentic-64gpu"]["events_per_sample"] > result["scenarios"]["math-8gpu"][
        "events_per_sample"], "multi-turn episodes take more events per sample"
    assert result["meets_targets"]["all"] == all(r["meets_target"] for r in result["scenarios"].values())
    assert "[bench sim] math-8gpu round 2/2:" in err and "[bench sim] agentic-64gpu round 1/2:" in err


def test_bench_sim_one_scenario_only(capsys):
    assert bench_sim.main(["--engines", "4", "--samples", "200", "--scenario", "math-8gpu", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["scenarios"]) == {"math-8gpu"}
    assert set(result["meets_targets"]) == {"math-8gpu", "all"}


@pytest.mark.parametrize("flags, message", [
    (["--engines", "0"], "--engines must be >= 1, got 0"),
    (["--samples", "-5"], "--samples must be >= 1, got -5"),
    (["--repeat", "0"], "--repeat must be >= 1, got 0"),
    (["--scenario", "nope"], "invalid choice: 'nope'"),
])
def test_bench_sim_rejects_bad_flags_with_a_clear_error(capsys, flags, message):
    with pytest.raises(SystemExit) as exited:
        bench_sim.main(flags)
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""
