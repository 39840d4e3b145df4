"""miles_async/kernels/quant.py against values worked out by hand from the formats' definitions (OCP FP8 and
Microscaling v1.0, NVIDIA's NVFP4, symmetric INT4), and against torch's float8 dtypes."""

from __future__ import annotations

import math

import pytest
import torch

from miles_async.kernels.quant import (
    FORMATS,
    dequantize,
    e2m1_decode,
    e2m1_encode,
    e4m3,
    fake_quant,
    fp8_linear,
    quantize,
)

NAN = float("nan")


def test_e4m3_rounds_to_nearest_even_and_saturates() -> None:
    # E4M3: 3 mantissa bits; between 1 and 2 the step is 1/8, between 256 and 448 it is 32;
    # the smallest subnormal is 2^-9.
    cases = {
        1.0625: 1.0,  # halfway between 1.0 (mantissa 000) and 1.125 (001): to the even one
        1.1875: 1.25,  # halfway between 1.125 (001) and 1.25 (010): to 010
        300.0: 288.0,  # 288 and 320 around it: 288 is nearer
        304.0: 320.0,  # halfway between 288 (1.001b x 2^8) and 320 (1.010b x 2^8): to the even mantissa
        448.0: 448.0,
        464.0: 448.0,  # past the largest normal: saturated
        1e6: 448.0,
        float("inf"): 448.0,
        -float("inf"): -448.0,
        2.0**-9: 2.0**-9,  # the smallest subnormal
        2.0**-10: 0.0,  # halfway between 0 and 2^-9: to 0 (even)
        3 * 2.0**-11: 2.0**-9,  # nearer 2^-9
        -300.0: -288.0,
    }
    got = e4m3(torch.tensor(list(cases))).float().tolist()
    assert got == list(cases.values())
    assert math.isnan(e4m3(torch.tensor([NAN])).float().item())
    # where no saturation is involved it is torch's own cast
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 50
    assert torch.equal(e4m3(x).view(torch.uint8), x.to(torch.float8_e4m3fn).view(torch.uint8))


def test_e2m1_rounds_to_nearest_even_saturates_and_keeps_the_sign() -> None:
    values = [0.0, 0.25, 0.3, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 7.0, 100.0, -0.75, -5.0, -0.1]
    # ties: 0.25 -> 0 (code 0), 0.75 -> 1.0 (code 2), 1.25 -> 1.0 (2), 1.75 -> 2 (4), 2.5 -> 2 (4),
    # 3.5 -> 4 (6), 5 -> 4 (6); past 6 saturates
    want = [0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, -1.0, -4.0, -0.0]
    codes = e2m1_encode(torch.tensor(values))
    assert e2m1_decode(codes).tolist() == want
    assert codes.tolist() == [0, 0, 1, 2, 2, 4, 4, 6, 6, 7, 7, 7, 10, 14, 8]
    assert e2m1_decode(torch.arange(8, dtype=torch.uint8)).tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_mxfp8_shared_scale_is_the_spec_exponent_with_e4m3_elements() -> None:
    x = torch.zeros(4, 32)
    x[0, 0], x[0, 1] = 300.0, 1.0  # amax 300: floor(log2 300) = 8, X = 2^(8 - 8) = 1
    x[1, :] = 1.0  # floor(log2 1) = 0: X = 2^-8
    x[2, 5] = -3.0e-3  # floor(log2 0.003) = -9: X = 2^-17
    x[3, :] = 0.0  # all zero: the smallest scale, 2^-127
    q = quantize(x, "mxfp8")
    assert q.scales.dtype == torch.uint8 and q.scales.shape == (4, 1)
    assert q.scales.flatten().tolist() == [127, 119, 110, 0]
    # the E8M0 bytes are torch's float8_e8m0fnu encoding of the same powers of two
    powers = torch.tensor([1.0, 2.0**-8, 2.0**-17])
    assert q.scales.flatten()[:3].tolist() == powers.to(torch.float8_e8m0fnu).view(torch.uint8).tolist()
    y = dequantize(q)
    assert y[0, 0].item() == 288.0 and y[0, 1].item() == 1.0 and torch.equal(y[1], x[1])
    assert y[2, 5].item() == pytest.approx(-3.0e-3, rel=2**-4) and torch.equal(y[3], x[3])
    bad = torch.ones(1, 64)
    bad[0, 3] = float("inf")
    q = quantize(bad, "mxfp8")
    assert q.scales.flatten().tolist() == [255, 119]  # Inf in the first block: its scale is NaN
    y = dequantize(q)
    assert torch.isnan(y[0, :32]).all() and torch.equal(y[0, 32:], bad[0, 32:])


