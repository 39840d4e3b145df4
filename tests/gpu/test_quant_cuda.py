"""The quantizers on CUDA against the CPU reference (miles_async/kernels/quant.py): the same torch ops on the
GPU must give the same bytes (values, scales, packed nibbles) as on the CPU, bit for bit; an engine
serving a quantized format on the GPU answers as the CPU engine does; and the hardware's own FP8
matmul (`torch._scaled_mm`, Hopper and later), fed our E4M3 values and per-row scales, gives what
the emulation computes from the same values, within bf16's rounding (its output dtype).

GPU only: skipped, with the reason, where no CUDA GPU is visible.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles_async.kernels.quant import FORMATS, dequantize, fake_quant, quantize

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and none is visible")


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_on_cuda_gives_the_cpu_bytes(fmt: str) -> None:
    x = torch.randn(384, 520, generator=torch.Generator().manual_seed(0)) * 3
    x[0, :7] = torch.tensor([0.0, -0.0, 1e-30, 5e4, -5e4, 448.0, 6.0])  # zeros, underflow, saturation, edges
    cpu, gpu = quantize(x, fmt), quantize(x.cuda(), fmt)
    for name in ("values", "scales"):
        a, b = getattr(cpu, name), getattr(gpu, name).cpu()
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                                                  b.view(torch.uint8) if b.element_size() == 1 else b), (fmt, name)
    torch.testing.assert_close(dequantize(gpu).cpu(), dequantize(cpu), rtol=0, atol=0)
    g = torch.randn_like(x).cuda().requires_grad_()
    fake_quant(g, fmt).sum().backward()  # straight through on the GPU too
    assert torch.equal(g.grad, torch.ones_like(g))


def test_an_engine_serving_a_format_on_cuda_answers_as_on_the_cpu(tmp_path) -> None:
    from miles_async.engine import Engine, EngineConfig, GenerateRequest
    from miles_async.engine.sampling import SamplingParams
    from miles_async.models import init_model

    folder = init_model("qwen3", "tiny", tmp_path / "m", seed=0, init_std=0.3)
    ids = [5, 9, 13, 17, 21, 25, 29, 33]

    def score(device: str, fmt: str, dequant: str) -> torch.Tensor:
        engine = Engine.from_pretrained(str(folder), config=EngineConfig(
            kv_cache_mib=4, weight_format=fmt, dequantize=dequant, device=device))

        async def main():
            async with engine:
                out = await engine.generate(GenerateRequest(
                    input_ids=ids, sampling_params=SamplingParams(max_new_tokens=0), return_logprob=True,
                    logprob_start_len=0))
            return torch.tensor([lp for lp, _ in out.input_token_logprobs[1:]])

        return asyncio.run(asyncio.wait_for(main(), 120))

    for fmt in FORMATS:
        want = score("cpu", fmt, "per_update")
        for dequant in ("per_update", "blocks"):
            torch.testing.assert_close(score("cuda", fmt, dequant), want, rtol=0, atol=1e-3, msg=f"{fmt} {dequant}")


def test_the_hardware_fp8_matmul_agrees_with_the_emulation() -> None:
    if torch.cuda.get_device_capability() < (8, 9) or not hasattr(torch, "_scaled_mm"):
        pytest.skip("FP8 matmuls need compute capability 8.9 or later and torch._scaled_mm")
    generator = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 256, generator=generator), torch.randn(128, 256, generator=generator) * 0.05
    # per-row scales (one per row of x and of w: 1 x K groups), the layout _scaled_mm takes
    sx = x.abs().amax(dim=1, keepdim=True) / 448.0
    sw = w.abs().amax(dim=1, keepdim=True) / 448.0
    xq, wq = (x / sx).to(torch.float8_e4m3fn), (w / sw).to(torch.float8_e4m3fn)
    emulated = (xq.float() * sx) @ (wq.float() * sw).t()
    # (row-wise scaling writes bf16: the comparison is at bf16's rounding)
    fast = torch._scaled_mm(xq.cuda(), wq.cuda().t(), scale_a=sx.cuda(), scale_b=sw.cuda().t(),
                            out_dtype=torch.bfloat16)
    torch.testing.assert_close(fast.float().cpu(), emulated, rtol=1e-2, atol=1e-2)
