"""lm-eval (0.4.x) against the embedded engine, unchanged.

The real CLI serves the tiny model (`miles-async serve engine`, fp32) in a subprocess, and lm-eval's
own model types talk to it over HTTP: `sglang-generate` (SGLang's /generate, with the prompt's
log-probs for loglikelihood requests) and `local-completions` (/v1/completions with echo and
log-probs). The tasks are local (tests/data/lm_eval/: YAML over JSONL shipped beside it, no
download): a multiple-choice one (loglikelihood requests) and a generate_until one. The references
come from transformers on the same folder, in fp32: every log-likelihood lm-eval reports equals
transformers' for the same (context, continuation) within 1e-4, every generation equals
transformers' greedy one, and the metrics are what those give. The last test runs a shortened run
whose `[eval] mode = "command"` is an lm-eval command line, and checks the scores it records.

    pytest tests/e2e/test_lm_eval.py -s     (-s prints the largest log-likelihood difference)
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import lm_eval
import pytest
import torch
import transformers
from _support_run import SHORT
from lm_eval.tasks import TaskManager

from miles_async.actors.controller import Controller
from miles_async.actors.recipe import load_recipe
from miles_async.runtime import run as run_async

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "tests" / "data" / "lm_eval"
RECIPE = ROOT / "recipes" / "reverse.toml"
CHOICE, GENERATE = "miles_tiny_choice", "miles_tiny_generate"
TOLERANCE = 1e-4
START_S = 60
# lm-eval's model types with the path each posts to and its model_args: sglang-generate sends a batch
# of token-id prompts per request (SGLang's batch form), local-completions one prompt per request,
# as token ids or (tokenized_requests=False) as text the server tokenizes.
MODEL_TYPES = [pytest.param("sglang-generate", "/generate", "batch_size=4", id="sglang-generate"),
               pytest.param("local-completions", "/v1/completions", "", id="local-completions"),
               pytest.param("local-completions", "/v1/completions", "tokenized_requests=False",
                            id="local-completions-text")]


@contextlib.contextmanager
def serving(model_dir: Path) -> Iterator[str]:
    """`miles-async serve engine` on a free port; its URL."""
    proc = subprocess.Popen([sys.executable, "-m", "miles_async.launch.cli", "serve", "engine", "--model",
                             str(model_dir), "--port", "0", "--kv-cache-mib", "16"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # the server prints its URL once listening
        found = re.search(r" on (http://\S+)", line)
        assert found, f"no URL from the server: {line!r} {proc.stderr.read() if proc.poll() is not None else ''}"
        yield found.group(1)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=START_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def url(model_dir):
    with serving(model_dir) as url:
        yield url


@pytest.fixture(scope="module")
def reference(model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(model_dir)


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split (TemplateLM._encode_pair): the context's trailing spaces go with the
    continuation, whose tokens are those of the whole text after the context's."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    context_ids = tokenizer(context, add_special_tokens=False).input_ids
    return context_ids, whole[len(context_ids):]


def loglikelihood(model, context_ids: list[int], continuation_ids: list[int]) -> tuple[float, bool]:
    """(sum of the continuation's log-probs, whether each of its tokens is the argmax)."""
    ids = context_ids + continuation_ids
    with torch.inference_mode():
        logp_TV = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    rows_CV = logp_TV[len(context_ids) - 1:len(ids) - 1]
    targets = torch.tensor(continuation_ids)
    return float(rows_CV[torch.arange(len(targets)), targets].sum()), bool((rows_CV.argmax(-1) == targets).all())


def greedy_text(model, tokenizer, context: str, until: list[str], max_tokens: int) -> str:
    """transformers' greedy continuation, stopped at an EOS token or cut at the first stop string."""
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    ids, out = tokenizer(context, add_special_tokens=False).input_ids, []
    with torch.inference_mode():
        for _ in range(max_tokens):
            token = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
            if token in eos_ids:
                break
            out.append(token)
    text = tokenizer.decode(out, skip_special_tokens=True)
    cuts = [text.index(stop) for stop in until if stop in text]
    return text[:min(cuts)] if cuts else text


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("model_type", "path", "extra_args"), MODEL_TYPES)
def test_lm_eval_scores_through_the_engine_equal_transformers(url, model_dir, reference, model_type, path,
                                                              extra_args):
    model, tokenizer = reference
    model_args = ",".join(filter(None, [f"base_url={url}{path}", f"tokenizer={model_dir}", extra_args]))
    results = lm_eval.simple_evaluate(model=model_type, model_args=model_args, tasks=[CHOICE, GENERATE],
                                      log_samples=True, bootstrap_iters=0,
                                      task_manager=TaskManager(include_path=str(TASKS), include_defaults=False))

    choice = results["samples"][CHOICE]
    assert len(choice) == 4
    worst, correct = 0.0, 0
    for sample in choice:
        ours = [resp[0] for resp in sample["resps"]]  # one (log-likelihood, is_greedy) per choice
        expected = [loglikelihood(model, *encode_pair(tokenizer, *pair)) for pair in sample["arguments"]]
        for (ll, is_greedy), (ll_ref, greedy_ref) in zip(ours, expected, strict=True):
            worst = max(worst, abs(ll - ll_ref))
            assert ll == pytest.approx(ll_ref, abs=TOLERANCE, rel=0)
            if model_type == "local-completions":  # sglang-generate's is_greedy is inverted in lm-eval 0.4.13
                assert is_greedy == greedy_ref
        lls = [ll for ll, _ in expected]
        correct += lls.index(max(lls)) == sample["target"]
    print(f"\n{model_type} {extra_args}: max |lm-eval - transformers| log-likelihood = {worst:.3g}")
    assert results["results"][CHOICE]["acc,none"] == correct / len(choice)

    generate = results["samples"][GENERATE]
    assert len(generate) == 3
    matches = 0
    for sample in generate:
        context, gen_kwargs = sample["arguments"][0]
        expected = greedy_text(model, tokenizer, context, gen_kwargs["until"], gen_kwargs["max_gen_toks"])
        assert sample["resps"][0][0] == expected, context
        matches += expected == sample["target"]
    assert results["results"][GENERATE]["exact_match,none"] == matches / len(generate)


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=START_S) as answer:
        return json.loads(answer.read())


