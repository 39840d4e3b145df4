"""Bucketing and the per-family name/layout conversion shared by every weight transport.

`split_buckets` cuts an ordered name -> tensor mapping into buckets of at most `bucket_bytes`
(a tensor larger than that travels alone), in the mapping's order, with the same greedy rule as
`Trainer.export_weights`, so a bucket list is reproducible from the names and sizes alone
(`split_sizes`, which the RDMA planner uses). `convert(family, named)` maps the trainer's
parameter names and layouts to the engine's, one converter per model family.

Try it:
    python -c "import torch; from miles_async.transport.buckets import split_buckets; \
print([[n for n, _ in b] for b in split_buckets({'a': torch.zeros(4), 'b': torch.zeros(2)}, 16)])"
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
Converter = Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of the tensor's elements (not of its storage, which a view may exceed)."""
    return tensor.numel() * tensor.element_size()


def as_items(named: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    return list(named.items() if isinstance(named, Mapping) else named)


def split_sizes(sizes: Iterable[tuple[str, int]], bucket_bytes: int) -> list[list[tuple[str, int]]]:
    """Group (name, nbytes) in order into buckets of at most `bucket_bytes`; an oversized one goes alone."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[list[tuple[str, int]]] = []
    pending: list[tuple[str, int]] = []
    pending_bytes = 0
    seen: set[str] = set()
    for name, nbytes in sizes:
        if name in seen:
            raise ValueError(f"tensor name {name!r} appears twice; every name must be unique")
        seen.add(name)
        if pending and pending_bytes + nbytes > bucket_bytes:
            buckets.append(pending)
            pending, pending_bytes = [], 0
        pending.append((name, nbytes))
        pending_bytes += nbytes
    if pending:
        buckets.append(pending)
    return buckets


def split_buckets(named: NamedTensors, bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Group named tensors in order into buckets of at most `bucket_bytes` (see `split_sizes`)."""
    items = as_items(named)
    by_name = dict(items)
    size_buckets = split_sizes(((name, tensor_nbytes(t)) for name, t in items), bucket_bytes)
    return [[(name, by_name[name]) for name, _ in bucket] for bucket in size_buckets]


# ----- name / layout conversion, trainer -> engine -----


def identity(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Same names, same layouts: our own engine runs the trainer's module tree."""
    return dict(named)


_QKV = ("q_proj", "k_proj", "v_proj")


def fuse_qkv(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fuse `*.self_attn.{q,k,v}_proj.{weight,bias}` into `*.self_attn.qkv_proj.*` (rows q, k, v).

    The layout engines such as vLLM/SGLang keep; an example of a layout-changing converter for a
    family whose engine wants it. Every other tensor passes through in order.
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in named.items():
        prefix, _, leaf = name.rpartition(".")
        module_prefix, _, proj = prefix.rpartition(".")
        if proj not in _QKV or not module_prefix.endswith("self_attn"):
            out[name] = tensor
            continue
        if proj != "q_proj":
            continue  # emitted with q_proj
        parts = []
        for p in _QKV:
            key = f"{module_prefix}.{p}.{leaf}"
            if key not in named:
                raise ValueError(f"fuse_qkv: {name!r} has no matching {key!r}")
            parts.append(named[key])
        out[f"{module_prefix}.qkv_proj.{leaf}"] = torch.cat(parts, dim=0)
    return out


# One converter per model family (miles_async.models.FAMILIES); our engine uses the trainer's names.
CONVERTERS: dict[str, Converter] = {
    "llama": identity,
    "qwen2": identity,
    "qwen3": identity,
    "qwen3_moe": identity,
}


def convert(family: str, named: NamedTensors, converters: Mapping[str, Converter] = CONVERTERS) -> dict[str, torch.Tensor]:
    """Trainer names/layouts -> engine names/layouts for `family`."""
    if family not in converters:
        raise ValueError(f"no weight converter for family {family!r}; known: {', '.join(converters)}")
    return converters[family](dict(as_items(named)))
