"""Packaging: every folder is installed under `miles_async.` and nowhere else (DESIGN.md, "Layout"),
and importing the package stays light."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

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


def test_the_readme_lists_exactly_the_optional_extras() -> None:
    # README's "Optional extras" table once promised extras (megatron, te) that no code used.
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    section = (ROOT / "README.md").read_text().split("## Optional extras", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([\w-]+)` \| `([^`]+)` \|", section, flags=re.MULTILINE)
    assert rows, "README.md: no table rows under '## Optional extras'"
    assert {name: [installs] for name, installs in rows} == {
        name: packages for name, packages in extras.items() if name != "dev"
    }

def test_import_is_light() -> None:
    code = (
        "import sys, miles_async, miles_async.launch.cli\n"
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


def test_wheel_installs_only_miles_async(tmp_path: Path) -> None:
    sources = copy_sources(tmp_path / "src")
    wheels = tmp_path / "wheels"
    pip("wheel", "--no-deps", "--no-build-isolation", "-w", wheels, sources)
    (wheel,) = wheels.glob("miles_async-0.1.0-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"miles_async", "miles_async-0.1.0.dist-info"}
    for module in ("actors/__init__.py", "bench/__init__.py", "launch/cli.py", "sim/__init__.py",
                   "kernels/cpu_kernels.cpp"):  # the C++ source that the engine compiles at first use
        assert f"miles_async/{module}" in names

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