def test_fp8_block_scales_are_amax_over_448_per_tile_or_group() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(200, 300, generator=gen)
    w[:128, :128] *= 10
    q = quantize(w, "fp8_block")
    assert q.scales.shape == (2, 3) and q.values.dtype == torch.float8_e4m3fn and q.values.shape == (200, 300)
    assert q.scales[0, 0].item() == pytest.approx(w[:128, :128].abs().max().item() / 448, rel=1e-7)
    assert q.scales[1, 2].item() == pytest.approx(w[128:, 256:].abs().max().item() / 448, rel=1e-7)  # an edge tile
    y = dequantize(q)
    # E4M3 keeps 3 mantissa bits: within half a step, 2^-4 of the value, above the subnormal range
    big = y.abs() > 2.0**-6 * q.scales.max()
    assert ((y - w).abs() <= w.abs() * 2**-4 + 1e-12)[big].all()
    a = quantize(torch.randn(3, 5, 256, generator=gen), "fp8_block", kind="activation")
    assert a.scales.shape == (15, 2) and dequantize(a).shape == (3, 5, 256)
    with pytest.raises(ValueError, match="fp8_block weights are 2-D"):
        quantize(torch.randn(2, 3, 4), "fp8_block")


def test_nvfp4_block_and_tensor_scales() -> None:
    x = torch.zeros(1, 32)
    x[0, :16] = torch.tensor([6.0, 3.0, 1.5, 0.5] * 4)  # block amax 6 -> the tensor amax
    x[0, 16:] = torch.tensor([0.6, 0.3] * 8)  # block amax 0.6
    q = quantize(x, "nvfp4")
    assert q.values.dtype == torch.uint8 and q.values.shape == (1, 16) and q.scales.dtype == torch.float8_e4m3fn
    # S = 448 * 6 / 6 = 448; block scales e4m3(6 / 6 * 448) = 448 and e4m3(0.6 / 6 * 448) = e4m3(44.8) = 44
    assert q.tensor_scale.item() == pytest.approx(1 / 448)
    assert q.scales.float().flatten().tolist() == [448.0, 44.0]
    y = dequantize(q)
    assert torch.equal(y[0, :16], x[0, :16])  # on the E2M1 grid already
    # 0.6 / (44 / 448) = 6.109 -> 6 (saturated); 0.3 / (44 / 448) = 3.05 -> 3
    assert y[0, 16:18].tolist() == pytest.approx([6 * 44 / 448, 3 * 44 / 448])
    # packing: element 0 in the low nibble of byte 0
    assert q.values[0, 0].item() == (7 | (5 << 4))  # 6.0 (code 7), 3.0 (code 5)
    odd = quantize(torch.randn(3, 7), "nvfp4")
    assert odd.values.shape == (3, 4) and dequantize(odd).shape == (3, 7)


def test_int4_symmetric_groups_round_half_even_and_pack() -> None:
    x = torch.zeros(1, 130)
    x[0, :4] = torch.tensor([7.0, 2.5, 3.5, -7.0])  # amax 7: scale 1; 2.5 -> 2, 3.5 -> 4 (ties to even)
    x[0, 128:] = torch.tensor([14.0, -7.0])  # a group of 2: amax 14, scale 2: -3.5 -> -4
    q = quantize(x, "int4")
    assert q.scales.flatten().tolist() == [1.0, 2.0]
    y = dequantize(q)
    assert y[0, :4].tolist() == [7.0, 2.0, 4.0, -7.0]
    assert y[0, 128:].tolist() == [14.0, -8.0]
    assert q.values.shape == (1, 65) and q.values[0, 0].item() == (7 | (2 << 4))
    assert q.values[0, 1].item() == (4 | ((-7 & 0xF) << 4))  # two's complement nibble


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_round_trips_within_its_precision_and_reports_its_payload(fmt: str) -> None:
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    q = quantize(w, fmt)
    y = dequantize(q)
    assert y.dtype == torch.bfloat16 and y.shape == w.shape
    err = ((y.float() - w.float()).norm() / w.float().norm()).item()
    bound = {"fp8_block": 0.04, "mxfp8": 0.04, "nvfp4": 0.15, "int4": 0.2}[fmt]
    assert 0 < err < bound, err
    fraction = q.nbytes / (w.numel() * 4)  # of float32 weights
    expected = {"fp8_block": 0.25 + 4 / (128 * 128 * 4), "mxfp8": 0.25 + 1 / (32 * 4),
                "nvfp4": 0.125 + 1 / (16 * 4) + 4 / (w.numel() * 4), "int4": 0.125 + 4 / (128 * 4)}[fmt]
    assert fraction == pytest.approx(expected)


