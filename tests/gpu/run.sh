#!/usr/bin/env bash
# The whole GPU check in one short call: the GPU tests (tests/gpu), then `bench gpu`, in under
# 8 minutes on one GPU (each step under its own `timeout`: 330 s and 150 s). Prints each step's
# time and the total; the bench's JSON goes to $OUT/bench_gpu.json ($OUT: the folder a device
# machine brings back; the current folder without it). Exits 0 where no CUDA GPU is visible (it
# skips), else with the first failing step's status (124: it ran past its timeout).
#
#   tests/gpu/run.sh                      # from anywhere: it runs from the repository's root
#   PYTHON=/opt/venv/bin/python OUT=/tmp/out tests/gpu/run.sh
#
# It uses $PYTHON, else the `python` (or `python3`) on PATH, with the repository on PYTHONPATH, so
# the project need not be installed and nothing is installed here. That Python needs torch built
# with CUDA (and NCCL), pytest, and the project's own dependencies (pyproject.toml's
# [project.dependencies]: pyzmq, msgspec, safetensors, tokenizers, numpy, aiohttp, ...); Triton
# is used where torch brings it, SGLang only by tests/gpu/test_sglang.py, which skips without it,
# and pytest-timeout only for the tests' own timeouts (without it they warn and the step's
# `timeout` bounds them).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$repo"
PYTHON="${PYTHON:-$(command -v python || command -v python3)}"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-.}"
mkdir -p "$out"

if ! cuda="$("$PYTHON" -c 'import torch; print(torch.cuda.is_available())')"; then
    echo "tests/gpu/run.sh: $PYTHON cannot import torch (set PYTHON to a Python that has it)" >&2
    exit 1
fi
if [ "$cuda" != "True" ]; then
    echo "tests/gpu/run.sh: no CUDA GPU visible; skipping"
    exit 0
fi
missing="$("$PYTHON" -c '
import importlib.util
needed = ("pytest", "msgspec", "zmq", "safetensors", "tokenizers", "numpy", "aiohttp")
print(" ".join(name for name in needed if importlib.util.find_spec(name) is None))')"
if [ -n "$missing" ]; then
    echo "tests/gpu/run.sh: $PYTHON lacks $missing (install the project's dependencies and pytest there)" >&2
    exit 1
fi
"$PYTHON" -c 'import torch; print(f"tests/gpu/run.sh: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)")'

status=0
start=$(date +%s%N)

since() {  # seconds since a `date +%s%N`, to a tenth
    local ns=$(( $(date +%s%N) - $1 ))
    printf '%d.%d' $(( ns / 1000000000 )) $(( ns / 100000000 % 10 ))
}

step() {  # step NAME COMMAND...: run it, print its time and status, keep the first failure
    local name="$1" t0 rc=0
    shift
    t0=$(date +%s%N)
    "$@" || rc=$?
    echo "tests/gpu/run.sh: $name: rc=$rc in $(since "$t0") s"
    if [ "$status" -eq 0 ]; then status=$rc; fi
}

step "pytest tests/gpu" timeout 330 "$PYTHON" -m pytest -q -p no:cacheprovider tests/gpu
step "bench gpu" bash -c 'timeout 150 "$1" -m miles_async.bench.gpu --json > "$2/bench_gpu.json"' _ "$PYTHON" "$out"
echo "tests/gpu/run.sh: total $(since "$start") s; bench JSON in $out/bench_gpu.json; rc=$status"
exit "$status"
