"""Packaging: every folder is installed under `miles_async.` and nowhere else (docs/design.md, "Layout"),
importing the package stays light, the wheel carries the recipes, their data and the license, and
(slow) the wheel installed with its core dependencies alone into a clean virtualenv runs the main
job from an empty directory."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pyproject.toml gives Python 3.10 tomli, the same parser
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 180


def test_every_package_folder_is_listed_in_pyproject() -> None:
    # The packages are listed by hand (packages.find cannot follow package-dir), so a new
    # subpackage that is not listed would work in the editable install and be missing from wheels.
    setuptools_config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for package, folder in setuptools_config["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            if not any(part.startswith((".", "__")) for part in relative.parts):
                found.add(".".join([package, *relative.parts]))
    listed = set(setuptools_config["packages"])
    assert not found - listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"
    assert not listed - found, (
        f"listed in [tool.setuptools] packages without an __init__.py: {sorted(listed - found)}"
    )


def test_no_python_package_sits_at_the_repository_root() -> None:
    # Anything started in the root of a clone has the root on sys.path, where a package folder
    # shadows the PyPI package of its name: a top-level `kernels/` once broke transformers, which
    # imports Hugging Face's `kernels`. Only miles_async/ and the data-only recipes/ may be packages.
    packages = {path.parent.name for path in ROOT.glob("*/__init__.py")}
    assert packages <= {"miles_async", "recipes"}, f"move under miles_async/: {sorted(packages - {'miles_async', 'recipes'})}"
    assert not {path.name for path in (ROOT / "recipes").glob("*.py")} - {"__init__.py"}


def test_the_extras_page_lists_exactly_the_optional_extras() -> None:
    # A hand-written extras table once promised extras (megatron, te) that no code used.
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    page = ROOT / "docs" / "guides" / "extras.md"
    section = page.read_text().split("## Optional extras", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([\w-]+)` \| (`[^|]+`) \|", section, flags=re.MULTILINE)
    assert rows, f"{page}: no table rows under '## Optional extras'"
    assert {name: re.findall(r"`([^`]+)`", installs) for name, installs in rows} == {
        name: packages for name, packages in extras.items() if name != "dev"
    }

def test_import_is_light() -> None:
    # The command line and what its refusals read (a model folder or Hub id, a recipe's name) come
    # without torch: a bad --model is refused in a fraction of a second, not after torch's import.
    code = (
        "import sys, miles_async, miles_async.launch.cli, miles_async.launch.catalog, miles_async.models.hub\n"
        "from miles_async.models import ModelConfig\n"
        "heavy = sorted({'torch', 'zmq', 'ray'} & set(sys.modules))\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def pip(*args: str | Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", *map(str, args)], check=True, timeout=TIMEOUT_S)


def run_outside(command: list[str | Path], cwd: Path, site: Path) -> subprocess.CompletedProcess[str]:
    # Run from outside the repository, so that its source folders cannot shadow the wheel's.
    return subprocess.run(
        [str(part) for part in command],
        check=False,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=60,
    )


def copy_sources(destination: Path) -> Path:
    # Build from a clean copy: an in-tree build leaves build/ and *.egg-info behind, and files
    # that linger in a stale build/lib would end up in the wheel.
    ignore = shutil.ignore_patterns(".*", "build", "dist", "runs", "*.egg-info", "__pycache__")
    return Path(shutil.copytree(ROOT, destination, ignore=ignore))


def build_wheel(tmp_path: Path) -> Path:
    sources = copy_sources(tmp_path / "src")
    wheels = tmp_path / "wheels"
    pip("wheel", "--no-deps", "--no-build-isolation", "-w", wheels, sources)
    (wheel,) = wheels.glob("miles_async-0.1.0-*.whl")
    return wheel


def test_wheel_installs_only_miles_async(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    archive = zipfile.ZipFile(wheel)
    names = archive.namelist()
    assert {name.split("/")[0] for name in names} == {"miles_async", "miles_async-0.1.0.dist-info"}
    for module in ("actors/__init__.py", "bench/__init__.py", "launch/cli.py", "sim/__init__.py",
                   "kernels/cpu_kernels.cpp"):  # the C++ source that the engine compiles at first use
        assert f"miles_async/{module}" in names
    # Every recipe and every data file a recipe reads ships (`miles-async run reverse` after pip install).
    shipped = {f"miles_async/recipes/{path.relative_to(ROOT / 'recipes')}" for path in (ROOT / "recipes").rglob("*")
               if path.is_file() and path.suffix in (".toml", ".jsonl", ".json", ".parquet")}
    assert "miles_async/recipes/reverse.toml" in shipped and "miles_async/recipes/data/reverse-sft.jsonl" in shipped
    assert shipped <= set(names), sorted(shipped - set(names))
    # The license: the SPDX expression in the metadata (PEP 639) and the file itself.
    metadata = archive.read("miles_async-0.1.0.dist-info/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata.splitlines() and "License-File: LICENSE" in metadata
    license_text = archive.read("miles_async-0.1.0.dist-info/licenses/LICENSE").decode()
    assert license_text == (ROOT / "LICENSE").read_text() and "Apache License" in license_text

    site = tmp_path / "site"
    pip("install", "--no-deps", "--target", site, wheel)
    code = (
        "import miles_async, miles_async.actors, miles_async.launch.cli\n"
        "print(miles_async.__file__, miles_async.actors.__file__, miles_async.launch.cli.__file__)\n"
    )
    result = run_outside([sys.executable, "-c", code], tmp_path, site)
    assert result.returncode == 0, result.stderr
    assert all(path.startswith(str(site)) for path in result.stdout.split()), result.stdout

    result = run_outside([site / "bin" / "miles-async", "--version"], tmp_path, site)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "miles-async 0.1.0"

    result = run_outside([site / "bin" / "miles-async", "recipes"], tmp_path, site)  # from the wheel's own folder
    assert result.returncode == 0, result.stderr
    assert re.search(r"^reverse +run +The main job", result.stdout, re.MULTILINE), result.stdout
    assert f"the files: {site / 'miles_async' / 'recipes'}" in result.stdout


# The core install, as pyproject.toml pins torch for dev.py: its CPU build, never a CUDA one (whose
# libraries are several GB). pip finds it in its configured indexes (here, a wheel on the disk).
CPU_TORCH = "torch==2.13.0+cpu"
# The main job, shortened as tests/e2e/_support_run.py shortens it, for 3 RL steps.
SHORT_RUN = ["sft.max_steps=10", "sft.probe_every=10", "sft.target_accuracy=1.0", "sft.num_probe=8",
             "task.num_prompts=400", "loop.batch_groups=2", "scheduler.group_size=4", "scheduler.target_in_flight=16",
             "buffer.filter=none", "eval.num_prompts=8", "rollout.sampling.max_new_tokens=8", "loop.num_steps=3"]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_wheel_with_its_core_dependencies_runs_the_main_job_from_an_empty_directory(tmp_path: Path) -> None:
    """`python -m venv`, the CPU torch, the wheel (its core dependencies, no extra), then from an
    empty directory `miles-async recipes`, `run reverse --dry-run` and a short `run reverse`. Prints
    the times and the venv's size as JSON (`pytest -s`)."""
    wheel = build_wheel(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=TIMEOUT_S)
    python, started = venv / "bin" / "python", time.monotonic()
    torch = subprocess.run([str(python), "-m", "pip", "-q", "install", CPU_TORCH], check=False, capture_output=True,
                           text=True, timeout=900)
    if torch.returncode != 0:
        pytest.skip(f"{CPU_TORCH} is not in pip's indexes (a CUDA build would pull several GB): {torch.stderr[-300:]}")
    subprocess.run([str(python), "-m", "pip", "-q", "install", str(wheel)], check=True, timeout=900)
    install_s = time.monotonic() - started
    installed = subprocess.run([str(python), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                               check=True, timeout=TIMEOUT_S).stdout.lower()
    for package in ("pytest", "ray", "transformers", "trl", "lm-eval", "openenv", "wandb", "nvidia-"):
        assert package not in installed, f"{package} came with the core install"

    empty = tmp_path / "empty"
    empty.mkdir()
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def miles_async(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(venv / "bin" / "miles-async"), *args], cwd=empty, env=env, capture_output=True,
                              text=True, timeout=timeout_s, check=False)

    listing = miles_async("recipes")
    assert listing.returncode == 0 and re.search(r"^reverse +run", listing.stdout, re.MULTILINE), listing.stderr
    dry = miles_async("run", "reverse", "--dry-run")
    assert dry.returncode == 0 and "[task.config]" in dry.stdout, dry.stderr[-2000:]
    assert list(empty.iterdir()) == []
    started = time.monotonic()
    run = miles_async("run", "reverse", "--out", "run", "--quiet", *SHORT_RUN, timeout_s=600)
    run_s = time.monotonic() - started
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads((empty / "run" / "summary.json").read_text())["num_steps"] == 3
    size = subprocess.run(["du", "-sh", str(venv)], capture_output=True, text=True, check=True).stdout.split()[0]
    print(json.dumps({"core_install_s": round(install_s, 1), "run_reverse_3_steps_s": round(run_s, 1),
                      "core_venv_size": size}))