def test_fake_quant_passes_the_gradient_straight_through() -> None:
    w = torch.randn(4, 128, requires_grad=True)
    y = fake_quant(w, "int4")
    assert torch.equal(y.detach(), dequantize(quantize(w, "int4")))
    (y * torch.arange(128.0)).sum().backward()
    assert torch.equal(w.grad, torch.arange(128.0).expand(4, 128))


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="must be one of fp8_block, mxfp8, nvfp4, int4"):
        quantize(torch.ones(4), "fp4")
    with pytest.raises(ValueError, match="kind must be"):
        quantize(torch.ones(4), "int4", kind="bias")
    with pytest.raises(ValueError, match="at least one element"):
        quantize(torch.tensor(1.0), "int4")


def test_fp8_linear_quantizes_both_matmuls_of_the_backward() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 256, generator=gen, requires_grad=True)
    w = torch.randn(64, 256, generator=gen, requires_grad=True)
    b = torch.randn(64, generator=gen, requires_grad=True)
    y = fp8_linear(x, w, b)
    xq = dequantize(quantize(x, "fp8_block", kind="activation"))
    wq = dequantize(quantize(w, "fp8_block"))
    assert torch.equal(y.detach(), torch.nn.functional.linear(xq, wq, b).detach())
    grad = torch.randn(2, 5, 64, generator=gen)
    y.backward(grad)
    gq = dequantize(quantize(grad, "fp8_block", kind="activation"))
    torch.testing.assert_close(x.grad, gq @ wq, rtol=0, atol=0)
    torch.testing.assert_close(w.grad, gq.reshape(-1, 64).t() @ xq.reshape(-1, 256), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(b.grad, grad.reshape(-1, 64).sum(0))


def test_a_model_trains_for_and_an_engine_serves_a_quantized_format(tmp_path) -> None:
    import asyncio

    from miles_async.engine import Engine, EngineConfig, GenerateRequest
    from miles_async.engine.sampling import SamplingParams
    from miles_async.models import init_model, load_pretrained

    folder = init_model("qwen3", "tiny", tmp_path / "m", seed=0, init_std=0.3)
    ids = [5, 9, 13, 17, 21, 25, 29, 33]
    targets = torch.tensor(ids[1:])[:, None]

    def logprobs(model) -> torch.Tensor:
        logp = torch.log_softmax(model(torch.tensor([ids]))[0].float(), dim=-1)
        return logp[:-1].gather(1, targets).squeeze(1)

    plain = load_pretrained(folder)
    with torch.no_grad():
        base = logprobs(plain)
    for fmt in ("fp8_block", "mxfp8", "nvfp4", "int4"):
        served = load_pretrained(folder)
        dense_bytes = sum(t.numel() * t.element_size() for t in served.state_dict().values())
        assert served.hold_quantized(fmt) == 7 * served.config.num_hidden_layers
        held = served.state_dict()
        assert not any(n.endswith("q_proj.weight") for n in held) and "model.layers.0.mlp.up_proj.weight_packed" in held
        assert sum(t.numel() * t.element_size() for t in held.values()) < dense_bytes
        with torch.no_grad():
            want = logprobs(served)  # dequantized a block of rows at a time
            served.dequantize_served()
            torch.testing.assert_close(logprobs(served), want, rtol=0, atol=1e-6)  # the per-update copy
        assert (want - base).abs().mean() > 1e-3  # the format changes the model
        for batch_invariant, dequant in ((False, "per_update"), (True, "per_update"), (False, "blocks")):
            engine = Engine.from_pretrained(str(folder), config=EngineConfig(
                kv_cache_mib=4, weight_format=fmt, batch_invariant=batch_invariant, dequantize=dequant))

            async def score(engine=engine):
                async with engine:
                    out = await engine.generate(GenerateRequest(
                        input_ids=ids, sampling_params=SamplingParams(max_new_tokens=0), return_logprob=True,
                        logprob_start_len=0))
                return torch.tensor([lp for lp, _ in out.input_token_logprobs[1:]])

            got = asyncio.run(asyncio.wait_for(score(), 60))
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4, msg=f"{fmt} {dequant} bi={batch_invariant}")
        # quantization-aware training: the trainer's forward is the served model's (W8A8 formats:
        # activations included), with batch-invariant kernels bit for bit
        for batch_invariant in (False, True):
            trained, served_bi = load_pretrained(folder), load_pretrained(folder)
            trained.set_fake_quant(fmt)
            served_bi.hold_quantized(fmt)
            trained.set_batch_invariant(batch_invariant)
            served_bi.set_batch_invariant(batch_invariant)
            logp = logprobs(trained)
            with torch.no_grad():
                reference = logprobs(served_bi)
            atol = 0.0 if batch_invariant else 1e-5
            torch.testing.assert_close(logp.detach(), reference, rtol=0, atol=atol, msg=f"QAT {fmt} bi={batch_invariant}")
        logp.sum().backward()  # straight through: every projection's weight gets a gradient
        assert all(m.weight.grad is not None and m.weight.grad.abs().sum() > 0 for n, m in trained.named_modules()
                   if n.endswith("q_proj"))
    with pytest.raises(ValueError, match="fake quantization trains for"):
        plain.set_fake_quant("int8")


