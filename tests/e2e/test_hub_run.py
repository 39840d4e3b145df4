"""A model named by Hugging Face id, end to end: `miles-async run` and `miles-async serve engine`.

The tiny random model is placed in a Hugging Face cache under tmp_path as huggingface_hub's
downloads leave it (tests/unit/_support_hub.py); the real commands run as subprocesses with
HF_HOME pointing there and HF_HUB_OFFLINE=1, so the real huggingface_hub resolves `org/tiny`
from the cache as it would on a machine with no network.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from _support_run import SHORT

from miles_async.models import init_model
from tests.unit._support_hub import place_in_hub_cache

pytestmark = pytest.mark.slow
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "reverse.toml"


@pytest.fixture
def hub_home(tmp_path) -> tuple[dict[str, str], Path]:
    """(the environment of a command that finds org/tiny offline in HF_HOME, the snapshot folder)."""
    home = tmp_path / "hf-home"
    commit = place_in_hub_cache(home / "hub", "org/tiny", init_model("qwen3", "tiny", tmp_path / "tiny", seed=0))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env |= {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    return env, home / "hub" / "models--org--tiny" / "snapshots" / commit


def cli(args: list[str], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "miles_async.launch.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout_s, check=False)


@pytest.mark.timeout(150)
def test_the_main_job_and_the_engine_server_take_a_model_by_its_hub_id(hub_home, tmp_path):
    env, snapshot = hub_home
    out = tmp_path / "run"
    done = cli(["run", str(RECIPE), "--out", str(out), *SHORT, "sft.max_steps=0", "eval.mode=none",
                "loop.num_steps=2", 'model.path="org/tiny"', 'model.revision="main"'], env, timeout_s=110)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"model org/tiny at revision {snapshot.name} ({snapshot})" in done.stderr
    assert json.loads((out / "summary.json").read_text())["num_steps"] == 2
    recorded = json.loads((out / "config.json").read_text())["model"]
    assert recorded["path"] == "org/tiny" and recorded["revision"] == snapshot.name  # the commit, not "main"
    assert not (out / "model").exists()  # the run made no model of its own
    bad = cli(["run", str(RECIPE), "--out", str(tmp_path / "bad"), 'model.path="org/absent"'], env, timeout_s=60)
    assert bad.returncode == 2 and "model.path 'org/absent'" in bad.stderr and "HF_HUB_OFFLINE=1" in bad.stderr
    assert "Traceback" not in bad.stderr, bad.stderr[-3000:]

    process = subprocess.Popen([sys.executable, "-m", "miles_async.launch.cli", "serve", "engine", "--model", "org/tiny",
                                "--revision", snapshot.name, "--port", "0", "--kv-cache-mib", "4"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = process.stdout.readline()  # printed once listening
        assert "serving" in line, process.stderr.read() if process.poll() is not None else line
        url = line.rsplit(" on ", 1)[1].strip()
        with urllib.request.urlopen(f"{url}/get_model_info", timeout=30) as response:
            assert json.load(response)["model_path"] == str(snapshot)
    finally:
        process.terminate()
        process.communicate(timeout=30)
    bad = cli(["serve", "engine", "--model", "org/tiny", "--revision", "v9"], env, timeout_s=30)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--revision 'v9'" in bad.stderr, bad.stderr
