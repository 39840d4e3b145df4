"""Quantizers: FP8 blockwise, MXFP8, NVFP4 and INT4, as the formats define them (CPU reference).

    q = quantize(x, fmt)          # a QTensor: packed values, their scales, the original shape/dtype
    y = dequantize(q)             # back to x's dtype and shape
    y = fake_quant(x, fmt)        # dequantize(quantize(x)) forward, identity gradient (QAT)
    y = fp8_linear(x, w, b)       # FP8 blockwise training: forward and backward matmuls on E4M3 values

Blocks run along the last dimension (leading dimensions are rows), except "fp8_block" weights,
whose blocks are 128 x 128 tiles of a 2-D weight. A partial block at an edge is a block of its own.

- "fp8_block" (DeepSeek-V3's FP8 recipe): E4M3 values (OCP FP8, `torch.float8_e4m3fn`: bias 7,
  max normal 448, no infinity) and one float32 scale per block, amax / 448: 128 x 128 tiles of a
  weight, 1 x 128 groups of an activation (`kind="activation"`).
- "mxfp8" (OCP Microscaling Formats v1.0, section 6.3): blocks of 32 consecutive elements, one
  shared E8M0 scale X = 2^(floor(log2(amax)) - 8) (8: the largest power of two E4M3 holds),
  stored as its biased exponent byte (127 = 2^0, 255 = NaN; a block of zeros takes the smallest,
  2^-127; one holding Inf or NaN takes NaN), and E4M3 elements V / X.
- "nvfp4" (NVIDIA's NVFP4): E2M1 values (1 sign, 2 exponent, 1 mantissa bit: 0, 0.5, 1, 1.5, 2,
  3, 4, 6), one E4M3 scale per 16 elements, and one float32 scale for the whole tensor: the
  block scales are encoded as e4m3(block_amax / 6 * S) with S = 448 * 6 / amax(tensor), so that
  the largest maps to 448; the stored per-tensor scale is 1 / S. Two values per byte.
- "int4" (INT4 quantization-aware training): symmetric, one float32 scale per group of 128,
  amax / 7, values round(x / scale) in [-7, 7], two's-complement nibbles, two per byte.

Rounding is to nearest, ties to even (the E4M3 cast is torch's, which rounds so; E2M1 and INT4
here), and values beyond a format's largest saturate to it (an E4M3 element to +-448, E2M1 to
+-6), as NVIDIA's saturating conversions do; the OCP specs leave overflow to the implementation.
NaN stays NaN where the format has one (E4M3, E8M0); E2M1 and INT4 have none. Packing: element
2i in the low nibble of byte i, 2i + 1 in the high one (a row of odd length gets a zero pad).

A quantized weight travels (weight pushes) and is held (an engine serving the format) as plain
named tensors, compressed-tensors' names under its module: `<module>.weight_packed` (the values'
bytes, uint8), `<module>.weight_scale` (float32, or the E8M0 / E4M3 bytes as uint8) and, for
nvfp4, `<module>.weight_global_scale` (float32 [1]): `to_named` / `from_named`, and
`quantize_named` for a whole set of weights. Every transport moves them as it moves any tensor.

`QTensor.nbytes` is the payload: values, scales and the per-tensor scale. Try it:
    q = quantize(torch.randn(256, 512), "nvfp4"); q.nbytes / (256 * 512 * 4)   # ~0.141
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

__all__ = ["ACTIVATION_FORMATS", "FORMATS", "QTensor", "dequantize", "e2m1_decode", "e2m1_encode", "e4m3", "fake_quant", "fp8_linear",
           "from_named", "quantize", "quantize_named", "to_named"]

FORMATS = ("fp8_block", "mxfp8", "nvfp4", "int4")
# Formats whose matmuls take quantized activations too (W8A8: per token, in groups of 128 / blocks
# of 32, as FP8 GEMMs take them). nvfp4 and int4 are served weight-only (W4A16): an NVFP4
# activation's per-tensor scale would span the batch, making a request's output depend on its
# neighbours.
ACTIVATION_FORMATS = ("fp8_block", "mxfp8")
E4M3_MAX = 448.0
E4M3_EMAX = 8  # the largest power of two E4M3 holds: 2^8
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; bit 3 is the sign
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E8M0_NAN = 255
BLOCKS = {"mxfp8": 32, "nvfp4": 16, "int4": 128, "fp8_block": 128}
PACKED, SCALE, GLOBAL_SCALE = "weight_packed", "weight_scale", "weight_global_scale"


@dataclass(frozen=True)
class QTensor:
    """A quantized tensor (module docstring). `values`: float8_e4m3fn [rows, cols] (fp8_block,
    mxfp8) or uint8 [rows, ceil(cols / 2)] packed nibbles (nvfp4, int4); `scales`: per block
    [rows / block_rows, cols / block_cols] (float32; uint8 E8M0 for mxfp8; float8_e4m3fn for nvfp4);
    `tensor_scale`: nvfp4's float32 per-tensor scale. `shape`/`dtype`: the original's."""

    fmt: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    values: torch.Tensor
    scales: torch.Tensor
    block: tuple[int, int]
    tensor_scale: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        extra = self.tensor_scale.numel() * 4 if self.tensor_scale is not None else 0
        return (self.values.numel() * self.values.element_size() + self.scales.numel() * self.scales.element_size()
                + extra)

    def rows(self, start: int, stop: int) -> QTensor:
        """Rows start:stop of a 2-D quantized tensor, without dequantizing (start a multiple of the
        block's rows: 128 for fp8_block weights, any row otherwise)."""
        if len(self.shape) != 2 or start % self.block[0] or not 0 <= start < stop <= self.shape[0]:
            raise ValueError(f"rows {start}:{stop} of a {self.fmt} tensor of shape {self.shape} (blocks of "
                             f"{self.block[0]} rows): give a 2-D tensor and a start on a block boundary")
        br = self.block[0]
        return QTensor(self.fmt, (stop - start, self.shape[1]), self.dtype, self.values[start:stop],
                       self.scales[start // br:-(-stop // br)], self.block, self.tensor_scale)


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """float32 -> float8_e4m3fn, round to nearest even, saturating at +-448 (Inf too); NaN stays NaN."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float32 -> E2M1 codes (uint8, 0..15: bit 3 the sign), round to nearest even, saturating at
    +-6. A tie between two values goes to the one whose code is even (its mantissa bit is 0)."""
    magnitude = x.float().abs().nan_to_num(nan=0.0)
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32, device=x.device)
    code = torch.bucketize(magnitude, mids)  # a value equal to a midpoint gets the lower code
    at_mid = magnitude == mids[code.clamp(max=len(_E2M1_MIDPOINTS) - 1)]
    code = code + (at_mid & (code % 2 == 1)).long()  # ties: to the even code
    sign = torch.signbit(x).long() << 3
    return (code | sign).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) -> float32."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    values = table[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -values, values)


def quantize(x: torch.Tensor, fmt: str, *, kind: str = "weight") -> QTensor:
    """`x` in format `fmt` (module docstring); `kind` "activation" gives fp8_block 1 x 128 groups."""
    if fmt not in FORMATS:
        raise ValueError(f"quantization format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if kind not in ("weight", "activation"):
        raise ValueError(f"kind must be 'weight' or 'activation', got {kind!r}")
    if x.dim() == 0 or x.numel() == 0:
        raise ValueError(f"cannot quantize a tensor of shape {tuple(x.shape)}: give at least one element per row")
    rows_RC = x.detach().float().reshape(-1, x.shape[-1])
    if fmt == "fp8_block" and kind == "weight":
        if x.dim() != 2:
            raise ValueError(f"fp8_block weights are 2-D (128 x 128 tiles), got shape {tuple(x.shape)}; quantize "
                             "activations with kind='activation'")
        block = (128, 128)
    else:
        block = (1, BLOCKS[fmt])
    blocks = _blocks(rows_RC, block)  # [Rb, br, Cb, bc], zero-padded
    amax = blocks.abs().amax(dim=(1, 3))  # [Rb, Cb]; NaN propagates
    if fmt == "fp8_block":
        scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        values = e4m3(rows_RC / _expand(scale, block, rows_RC.shape))
        return QTensor(fmt, tuple(x.shape), x.dtype, values, scale, block)
    if fmt == "mxfp8":
        code = _e8m0_codes(amax)
        exponent = code.float() - 127
        scale = torch.where(code == E8M0_NAN, torch.full_like(exponent, float("nan")), torch.exp2(exponent))
        values = e4m3(rows_RC / _expand(scale, block, rows_RC.shape))
        return QTensor(fmt, tuple(x.shape), x.dtype, values, code, block)
    if fmt == "nvfp4":
        tensor_amax = rows_RC.abs().amax()
        encode = torch.where(tensor_amax > 0, E4M3_MAX * E2M1_MAX / tensor_amax, torch.ones_like(tensor_amax))
        block_scale = e4m3(amax / E2M1_MAX * encode)  # [Rb, Cb] float8
        decode = 1.0 / encode
        full = _expand(block_scale.float() * decode, block, rows_RC.shape)
        scaled = torch.where(full != 0, rows_RC / full, torch.zeros_like(rows_RC))
        values = _pack(e2m1_encode(scaled))
        return QTensor(fmt, tuple(x.shape), x.dtype, values, block_scale, block, tensor_scale=decode.reshape(1))
    # int4
    scale = torch.where(amax > 0, amax / 7.0, torch.ones_like(amax))
    q = torch.round(rows_RC / _expand(scale, block, rows_RC.shape)).clamp(-7, 7).to(torch.int8)
    return QTensor(fmt, tuple(x.shape), x.dtype, _pack((q & 0xF).to(torch.uint8)), scale, block)


def dequantize(q: QTensor) -> torch.Tensor:
    """The values `q` stands for, in its original dtype and shape."""
    cols = q.shape[-1]
    if q.fmt in ("fp8_block", "mxfp8"):
        values = q.values.float()
        if q.fmt == "mxfp8":
            exponent = q.scales.float() - 127
            scale = torch.where(q.scales == E8M0_NAN, torch.full_like(exponent, float("nan")), torch.exp2(exponent))
        else:
            scale = q.scales
        out = values * _expand(scale, q.block, values.shape)
    elif q.fmt == "nvfp4":
        assert q.tensor_scale is not None
        values = e2m1_decode(_unpack(q.values, cols))
        out = values * _expand(q.scales.float() * q.tensor_scale, q.block, values.shape)
    elif q.fmt == "int4":
        nibbles = _unpack(q.values, cols).to(torch.int8)
        ints = torch.where(nibbles >= 8, nibbles - 16, nibbles).float()
        out = ints * _expand(q.scales, q.block, ints.shape)
    else:
        raise ValueError(f"unknown quantization format {q.fmt!r}")
    return out.reshape(q.shape).to(q.dtype)


class _FakeQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, fmt: str, kind: str) -> torch.Tensor:  # type: ignore[override]
        return dequantize(quantize(x, fmt, kind=kind))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return grad, None, None


class _Fp8Linear(torch.autograd.Function):
    """y = q(x) q(W)^T + b with E4M3 blockwise fake-quant (activations and gradients in 1 x 128
    groups, weights in 128 x 128 tiles), both backward matmuls on the quantized gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,  # type: ignore[override]
                matmul: Callable[..., torch.Tensor]) -> torch.Tensor:
        xq = dequantize(quantize(x, "fp8_block", kind="activation"))
        wq = dequantize(quantize(weight, "fp8_block"))
        ctx.save_for_backward(xq, wq)
        ctx.has_bias = bias is not None
        return matmul(xq, wq, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, None]:  # type: ignore[override]
        xq, wq = ctx.saved_tensors
        gq = dequantize(quantize(grad, "fp8_block", kind="activation"))
        grad_x = gq @ wq
        grad_w = gq.reshape(-1, gq.shape[-1]).t() @ xq.reshape(-1, xq.shape[-1])
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               matmul: Callable[..., torch.Tensor] = torch.nn.functional.linear) -> torch.Tensor:
    """A linear layer whose forward and backward matmuls run on FP8 blockwise values (emulated:
    quantize, dequantize, matmul in the input's dtype), DeepSeek-V3's FP8 training recipe. The
    forward's matmul is `matmul(x, weight, bias)` (e.g. a batch-invariant one)."""
    return _Fp8Linear.apply(x, weight, bias, matmul)


def fake_quant(x: torch.Tensor, fmt: str, *, kind: str = "weight") -> torch.Tensor:
    """dequantize(quantize(x)) in the forward pass, the straight-through gradient (identity) in the
    backward: quantization-aware training trains the weights the quantized copy will serve."""
    return _FakeQuant.apply(x, fmt, kind)


# ----- named tensors: how a quantized weight travels and is held -----

def to_named(module: str, q: QTensor) -> dict[str, torch.Tensor]:
    """`q` as plain tensors named under `module` (module docstring): uint8 value bytes, the scales
    (float32, or their bytes as uint8), and nvfp4's float32 global scale."""
    scales = q.scales.view(torch.uint8) if q.scales.dtype == torch.float8_e4m3fn else q.scales
    named = {f"{module}.{PACKED}": q.values.view(torch.uint8), f"{module}.{SCALE}": scales}
    if q.tensor_scale is not None:
        named[f"{module}.{GLOBAL_SCALE}"] = q.tensor_scale
    return named


def from_named(fmt: str, shape: tuple[int, ...], dtype: torch.dtype, packed: torch.Tensor, scale: torch.Tensor,
               global_scale: torch.Tensor | None = None) -> QTensor:
    """The QTensor that `to_named` split up (no copy), for a weight of `shape` and `dtype`."""
    if fmt not in FORMATS:
        raise ValueError(f"quantization format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    fp8 = fmt in ("fp8_block", "mxfp8")
    block = (128, 128) if fmt == "fp8_block" and len(shape) == 2 else (1, BLOCKS[fmt])
    values = packed.view(torch.float8_e4m3fn) if fp8 else packed
    scales = scale.view(torch.float8_e4m3fn) if fmt == "nvfp4" else scale
    return QTensor(fmt, tuple(shape), dtype, values, scales, block, global_scale if fmt == "nvfp4" else None)


def quantize_named(named: Mapping[str, torch.Tensor], fmt: str,
                   quantized: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """`named` with every 2-D `<module>.weight` for which `quantized(module)` holds replaced by its
    format-`fmt` tensors (`to_named`), quantized from the tensor as given; the rest as they are."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in named.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and tensor.dim() == 2 and quantized(module):
            out.update(to_named(module, quantize(tensor, fmt)))
        else:
            out[name] = tensor
    return out


# ----- helpers -----

def _blocks(rows_RC: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    br, bc = block
    rows, cols = rows_RC.shape
    padded = torch.nn.functional.pad(rows_RC, (0, -cols % bc, 0, -rows % br))
    return padded.reshape(padded.shape[0] // br, br, padded.shape[1] // bc, bc)


def _expand(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """Per-block scales [Rb, Cb] as a per-element tensor of `shape` (edge blocks cropped)."""
    rows, cols = shape
    return scale.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)[:rows, :cols]


def _e8m0_codes(amax: torch.Tensor) -> torch.Tensor:
    """MX's shared exponent floor(log2(amax)) - 8 as a biased E8M0 byte, clamped to [-127, 127]
    (zero amax: -127; Inf or NaN: the NaN code). frexp gives floor(log2) exactly."""
    _, exponent = torch.frexp(amax)  # amax = m * 2^e, m in [0.5, 1): floor(log2(amax)) = e - 1
    shared = (exponent - 1 - E4M3_EMAX).clamp(-127, 127)
    shared = torch.where(amax > 0, shared, torch.full_like(shared, -127))
    code = (shared + 127).to(torch.uint8)
    return torch.where(torch.isfinite(amax), code, torch.full_like(code, E8M0_NAN))


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 nibbles [rows, cols] -> bytes [rows, ceil(cols / 2)], element 2i in the low nibble."""
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _unpack(packed: torch.Tensor, cols: int) -> torch.Tensor:
    out = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    return out[:, :cols]