@pytest.mark.parametrize("fmt", FORMATS)
def test_named_tensors_carry_a_format_and_rows_slice_it(fmt: str) -> None:
    from miles_async.kernels.quant import from_named, quantize_named, to_named

    x = torch.randn(300, 200, generator=torch.Generator().manual_seed(1))
    q = quantize(x, fmt)
    named = to_named("model.layers.0.mlp.up_proj", q)
    assert all(t.dtype in (torch.uint8, torch.float32) for t in named.values())  # any transport moves these
    assert sum(t.numel() * t.element_size() for t in named.values()) == q.nbytes
    back = from_named(fmt, (300, 200), torch.float32, *(named[f"model.layers.0.mlp.up_proj.{leaf}"] for leaf in (
        "weight_packed", "weight_scale", "weight_global_scale") if f"model.layers.0.mlp.up_proj.{leaf}" in named))
    torch.testing.assert_close(dequantize(back), dequantize(q), rtol=0, atol=0)
    for start, stop in ((0, 128), (128, 300), (256, 257)):
        torch.testing.assert_close(dequantize(q.rows(start, stop)), dequantize(q)[start:stop], rtol=0, atol=0)
    with pytest.raises(ValueError, match="block boundary" if fmt == "fp8_block" else "rows"):
        q.rows(3 if fmt == "fp8_block" else 299, 400)
    mixed = quantize_named({"a.up_proj.weight": x, "a.up_proj.bias": x[0], "embed.weight": x}, fmt,
                           lambda module: module.endswith("_proj"))
    assert "a.up_proj.weight" not in mixed and mixed["a.up_proj.bias"] is not None and mixed["embed.weight"] is x
    assert set(mixed) >= {"a.up_proj.weight_packed", "a.up_proj.weight_scale"}


def test_a_quantized_engine_quantizes_full_precision_weights_on_arrival(tmp_path) -> None:
    """A checkpoint or a client's tensors arrive in full precision; the store quantizes them, so the
    engine serves exactly what a pusher's quantized tensors would have given."""
    import asyncio

    from miles_async.engine import Engine, EngineConfig
    from miles_async.kernels.quant import quantize_named
    from miles_async.models import init_model, is_projection, load_pretrained

    folder = init_model("qwen3", "tiny", tmp_path / "m", seed=0)
    other = load_pretrained(init_model("qwen3", "tiny", tmp_path / "o", seed=1)).state_dict()
    engine = Engine.from_pretrained(str(folder), config=EngineConfig(kv_cache_mib=4, weight_format="nvfp4"))

    async def update() -> dict[str, str]:
        async with engine:
            await engine.weights.update_from_tensors(other, 1)
            return await engine.weights.checksums()

    got = asyncio.run(asyncio.wait_for(update(), 60))
    from miles_async.transport.verify import checksums

    want = checksums(quantize_named(other, "nvfp4", is_projection))
    assert got == {name: want[name] for name in got} and len(got) < len(want)  # lm_head tied: one copy
    with pytest.raises(ValueError, match="with LoRA is not supported"):
        from miles_async.models.lora import LoraConfig

        EngineConfig(weight_format="int4", lora=LoraConfig(rank=4))