@pytest.mark.timeout(120)
def test_prompt_scoring_without_generation_equals_transformers(url, reference):
    """The scoring requests other lm-eval versions and harnesses send: no new token, the prompt's
    log-probs only (/v1/completions: max_tokens 0 with echo; /generate: max_new_tokens 0)."""
    model, tokenizer = reference
    text = "Question: What is the capital of France?\nAnswer: Paris"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    with torch.inference_mode():
        logp_TV = torch.log_softmax(model(torch.tensor([ids])).logits[0], dim=-1)
    expected = [float(logp_TV[i - 1, t]) for i, t in enumerate(ids) if i > 0]

    for prompt in (text, ids):
        [choice] = post(f"{url}/v1/completions", {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1,
                                                  "temperature": 0})["choices"]
        assert choice["text"] == text and choice["logprobs"]["token_logprobs"][0] is None
        assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(expected, abs=TOLERANCE, rel=0)
        assert len(choice["logprobs"]["top_logprobs"]) == len(ids)
    out = post(f"{url}/generate", {"text": text, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                                   "logprob_start_len": 0, "top_logprobs_num": 1})
    assert out["output_ids"] == [] and [t for _, t, _ in out["meta_info"]["input_token_logprobs"]] == ids
    assert [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]] == pytest.approx(expected, abs=TOLERANCE,
                                                                                              rel=0)


@pytest.mark.timeout(300)
def test_an_lm_eval_command_is_a_runs_eval_and_its_scores_are_recorded(tmp_path):
    # EvalConfig's example, lines continued as in its TOML; max_length: the recipe's engine holds 64 tokens.
    command = " \\\n    ".join([
        f"{sys.executable} -m lm_eval --model local-completions",
        "--model_args base_url={url}/v1/completions,tokenizer={model},tokenizer_backend=huggingface,max_length=64",
        f"--tasks {CHOICE},{GENERATE} --include_path {TASKS} --output_path {{output}}"])
    config = load_recipe(RECIPE, [*SHORT, "loop.num_steps=2", "eval.mode=command", "eval.every=2",
                                  f"eval.metric={CHOICE}/acc", f"eval.command={json.dumps(command)}"])
    controller = Controller(config, tmp_path / "run", progress=False)
    result = run_async(controller.run())

    step_folder = tmp_path / "run" / "eval" / "step_000002"
    [results_file] = (step_folder / "results").rglob("results_*.json")
    scores = json.loads(results_file.read_text())["results"]
    assert controller.evaluator.metrics_of(2) == {f"eval/{CHOICE}/acc": scores[CHOICE]["acc,none"],
                                                  f"eval/{GENERATE}/exact_match": scores[GENERATE]["exact_match,none"]}
    assert result.eval_scores == [(2, scores[CHOICE]["acc,none"])]
    [row] = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["step"] == 2]
    assert row["eval/score"] == scores[CHOICE]["acc,none"]
    assert row[f"eval/{CHOICE}/acc"] == scores[CHOICE]["acc,none"]
    assert row[f"eval/{GENERATE}/exact_match"] == scores[GENERATE]["exact_match,none"]
    assert scores[CHOICE]["sample_len"] == 4 and scores[GENERATE]["sample_len"] == 3
    assert not (step_folder / "model.safetensors").exists()  # no {checkpoint} in the command: none exported
