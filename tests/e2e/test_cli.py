"""The `miles-async` command line, run as a real process: help, version, hand-offs, and bad input
refused with a clear message and status 2 rather than a traceback."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from miles_async import bench
from miles_async.launch import cli

TIMEOUT_S = 60


def miles_async(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "miles_async.launch.cli", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def test_help_lists_every_verb() -> None:
    result = miles_async("--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: miles-async")
    for verb in ("run", "sft", "launch", "serve", "sim", "bench", "init-model", "plot"):
        assert verb in result.stdout


def test_version() -> None:
    result = miles_async("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "miles-async 0.1.0"


@pytest.mark.parametrize(
    "verb",
    ["run", "sft", "launch", "serve", "serve engine", "serve session", "sim", "bench", "init-model", "plot"],
)
def test_help_of_each_verb(verb: str) -> None:
    result = miles_async(*verb.split(), "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: miles-async {verb}")


@pytest.mark.parametrize(("command_line", "message"), [
    ("run nowhere.toml --out runs/x", "miles-async run: recipe nowhere.toml does not exist"),
    ("run nowhere.toml loop.num_stepz=3", "does not exist"),
    ("run nowhere.toml --resume", "--resume needs --out DIR"),
    ("sft nowhere.toml --out runs/x", "miles-async sft: recipe nowhere.toml does not exist"),
    ("sft nowhere.toml --resume", "miles-async sft: --resume needs --out DIR"),
    ("plot no/such/run", "miles-async plot:"),
    ("sim no/such/trace.jsonl", "miles-async sim:"),
    ("launch --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 recipe.toml",
     "miles-async launch: recipe recipe.toml does not exist"),
    ("launch --nnodes 2 --node-rank 2 --master-addr 10.0.0.1 --master-port 29500 recipe.toml",
     "--node-rank 2 is outside 0..1"),
    ("sim", "miles-async sim: give a TRACE.jsonl to replay, or --synthetic NAME"),
    ("serve session --engine http://127.0.0.1:9", "cannot ask http://127.0.0.1:9 for its model"),
    ("serve session --engine http://127.0.0.1:9 --model no/such/dir", "cannot read the tokenizer"),
])
def test_run_and_plot_refuse_bad_input_clearly(command_line: str, message: str) -> None:
    result = miles_async(*command_line.split())
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_unknown_argument_is_an_error() -> None:
    result = miles_async("plot", "runs/x", "--bogus")
    assert result.returncode == 2
    assert "unrecognized arguments: --bogus" in result.stderr


@pytest.mark.parametrize("verb", [["run", "r.toml"], ["launch", "--nnodes", "1", "--node-rank", "0", "--master-addr",
                                                  "127.0.0.1", "--master-port", "1", "r.toml"]])
def test_max_restarts_is_a_count(verb: list[str]) -> None:
    assert cli.build_parser().parse_args([*verb, "--max-restarts", "2"]).max_restarts == 2
    assert cli.build_parser().parse_args(verb).max_restarts == 0  # as torchrun: no restart unless asked
    result = miles_async(*verb, "--max-restarts", "-1")
    assert result.returncode == 2 and "--max-restarts: must be >= 0, got -1" in result.stderr


@pytest.mark.parametrize("argv", [["run", "r.toml", "lr"], ["run", "r.toml", "--out", "runs/x", "lr"]])
def test_override_must_be_key_value(argv: list[str]) -> None:
    result = miles_async(*argv)
    assert result.returncode == 2
    assert "'lr' is not an override: write key=value" in result.stderr


def test_bench_passes_its_arguments_through(monkeypatch: pytest.MonkeyPatch) -> None:
    # In-process, with a stand-in for the benchmark module: what is under test is the hand-off.
    seen: list[list[str]] = []

    def fake_main(argv: list[str]) -> int:
        seen.append(argv)
        return 7

    monkeypatch.setitem(sys.modules, "miles_async.bench.runtime", types.SimpleNamespace(main=fake_main))
    assert cli.main(["bench", "runtime", "--json", "--help", "--rounds=3", "x"]) == 7
    assert seen == [["--json", "--help", "--rounds=3", "x"]]


def test_bench_does_not_hide_a_broken_benchmark(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    # A benchmark that exists but fails to import must show its error, not "not implemented yet".
    (tmp_path / "runtime.py").write_text("import a_dependency_that_is_not_installed\n")
    monkeypatch.setattr(bench, "__path__", [str(tmp_path), *bench.__path__])
    monkeypatch.delitem(sys.modules, "miles_async.bench.runtime", raising=False)
    with pytest.raises(ModuleNotFoundError, match="a_dependency_that_is_not_installed"):
        cli.main(["bench", "runtime"])
