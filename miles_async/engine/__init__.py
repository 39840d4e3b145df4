"""The embedded rollout engine, its SGLang-compatible HTTP API, and clients of external engines (docs/design.md, "Engines").

- `Engine` (core.py): the lifecycle, the requests, control (pause/continue, abort, memory
  release) and the loop that wires the three parts below; `Engine.from_pretrained(DIR)`;
  `await engine.generate(GenerateRequest(...))`. Its config is `EngineConfig` (config.py), on the
  CPU or a GPU (`EngineConfig.device`).
- `Scheduler` (scheduler.py): the waiting and running queues, admission, chunked prefill,
  retraction, the KV blocks and the radix prefix cache, draft budgets; no torch forward.
- `ModelRunner` (runner.py): the forward, drafting and verification, sampling with per-token
  log-probs, routed experts for MoE models, and `prepare()` after each weight change (LoRA merge,
  dequantization, prepacking), so the step path checks no weight epoch.
- `WeightStore` (weights.py, `engine.weights`): every update path (begin/commit/abort, tensors,
  disk, deltas, adoption, checksums, random fill), versions in order, an optional double buffer,
  shared-memory weights, and the torn state an interrupted update leaves (the engine then refuses
  requests and its /health says why).
- `EngineServer` / `create_app` (server.py): SGLang 0.5.23's endpoints and shapes over aiohttp,
  OpenAI's routes, streamed or not (openai.py), Prometheus /metrics (metrics.py), the pieces they
  share in http_base.py; `miles-async serve engine --model DIR --port P` runs it.
- `EngineClient` (client.py): the async client for this server and for a real SGLang server.
- `EngineBackend` (backend.py): the one interface the loop, the evaluator and the session server
  use for any engine; `SGLangBackend` speaks SGLang's API, `VllmBackend` (vllm.py) vLLM's.
- `SGLangServer` (sglang.py), `VllmServer` (vllm.py), `SGLangRouter` (router.py): start those
  servers as subprocesses (process.py: `ServerProcess`); `RoutedBackend` puts the router in front.

Try it:
    miles-async init-model --family qwen3 --preset tiny --out /tmp/tiny
    miles-async serve engine --model /tmp/tiny --port 30000 &
    curl -s localhost:30000/generate -d '{"text": "Hi", "sampling_params": {"max_new_tokens": 8}}'
"""

from miles_async.engine.client import EngineClient, EngineHTTPError, decode_routed_experts
from miles_async.engine.core import (
    PAUSE_MODES,
    Engine,
    EngineConfig,
    EngineOverloadedError,
    EngineStats,
    WeightsUnavailableError,
)
from miles_async.engine.request import GenerateOutput, GenerateRequest
from miles_async.engine.sampling import SamplingParams
from miles_async.engine.server import EngineServer, create_app
from miles_async.engine.sglang import SGLangServer, SGLangStartError
from miles_async.engine.weights import StaleVersionError, WeightStore

__all__ = [
    "PAUSE_MODES",
    "Engine",
    "EngineClient",
    "EngineConfig",
    "EngineHTTPError",
    "EngineOverloadedError",
    "EngineServer",
    "EngineStats",
    "GenerateOutput",
    "GenerateRequest",
    "SGLangServer",
    "SGLangStartError",
    "SamplingParams",
    "StaleVersionError",
    "WeightStore",
    "WeightsUnavailableError",
    "create_app",
    "decode_routed_experts",
]
