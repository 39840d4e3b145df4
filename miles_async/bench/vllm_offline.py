"""vLLM in process (its offline `LLM` API) on a token-id workload: run by vLLM's own Python, not ours.

`miles-async bench engine` starts this file with `.venv-vllm`'s interpreter (vLLM pins its own
torch and transformers), so it imports nothing of miles_async. Its one argument is a JSON spec:
`model`, `workload` ([[prompt ids, output tokens], ...]), `dtype`, `kv_cache_bytes`,
`max_num_seqs`, `max_model_len` and `torch_compile` (false: `enforce_eager`). Greedy, EOS ignored,
all requests given to one `LLM.generate` call (vLLM's own batching), after a warm-up of 16 short
ones. Prints one line on stdout, `vllm-offline-result: ` and a JSON object: tokens, wall seconds, tokens/s, the seconds `LLM()` took
to start, and vLLM's version. The worker's cores and preloaded libraries come from the
environment the parent sets (miles_async/engine/vllm.py's `cpu_env`).

    .venv-vllm/bin/python miles_async/bench/vllm_offline.py spec.json
"""

from __future__ import annotations

import json
import sys
import time

RESULT = "vllm-offline-result: "  # the line's prefix (vLLM writes to stdout too)


def main(spec_path: str) -> None:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(spec_path) as f:
        spec = json.load(f)
    started = time.perf_counter()
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype=spec["dtype"],
              kv_cache_memory_bytes=int(spec["kv_cache_bytes"]), max_num_seqs=int(spec["max_num_seqs"]),
              max_model_len=int(spec["max_model_len"]) or None, enforce_eager=not spec["torch_compile"],
              disable_log_stats=True)
    start_s = time.perf_counter() - started

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False)

    workload = spec["workload"]
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in workload]
    llm.generate(prompts[:16], [params(8)] * len(prompts[:16]), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, [params(n) for _, n in workload], use_tqdm=False)
    wall_s = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(RESULT + json.dumps({"useful_tokens": tokens, "wall_s": round(wall_s, 3), "tokens_per_s": round(tokens / wall_s, 1),
                      "start_s": round(start_s, 1), "version": vllm.__version__}), flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: vllm_offline.py SPEC.json")
    main(sys.argv[1])
