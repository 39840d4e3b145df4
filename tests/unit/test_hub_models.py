"""Models named by Hugging Face id (miles_async/models/hub.py, the recipe's [model] and [teacher]).

Each model is a tiny random one (`init_model`) placed in a Hugging Face cache under tmp_path as
huggingface_hub's downloads leave it (tests/unit/_support_hub.py), and read back by the real
huggingface_hub. The cache folder and offline mode are huggingface_hub's own settings, read from
HF_HUB_CACHE / HF_HUB_OFFLINE when it is first imported: these tests set them on
`huggingface_hub.constants` (as huggingface_hub's own tests do), since the test process imported
it long before; tests/e2e/test_hub_run.py sets the real environment variables of a real command.

The answers of the Hub itself (a repository or revision it does not have, a gated repository)
come from a small HTTP server in the test standing in for huggingface.co (HF_ENDPOINT): that
boundary is not what is tested; how the real huggingface_hub reads those answers, and the one
line we make of each, is.
"""

from __future__ import annotations

import http.server
import json
import logging
import socket
import threading
from pathlib import Path
from typing import ClassVar

import msgspec
import pytest
from _support_hub import place_in_hub_cache
from huggingface_hub import constants, scan_cache_dir

from miles_async.actors.controller import Controller, RunSetupError
from miles_async.actors.recipe import ModelSection, load_recipe
from miles_async.actors.teacher import TeacherConfig
from miles_async.models import ModelConfig, hub, init_model, load_tokenizer
from miles_async.models.hub import ResolvedModel, is_hub_id, resolve_model

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "reverse.toml"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache, offline."""
    folder = tmp_path / "hf" / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(folder))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return folder


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    return message


def test_an_id_resolves_to_its_snapshot_at_the_commit_of_main(cache, tiny):
    commit = place_in_hub_cache(cache, "org/tiny", tiny)
    assert [r.repo_id for r in scan_cache_dir(cache).repos] == ["org/tiny"]  # a layout huggingface_hub reads
    resolved = resolve_model("org/tiny")
    assert resolved == ResolvedModel(folder=cache / "models--org--tiny" / "snapshots" / commit, repo_id="org/tiny",
                                     commit=commit)
    assert resolved.describe() == f"model org/tiny at revision {commit} ({resolved.folder})"
    assert resolved.name == "org/tiny" and resolve_model(str(tiny)).name == tiny.name
    assert ModelConfig.from_hf(resolved.folder).vocab_size == ModelConfig.from_hf(tiny).vocab_size
    assert load_tokenizer(resolved.folder).encode("hello") == load_tokenizer(tiny).encode("hello")


def test_a_revision_picks_a_branch_or_a_commit(cache, tiny, tmp_path):
    main = place_in_hub_cache(cache, "org/tiny", tiny)
    other = init_model("qwen3", "tiny", tmp_path / "v2", seed=1)
    v2 = place_in_hub_cache(cache, "org/tiny", other, branch="v2")
    assert main != v2
    assert resolve_model("org/tiny", "main").commit == main
    assert resolve_model("org/tiny", "v2").commit == v2
    assert resolve_model("org/tiny", v2).folder.name == v2
    assert resolve_model("org/tiny", main).folder == resolve_model("org/tiny").folder


def test_an_id_not_in_the_cache_offline_says_how_to_fill_it(cache, tiny):
    with pytest.raises(ValueError) as error:
        resolve_model("org/missing")
    message = one_line(error)
    assert "model.path 'org/missing'" in message and "HF_HUB_OFFLINE=1" in message
    assert "`hf download org/missing`" in message and "huggingface-cli download" in message


def test_a_revision_not_in_the_cache_says_what_is(cache, tiny):
    commit = place_in_hub_cache(cache, "org/tiny", tiny)
    with pytest.raises(ValueError) as error:
        resolve_model("org/tiny", "v9")
    message = one_line(error)
    assert "model.revision 'v9'" in message and "HF_HUB_OFFLINE=1" in message
    assert f"only at main, {commit[:12]}" in message and "--revision v9" in message


def test_a_snapshot_without_safetensors_weights_is_refused(cache, tiny, tmp_path):
    partial = tmp_path / "partial"
    partial.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (partial / name).write_bytes((tiny / name).read_bytes())
    commit = place_in_hub_cache(cache, "org/partial", partial)
    with pytest.raises(ValueError) as error:
        resolve_model("org/partial")
    assert "no *.safetensors weights" in one_line(error) and "org/partial" in str(error.value)
    # what a session server reads (its tokenizer) is there
    assert resolve_model("org/partial", weights=False).folder.name == commit


def test_a_local_folder_is_used_as_it_is(tiny, tmp_path):
    assert resolve_model(str(tiny)) == ResolvedModel(folder=tiny)
    with pytest.raises(ValueError) as error:
        resolve_model(str(tiny), "main")
    assert "model.revision 'main'" in one_line(error) and "is a local folder" in str(error.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError) as error:
        resolve_model(str(tmp_path / "empty"), key="teacher.path")
    assert one_line(error).startswith("teacher.path") and "holds no config.json" in str(error.value)
    with pytest.raises(ValueError) as error:
        resolve_model(str(tiny / "config.json"))
    assert "is a file, not a model folder" in one_line(error)


def test_a_missing_path_that_is_no_hub_id_says_so(tmp_path):
    for value in (str(tmp_path / "nowhere"), "runs/x/final_model", "./nowhere", "~/nowhere-at-all"):
        with pytest.raises(ValueError) as error:
            resolve_model(value, key="--model")
        message = one_line(error)
        assert message.startswith(f"--model {value!r} does not exist") and "org/name" in message
    assert is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert not any(map(is_hub_id, ("gpt2", "a/b/c", "./a", "/a/b", "~/a", "a--b/c", "a/b..c", "")))


class FakeHub(http.server.BaseHTTPRequestHandler):
    """huggingface.co's answers to a model's info, as huggingface_hub reads them: the status and X-Error-Code."""

    seen_auth: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        FakeHub.seen_auth.append(self.headers.get("Authorization", ""))
        code, error = {"gated": (403, "GatedRepo"), "norev": (404, "RevisionNotFound")}.get(
            self.path.split("/")[4] if self.path.count("/") >= 4 else "", (404, "RepoNotFound"))
        body = json.dumps({"error": error}).encode()
        self.send_response(code)
        self.send_header("X-Error-Code", error)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    FakeHub.seen_auth = []
    yield
    server.shutdown()
    thread.join(timeout=10)


@pytest.mark.timeout(30)
def test_the_hubs_refusals_become_one_line_each_and_the_token_is_never_shown(fake_hub, monkeypatch):
    secret = "hf_" + "x" * 30
    monkeypatch.setenv("HF_TOKEN", secret)
    token_fix = "the token in HF_TOKEN belongs to an account that can read it"
    cases = [("org/absent", "", ["the Hugging Face Hub has no model org/absent", token_fix]),
             ("org/gated", "", ["is gated: ask for access at https://huggingface.co/org/gated", token_fix]),
             ("org/norev", "v3", ["model.revision 'v3': org/norev has no such branch, tag or commit"])]
    for repo_id, revision, expected in cases:
        with pytest.raises(ValueError) as error:
            resolve_model(repo_id, revision)
        message = one_line(error)
        assert all(part in message for part in expected) and secret not in message, message
    assert FakeHub.seen_auth and all(auth == f"Bearer {secret}" for auth in FakeHub.seen_auth)  # HF_TOKEN was used
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", "/nonexistent/token")
    with pytest.raises(ValueError) as error:
        resolve_model("org/gated")
    assert "set HF_TOKEN to a token" in one_line(error)


def test_the_recipes_model_takes_a_hub_id_and_a_revision(cache, tiny, tmp_path):
    commit = place_in_hub_cache(cache, "org/tiny", tiny)
    config = load_recipe(RECIPE, ['model.path="org/tiny"', 'model.revision="main"'])
    snapshot = cache / "models--org--tiny" / "snapshots" / commit
    assert config.model.resolve() == snapshot
    assert config.model.folder(tmp_path / "run") == snapshot and not (tmp_path / "run").exists()
    assert ModelSection().resolve() is None  # the run makes its model: nothing resolved, nothing written
    assert ModelSection(path=str(tiny)).resolve() == tiny
    with pytest.raises(ValueError) as error:
        ModelSection(path="org/missing").resolve()
    assert "model.path 'org/missing'" in one_line(error)
    assert list(tmp_path.iterdir()) == [tmp_path / "hf"]  # nothing written but the cache (which was there)


@pytest.mark.parametrize("overrides, expected", [
    (['model.revision="main"'], "model.revision 'main' picks a revision of a Hugging Face id in model.path"),
    (['model.revision="main"', 'model.pretrained="smollm2"'], "model.revision 'main' picks a revision"),
])
def test_a_revision_without_a_hub_id_is_refused_naming_both_keys(overrides, expected):
    with pytest.raises(ValueError, match=expected) as error:
        load_recipe(RECIPE, overrides)
    assert "model.path" in one_line(error)


def test_the_teacher_takes_a_hub_id(cache, tiny):
    commit = place_in_hub_cache(cache, "org/teacher", tiny)
    teacher = msgspec.convert({"path": "org/teacher", "revision": commit}, TeacherConfig)
    assert teacher.resolve() == cache / "models--org--teacher" / "snapshots" / commit == teacher.folder()
    assert TeacherConfig().resolve() is None
    with pytest.raises(ValueError) as error:
        TeacherConfig(path="org/nobody").folder()
    assert one_line(error).startswith("teacher.path 'org/nobody'")
    with pytest.raises(ValueError, match="teacher.revision 'main' picks a revision of a Hugging Face id in "
                                         "teacher.path"):
        TeacherConfig(revision="main")


def test_an_id_resolves_once_per_process_while_its_branch_moves(cache, tiny, tmp_path):
    first = place_in_hub_cache(cache, "org/tiny", tiny)
    assert resolve_model("org/tiny").commit == first
    moved = place_in_hub_cache(cache, "org/tiny", init_model("qwen3", "tiny", tmp_path / "b", seed=2))
    assert moved != first and (cache / "models--org--tiny" / "refs" / "main").read_text() == moved
    assert resolve_model("org/tiny").commit == first  # the pre-flight's commit is the controller's
    assert resolve_model("org/tiny", "main").commit == moved  # (another request: resolved anew)


@pytest.mark.timeout(30)
def test_an_unreachable_hub_with_an_empty_cache_says_so(tmp_path, monkeypatch):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(ValueError) as error:
        resolve_model("org/far")
    assert "the Hugging Face Hub cannot be reached" in one_line(error) and "`hf download org/far`" in str(error.value)


def test_the_controller_resolves_before_writing_records_the_commit_and_keeps_it_on_resume(cache, tiny, tmp_path,
                                                                                          caplog):
    first = place_in_hub_cache(cache, "org/tiny", tiny)
    small = ["task.num_prompts=8", "eval.num_prompts=4", "sft.num_probe=4"]  # (the prompts are made at once)
    config = load_recipe(RECIPE, ['model.path="org/tiny"', *small])
    with pytest.raises((ValueError, RunSetupError), match="model.path 'org/absent'"):
        Controller(load_recipe(RECIPE, ['model.path="org/absent"', *small]), tmp_path / "bad", progress=False)
    assert not (tmp_path / "bad").exists()  # nothing written
    with caplog.at_level(logging.INFO, logger="miles_async.actors.controller"):
        controller = Controller(config, tmp_path / "run", progress=False)
    assert controller.folder.model_dir == cache / "models--org--tiny" / "snapshots" / first
    assert [r.getMessage() for r in caplog.records if "org/tiny" in r.getMessage()] == [
        f"model org/tiny at revision {first} ({controller.folder.model_dir})"]
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())["model"]
    assert recorded["path"] == "org/tiny" and recorded["revision"] == first
    # main moves on, and a later process resumes the run: it loads the commit the run started from
    moved = place_in_hub_cache(cache, "org/tiny", init_model("qwen3", "tiny", tmp_path / "b", seed=2))
    hub._RESOLVED.clear()  # (what a new process starts with)
    resumed = Controller(config, tmp_path / "run", resume=True, progress=False)
    assert resumed.folder.model_dir.name == first
    assert Controller(config, tmp_path / "new", progress=False).folder.model_dir.name == moved
