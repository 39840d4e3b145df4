"""Numerics (installed as `miles_async.kernels`).

- `logprobs`: per-token log-probs and entropy from hidden states (or logits), in chunks of tokens.
- `batch_invariant`: linear, attention, silu and log-probs whose per-row result does not depend on
  the rest of the batch (true on-policy mode: the engine's log-probs equal the trainer's).
- `onednn`: linear layers on weights prepacked for oneDNN (the embedded engine's CPU matmuls).
- `cpu_kernels`: fused C++ kernels for the engine's CPU steps (RMSNorm, rotary, attention over the
  paged KV blocks with the KV write, silu(gate) * up, greedy sampling), compiled once per machine
  at first use.

- `quant`: quantizers to FP8 blockwise, MXFP8, NVFP4 and INT4 and back (`quantize`,
  `dequantize`, `fake_quant` for quantization-aware training), the CPU reference of each format.
- `precision`: what dtype "auto" is on a device (bfloat16 where it is native, else float32).

It is a leaf: it imports torch (and Triton lazily) and nothing of ours (docs/design.md, "Who may
import whom"); `cpu_kernels` also runs the system's C++ compiler once.
"""