def test_dev_py_installs_for_the_demo_only_what_the_recipe_needs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """dev.py's choices, without installing: the demo's recipe and whether it asks for SmolLM2, and
    the stamp that tells a core install from a [dev] one (a demo venv used for the tests gets [dev]),
    and the workers `test` gives pytest."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("dev_script", ROOT / "dev.py")
    assert spec is not None and spec.loader is not None
    dev = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "dev_script", dev)  # its dataclasses look their module up there
    spec.loader.exec_module(dev)
    assert dev.demo_recipe([]) == (str(ROOT / "recipes" / "reverse.toml"), [], False)
    assert dev.demo_recipe(["loop.num_steps=3"])[1:] == (["loop.num_steps=3"], False)
    assert dev.demo_recipe(["smollm2-math", "loop.num_steps=3"]) == ("smollm2-math", ["loop.num_steps=3"], True)
    assert dev.demo_recipe(["reverse", "model.pretrained=smollm2"])[2]

    venv = dev.Venv(tmp_path)
    assert dev.installed_parts(venv, "abc") is None
    venv.stamp.write_text("abc\n")  # a stamp from before the parts: those installs had [dev] and SmolLM2
    assert dev.installed_parts(venv, "abc") == {dev.DEV, dev.SMOLLM2_PART}
    venv.stamp.write_text("abc parts=\n")  # a demo's: the core dependencies only
    assert dev.installed_parts(venv, "abc") == set() and dev.installed_parts(venv, "def") is None
    venv.stamp.write_text(f"abc parts={dev.SMOLLM2_PART}\n")
    assert not {dev.DEV} <= dev.installed_parts(venv, "abc")  # the tests would install [dev]
    # `test` spreads the files over one pytest-xdist worker per two cores, unless the arguments choose
    monkeypatch.setattr(dev.os, "cpu_count", lambda: 6)
    assert dev.parallel_options([]) == ["-n", "3", "--dist", "loadfile"]
    monkeypatch.setattr(dev.os, "cpu_count", lambda: 16)
    assert dev.parallel_options(["tests/unit"]) == ["-n", str(dev.WORKERS), "--dist", "loadfile"]
    for chosen in (["-n", "0"], ["-n3"], ["--numprocesses=2"], ["--dist", "load"], ["-p", "no:xdist"]):
        assert dev.parallel_options(["-x", *chosen]) == [], chosen
    monkeypatch.setattr(dev.os, "cpu_count", lambda: 2)
    assert dev.parallel_options([]) == ["-n", "2", "--dist", "loadfile"]  # two cores: two workers still
    monkeypatch.setattr(dev.os, "cpu_count", lambda: 1)
    assert dev.parallel_options([]) == []  # one core: in the pytest process itself


def test_dev_py_editable_installs_take_turns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`tree_lock` (CI sets its four venvs up at once, and each editable install writes
    miles_async.egg-info/ in the tree): a second holder, in another thread, gets the lock only once
    the first has let go; and `setup` takes nothing but --python."""
    import importlib.util
    import threading
    import time

    spec = importlib.util.spec_from_file_location("dev_script", ROOT / "dev.py")
    assert spec is not None and spec.loader is not None
    dev = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "dev_script", dev)
    spec.loader.exec_module(dev)
    monkeypatch.setattr(dev, "ROOT", tmp_path)
    events: list[str] = []
    held = threading.Event()

    def first() -> None:
        with dev.tree_lock():
            events.append("first in")
            held.set()
            time.sleep(0.3)
            events.append("first out")

    thread = threading.Thread(target=first)
    thread.start()
    assert held.wait(10)
    with dev.tree_lock():
        events.append("second in")
    thread.join(10)
    assert events == ["first in", "first out", "second in"]
    with pytest.raises(SystemExit, match="setup takes only --python"):
        dev.main(["setup", "tests/unit"])
