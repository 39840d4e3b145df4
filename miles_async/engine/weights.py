"""The engine's weights as the target of an update: versions, a double buffer, the torn state.

Every way new weights reach an engine (tensors in the same process, a checkpoint folder, a
broadcast, a write into shared memory, a disk delta) goes through one protocol, so every one
of them is atomic from the engine's view and ordered by version:

    target = store.begin(version)     # refuses a version not newer than the engine's
    ... the transport writes every tensor of `target` (bucket by bucket, any thread or process)
    store.commit(expected_checksums)  # verifies if asked, then makes the new version live
    store.abort(reason)               # or gives up

An engine's store (`engine.weights`) also runs every whole update itself, between steps under
the engine's lock, and tells the engine when the live weights changed (it flushes its prefix
cache, and its model runner prepares the new weights once):

    await engine.weights.update_from_tensors(state_dict, weight_version=3)   # or update_from_disk(dir)
    await engine.weights.begin_update(4) ... await engine.weights.commit_update(checksums)
    await engine.weights.apply_delta(folder); await engine.weights.adopt_weights(tensors, 5)

Versions are integers; `label` is what SGLang clients see as `weight_version` (an integer's
text, or a name such as "step-7" given over HTTP, which then counts as the next integer).

Double buffer (`double_buffer=True`, the default where memory allows, twice the weights'
bytes): `target` is a second set of tensors and the model keeps running on the live set until
`commit` swaps them (each parameter's `.data` is pointed at the other buffer: no copy), so an
update that dies midway leaves the engine serving the previous version. Single buffer: `target`
is the live set itself; from `begin` until a good `commit` the weights are *torn* and
`serving_error()` says why: the engine then admits no request and its health reports it, until
a complete version commits.

Shared memory (`shared=True`): each buffer is a `transport.shm.SharedWeights` segment, the
model's parameters are views into it, and another process on the node (the pusher) attaches to
`target_segment` by name and writes the shards straight in. Its seqlock counter tells `commit`
whether that write completed; a live segment that someone writes outside an update makes the
engine torn too.

Broadcast (`GroupReceiver`, SGLang's distributed endpoints): the engine joins a torch.distributed
group whose rank 0 broadcasts the tensors, bucket by bucket, into `target`; the update commits when
every weight has arrived (or when the caller closes its begin/end session).

Devices: the store's tensors are the model's, on the engine's device; `write` copies (and casts)
tensors from anywhere, the CPU included, into them. Shared-memory stores are CPU only.

Which weights (`names`): by default every weight of the model; with LoRA the adapters alone (an
update writes them, the engine merges them into its copy of the base; engine/runner.py). A model
holding its projections in a quantized format (`weight_format`, `CausalLM.hold_quantized`) has
the format's tensors in their place (`<module>.weight_packed`, ...), which a pusher sends
quantized; a full-precision `<module>.weight` that arrives instead (a checkpoint, tensors from a
client) is quantized on arrival.

Releasing (`release`, SGLang's /release_memory_occupation): every tensor is replaced by an empty
one, its memory given back, its content gone; `reclaim` allocates them again (zeros). The engine
is torn in between and after, until a complete update commits: a colocated run releases the
engine's memory while the trainer trains, then resumes it and pushes the new version.

Adopting (`adopt`, the colocated handoff): a tensor of the engine's dtype, device and shape is
taken as it is, no copy; the previous tensors stay untouched until `commit`, so adoption is
double-buffered at no extra memory.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, cast

import torch

from miles_async.engine import compute
from miles_async.models.draft import PREFIX as DRAFT_PREFIX
from miles_async.models.draft import has_draft
from miles_async.transport.buckets import NamedTensors, as_items
from miles_async.transport.errors import TransportError
from miles_async.transport.shm import SharedWeights
from miles_async.transport.verify import checksums, compare, random_fill

if TYPE_CHECKING:
    from miles_async.transport.groups import WeightGroup

log = logging.getLogger(__name__)


class StaleVersionError(ValueError):
    """An update whose version is not newer than the engine's: rejected, nothing written."""


class WeightsUnavailableError(RuntimeError):
    """The weights are torn (an update did not complete); nothing is served until one does (HTTP 503)."""


def parse_version(label: str | int | None, current: int) -> tuple[int, str]:
    """(version, label) for an update labelled `label`: an integer (or its text) as is, a name as current + 1."""
    if label is None:
        return current + 1, str(current + 1)
    if isinstance(label, int) or label.strip().lstrip("-").isdigit():
        version = int(label)
        return version, str(version)
    return current + 1, label


def unique_weights(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(name -> tensor for each distinct tensor, alias -> name for tied ones such as lm_head.weight)."""
    by_id: dict[int, str] = {}
    weights: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        first = by_id.setdefault(id(tensor), name)
        if first == name:
            weights[name] = tensor
        else:
            aliases[name] = first
    return weights, aliases


class WeightStore:
    """One engine's weights and their update state; see the module docstring.

    Two faces. The engine's (async, each between steps under the engine's `lock`, each calling
    `on_change` once the weights changed: the engine flushes its prefix cache and has its model
    runner `prepare()` them): `update_from_tensors`, `update_from_disk`, `apply_delta`,
    `adopt_weights`, `begin_update` / `commit_update` / `abort_update`, `relabel`, `checksums`,
    `random_fill`. The transports' (sync, not thread-safe): `begin` .. `write` / `mark_written`
    into `target()` .. `commit` or `abort`, which the engine's face wraps; a transport in another
    thread or process only writes `target` tensors.
    """

    def __init__(self, model: torch.nn.Module, *, double_buffer: bool = False, shared: bool = False,
                 version: int = 0, label: str | None = None, names: list[str] | None = None,
                 weight_format: str = "", lock: asyncio.Lock | None = None,
                 on_change: Callable[[], Awaitable[None]] | None = None, keep_draft: bool = False,
                 model_path: str | None = None) -> None:
        self._model = model
        self._lock = lock or asyncio.Lock()
        self._on_change = on_change
        self.keep_draft = keep_draft  # a speculating engine's draft head (models/draft.py) is updated too
        self.model_path = model_path  # the checkpoint folder the weights last came from, if any
        self.params, self.aliases = unique_weights(model)
        self.weight_format = weight_format
        if names is not None:  # the weights updates write (LoRA: the adapters); the rest stays as loaded
            self.params = {name: self.params[name] for name in names}
            self.aliases = {}
        self.version = version
        self.label = label if label is not None else str(version)
        self.shared = shared
        self.double_buffer = double_buffer
        self.torn: str | None = None
        self.updating: int | None = None  # the version between begin and commit/abort
        self._updating_label: str | None = None
        self._segments: list[SharedWeights] = []
        self._live_seq = 0
        self._target_seq = 0
        self._written: set[str] = set()
        self._adopted: set[int] = set()  # ids of tensors taken by `adopt`: never written into afterwards
        self.released: dict[str, tuple[torch.Size, torch.dtype, torch.device]] | None = None  # `release`d: shapes
        live = {name: p.detach() for name, p in self.params.items()}
        if shared:
            off_cpu = {str(t.device) for t in live.values() if t.device.type != "cpu"}
            if off_cpu:
                raise ValueError(f"shared-memory weights are CPU memory, but the model's weights are on "
                                 f"{', '.join(sorted(off_cpu))}: use shared=False (another transport) for them")
            segment = SharedWeights.like(live)
            segment.write(live)
            self._segments.append(segment)
            live = segment.tensors
            self._point_at(live)
            self._live_seq = segment.seq
        self.live: dict[str, torch.Tensor] = live
        self.spare: dict[str, torch.Tensor] | None = None
        if double_buffer:
            if shared:
                self._segments.append(SharedWeights.like(live))
                self.spare = self._segments[1].tensors
            else:
                self.spare = {name: torch.empty_like(t) for name, t in live.items()}

    # ----- state -----

    @property
    def device(self) -> torch.device:
        """Where the weights live (the engine's device)."""
        return next(iter(self.params.values())).device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.live.values())

    @property
    def live_segment(self) -> str | None:
        return self._segments[0].name if self._segments else None

    @property
    def target_segment(self) -> str | None:
        """The segment a pusher in another process writes the update into (shared stores)."""
        if not self._segments:
            return None
        return self._segments[-1].name if self.double_buffer else self._segments[0].name

    def serving_error(self) -> str | None:
        """Why the engine must not run the model now (torn weights), or None."""
        if self.torn is not None:
            return self.torn
        if self._segments and self._segments[0].seq != self._live_seq:
            self.torn = (f"the live shared segment {self._segments[0].name!r} was written outside an update "
                         f"(seq {self._live_seq} -> {self._segments[0].seq}); push a complete version")
            return self.torn
        return None

    def check_newer(self, version: int) -> None:
        """Refuse a version older than the engine's, or the same one while it is served (a torn or
        released engine may get its own version again: that restores it)."""
        if version < self.version or (version == self.version and self.serving_error() is None):
            raise StaleVersionError(f"weight version {version} is not newer than the engine's {self.version}; "
                                    "the update is rejected (push a newer version)")

    # ----- the protocol -----

    def begin(self, version: int, label: str | None = None, *, adopting: bool = False) -> dict[str, torch.Tensor]:
        """Start an update to `version`; return the tensors to write (name -> tensor).

        A spare tensor that an earlier `adopt` took from the trainer is replaced by a fresh one
        unless this update adopts too: a copy must never write into memory the trainer handed over.
        """
        self.check_newer(version)
        if self.released is not None:
            raise ValueError("the weights were released (release_memory_occupation): resume_memory_occupation first")
        if self.updating is not None:
            self.abort(f"superseded by version {version}")
        self.updating, self._updating_label = version, label if label is not None else str(version)
        self._written = set()
        if self.double_buffer:
            assert self.spare is not None
            if not adopting and self._adopted:
                for name, tensor in self.spare.items():
                    if id(tensor) in self._adopted:
                        self._adopted.discard(id(tensor))
                        self.spare[name] = torch.empty_like(tensor)
            if self._segments:
                self._target_seq = self._segments[1].seq
            return self.spare
        self.torn = (f"weights are being replaced by version {version} (from version {self.version}); "
                     "not serving until it completes")
        if self._segments:
            self._target_seq = self._segments[0].seq
        return self.live

    def retarget(self, version: int, label: str | None = None) -> None:
        """Change the version the update in progress commits as (a later bucket named it)."""
        if self.updating is None:
            raise RuntimeError("no weight update in progress: call begin(version) first")
        self.check_newer(version)
        self.updating, self._updating_label = version, label if label is not None else str(version)

    @property
    def num_missing(self) -> int:
        """Tensors the update in progress has not written yet (all of them when none is in progress)."""
        return len([name for name in self.live if name not in self._written]) if self.updating is not None \
            else len(self.live)

    def target(self) -> dict[str, torch.Tensor]:
        if self.updating is None:
            raise RuntimeError("no weight update in progress: call begin(version) first")
        return self.spare if self.double_buffer else self.live  # type: ignore[return-value]

    @torch.no_grad()
    def write(self, named: NamedTensors) -> int:
        """Copy (casting to the engine's dtype) into the update's target; return the bytes written."""
        target = self.target()
        items = self.check(as_items(named))
        if self._segments:  # through the segment's seqlock, like a pusher in another process
            (self._segments[-1] if self.double_buffer else self._segments[0]).write(items)
        else:
            for name, tensor in items:
                target[name].copy_(tensor)
        self.mark_written(name for name, _ in items)
        return sum(target[name].numel() * target[name].element_size() for name, _ in items)

    def mark_written(self, names: Iterable[str]) -> None:
        """Record tensors an in-process transport wrote into `target()` itself (e.g. a broadcast)."""
        self._written.update(self.aliases.get(name, name) for name in names)

    def adopt(self, named: NamedTensors) -> int:
        """The colocated handoff: take each tensor as the new weight when it matches, else copy it.

        Taken as it is: on a double-buffered store, a tensor of the engine's dtype and device,
        contiguous. Otherwise copied (cast) into the target. Not for shared-memory stores.
        Returns how many tensors were taken without a copy.
        """
        if self.shared:
            raise ValueError("a shared-memory store cannot adopt tensors: its weights live in the segment")
        target = self.target()
        taken = 0
        for name, tensor in self.check(as_items(named)):
            old = target[name]
            if (tensor.dtype == old.dtype and tensor.device == old.device and tensor.is_contiguous()
                    and self.double_buffer):
                self._adopted.discard(id(old))
                target[name] = tensor.detach()
                self._adopted.add(id(target[name]))
                taken += 1
            else:
                if id(old) in self._adopted:  # the trainer's memory from an earlier handoff: not ours to write
                    self._adopted.discard(id(old))
                    old = target[name] = torch.empty_like(old)
                with torch.no_grad():
                    old.copy_(tensor)
            self._written.add(name)
        return taken

    def commit(self, expected: Mapping[str, str] | None = None) -> int:
        """Make the update live (after verifying `expected` checksums, if given); return the version.

        Raises TransportError (and aborts the update) if a shared target was not written
        completely or the checksums differ: a double-buffered engine keeps its previous version, a
        single-buffered one stays torn.
        """
        if self.updating is None:
            raise RuntimeError("no weight update in progress: call begin(version) first")
        target = self.target()
        problem = self._incomplete()
        if problem is None and expected is not None:
            canonical = {self.aliases.get(name, name): value for name, value in expected.items()}
            bad = compare(canonical, checksums(target))
            if bad:
                problem = (f"verification failed: {len(bad)} tensor(s) differ from the pusher's checksums, "
                           f"e.g. {', '.join(bad[:4])}")
        if problem is not None:
            self.abort(problem)
            raise TransportError(problem)
        if self.double_buffer:
            self.live, self.spare = target, self.live
            self._point_at(self.live)
            if self._segments:
                self._segments.reverse()
        if self._segments:
            self._live_seq = self._segments[0].seq
        self.version, self.label = self.updating, self._updating_label or str(self.updating)
        self.updating = self._updating_label = None
        self.torn = None
        return self.version

    def abort(self, reason: str) -> None:
        """Give up the update in progress: double-buffered, the previous version stays; else torn."""
        if self.updating is None:
            return
        version, self.updating, self._updating_label = self.updating, None, None
        if not self.double_buffer:
            self.torn = (f"the update to version {version} did not complete ({reason}); the weights are torn "
                         f"and the engine does not serve until a complete version arrives")

    # ----- whole-store operations -----

    def record_in_place(self, version: int, label: str | None = None) -> None:
        """Record a version written straight into the live weights by a path that verified it first
        (a disk delta: every tensor decoded and checked before any is written)."""
        self.check_newer(version)
        self.version, self.label = version, label if label is not None else str(version)
        if self._segments:
            self._live_seq = self._segments[0].seq

    def _relabel(self, label: str) -> None:
        integer = label.strip().lstrip("-").isdigit()
        version = int(label) if integer else self.version
        if version < self.version:
            raise StaleVersionError(f"weight version {version} is older than the engine's {self.version}")
        self.version, self.label = version, str(version) if integer else label

    def _random_fill(self, seed: int) -> None:
        random_fill(self.live, seed)
        if self._segments:
            self._live_seq = self._segments[0].seq

    def release(self) -> None:
        """Give the weights' memory back (SGLang's /release_memory_occupation, tag "weights"): every
        tensor, and the spare buffer, becomes empty, their contents gone; the engine is torn until
        `reclaim` and a complete update. Shared-memory weights (the shm transport) cannot: a pusher
        in another process holds their segment."""
        if self._segments:
            raise ValueError("the weights are in a shared-memory segment (the shm transport), which another process "
                             "writes: they cannot be released; use another transport to release engine memory")
        if self.updating is not None:
            raise ValueError(f"a weight update to version {self.updating} is in progress: release after it")
        if self.released is None:
            self.released = {name: (t.shape, t.dtype, t.device) for name, t in self.live.items()}
            empty = {name: t.new_empty(0) for name, t in self.live.items()}
            self._point_at(empty)
            self.live, self.spare = empty, None if self.spare is None else dict(empty)
        self.torn = ("the weights were released (release_memory_occupation): resume_memory_occupation, then push a "
                     "complete version")

    def reclaim(self) -> None:
        """Allocate the released tensors again (zeros; the spare buffer too): the engine stays torn
        until a complete update commits."""
        if self.released is None:
            return
        live = {name: torch.zeros(shape, dtype=dtype, device=device) for name, (shape, dtype, device) in
                self.released.items()}
        self._point_at(live)
        self.live = live
        if self.double_buffer:
            self.spare = {name: torch.empty_like(t) for name, t in live.items()}
        self.released = None
        self.torn = "the weights were released and are allocated again: push a complete version"

    def close(self) -> None:
        """Point the model at private copies and release the shared segments."""
        if not self._segments:
            return
        private = {name: t.clone() for name, t in self.live.items()}
        self._point_at(private)
        self.live, self.spare = private, None
        for segment in self._segments:
            segment.close()
        self._segments = []

    # ----- the engine's face: each between steps, under the engine's lock -----

    async def update_from_tensors(self, named_tensors: NamedTensors, weight_version: str | int | None = None) -> str:
        """Copy a complete set of weights in (between steps, casting to the engine's dtype); return the label.

        `weight_version`: an integer (or its text) newer than the engine's, or a name (the next
        integer); an older one raises StaleVersionError (a ValueError) before anything is
        written, as does a wrong name or shape. The engine's prefix cache is flushed (its KV came
        from the old weights); running requests continue on their existing KV. A speculating
        engine keeps its draft head's weights when the update has none (a checkpoint without a
        draft head); another ignores a draft head's weights.
        """
        version, label = parse_version(weight_version, self.version)
        items = list(as_items(named_tensors))
        if not self.keep_draft:  # a draft head's weights (models/draft.py): for speculating engines only
            items = [(name, tensor) for name, tensor in items if not name.startswith(DRAFT_PREFIX)]
        elif not has_draft(name for name, _ in items):
            items += [(f"{DRAFT_PREFIX}{name}", tensor.detach().clone())
                      for name, tensor in cast(torch.nn.Module, self._model.mtp).state_dict().items()]
        async with self._lock:
            self.check_newer(version)
            self.check(items)  # every name and shape checked before begin() tears anything
            self.begin(version, label)
            try:
                await compute.run(self.write, items)
            except BaseException as e:
                self.abort(f"{type(e).__name__}: {e}")
                raise
            return await self._changed(self.commit())

    async def update_from_disk(self, model_path: str, weight_version: str | int | None = None) -> str:
        """Load a checkpoint folder (off the loop, while generation goes on), then copy it in."""
        from miles_async.models import load_pretrained

        self.check_newer(parse_version(weight_version, self.version)[0])  # before loading
        dtype = next(self._model.parameters()).dtype
        new_model = await compute.run(load_pretrained, model_path, dtype=dtype)
        label = await self.update_from_tensors(new_model.state_dict(), weight_version)
        self.model_path = str(model_path)
        return label

    async def begin_update(self, version: int, label: str | None = None) -> dict[str, torch.Tensor]:
        """Start an update to `version` between steps; return the tensors to write (see `begin`)."""
        async with self._lock:
            return self.begin(version, label)

    async def commit_update(self, expected_checksums: Mapping[str, str] | None = None) -> str:
        """Verify (if checksums are given, on the compute thread) and make the update live; return the label."""
        async with self._lock:
            return await self._changed(await compute.run(self.commit, expected_checksums))

    async def abort_update(self, reason: str) -> None:
        async with self._lock:
            self.abort(reason)

    async def adopt_weights(self, named_tensors: NamedTensors, version: int,
                            expected_checksums: Mapping[str, str] | None = None) -> int:
        """The colocated handoff (transport.colocated): take the tensors as the weights, without a
        copy where the dtype allows. Returns how many tensors were taken as they are. Needs a
        double-buffered store for the no-copy path (otherwise every tensor is copied in place, paused).
        """
        items = list(as_items(named_tensors))
        async with self._lock:
            self.begin(version, adopting=True)
            try:
                taken = await compute.run(self.adopt, items)
                await self._changed(await compute.run(self.commit, expected_checksums))
            except BaseException as e:
                self.abort(f"{type(e).__name__}: {e}")
                raise
            return taken

    async def apply_delta(self, folder: str) -> str:
        """Apply a disk delta (transport.disk_delta) written against this version; return the label.

        The delta is decoded and checked in full before any weight is written, so it is applied
        to the live weights directly, between steps.
        """
        from miles_async.transport.disk_delta import apply_delta

        async with self._lock:
            if (problem := self.serving_error()) is not None:
                raise WeightsUnavailableError(f"a delta needs a complete base version: {problem}")
            version = await compute.run(apply_delta, folder, self.live, self.version)
            self.record_in_place(version)
            return await self._changed(version)

    async def relabel(self, label: str) -> str:
        """Give the live weights a new label (SGLang's /update_weight_version); return the label.

        An integer label is the version (not older than the engine's), a name keeps the version.
        Tokens sampled from now on report it; the weights and the prefix cache are unchanged.
        """
        async with self._lock:
            self._relabel(label)
            return self.label

    async def checksums(self) -> dict[str, str]:
        """The live weights' checksums (transport.verify), between steps."""
        async with self._lock:
            return await compute.run(checksums, self.live)

    async def random_fill(self, seed: int) -> None:
        """Overwrite the live weights with seeded noise: the start of the random-fill verification check."""
        async with self._lock:
            await compute.run(self._random_fill, seed)
            await self._changed(self.version)

    async def _changed(self, version: int) -> str:
        """The live weights changed (to `version`): tell the engine; return the label now served."""
        if self._on_change is not None:
            await self._on_change()
        log.debug("weights now at version %s (%s)", version, self.label)
        return self.label

    # ----- helpers -----

    def _point_at(self, tensors: Mapping[str, torch.Tensor]) -> None:
        for name, param in self.params.items():
            param.data = tensors[name]

    def check(self, items: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Map aliases to their tensor's name (dropping repeats), quantize a full-precision weight
        the store holds in its `weight_format`, and check every name and shape."""
        resolved = []
        seen: set[str] = set()
        for name, tensor in self._quantized(items):
            name = self.aliases.get(name, name)
            if name in seen:
                continue  # a tied weight sent under both its names: one copy is enough
            seen.add(name)
            old = self.live.get(name)
            if old is None:
                raise ValueError(f"weight {name!r} is not in the model (it has e.g. {', '.join(list(self.live)[:4])})")
            if tuple(tensor.shape) != tuple(old.shape):
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, the model's is {tuple(old.shape)}")
            resolved.append((name, tensor))
        return resolved

    def _quantized(self, items: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        for name, tensor in items:
            if self.weight_format and name not in self.live and f"{name}_packed" in self.live:
                from miles_async.kernels.quant import quantize, to_named

                yield from to_named(name.removesuffix(".weight"), quantize(tensor, self.weight_format)).items()
            else:
                yield name, tensor

    def _incomplete(self) -> str | None:
        """Why the target does not hold a whole version, as far as the store can tell; None if it does."""
        missing = [name for name in self.live if name not in self._written]
        if self._segments:
            segment = self._segments[-1] if self.double_buffer else self._segments[0]
            seq = segment.seq
            if seq % 2:
                return f"the write into shared segment {segment.name!r} did not finish (seq {seq} is odd)"
            if seq != self._target_seq and not self._written:
                return None  # written by another process: only a verification pass can tell more
        if missing:
            return (f"the update to version {self.updating} is missing {len(missing)} of {len(self.live)} "
                    f"tensors, e.g. {', '.join(missing[:4])}")
        return None


class GroupReceiver:
    """SGLang's distributed weight path into one engine (`/init_weights_update_group`,
    `/update_weights_from_distributed`, `/destroy_weights_update_group`, `/begin_weight_update`,
    `/end_weight_update`).

    A group is a standalone torch.distributed group (transport.groups.WeightGroup, with SGLang's
    store keys for its name, so a trainer written for SGLang joins it as rank 0) whose rank 0 is
    the pusher; the engine is rank `rank_offset` (one rank: no tensor parallelism). Each `receive`
    takes the tensors the pusher broadcasts, one per name, in order, into the update target
    (WeightStore.begin on the first bucket), so an update is atomic however many buckets it takes:
    outside a session it commits when every weight has arrived; inside `begin_session` ..
    `end_session` it commits at the end (which fails, keeping the previous version on a
    double-buffered engine, if weights are missing).
    """

    def __init__(self, store: WeightStore, timeout_s: float = 300.0) -> None:
        self.store = store
        self.timeout_s = timeout_s
        self.groups: dict[str, WeightGroup] = {}
        self.in_session = False

    async def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                         group_name: str, backend: str) -> None:
        from miles_async.transport.groups import WeightGroup

        if group_name in self.groups:
            raise ValueError(f"weight update group {group_name!r} exists already; destroy it first")
        if not 0 < rank_offset < world_size:
            raise ValueError(f"rank_offset={rank_offset} must be in [1, world_size={world_size}): rank 0 is the pusher")
        if backend == "nccl" and self.store.device.type != "cuda":
            raise ValueError(f"backend 'nccl' moves GPU memory only and this engine's weights are on "
                             f"{self.store.device}: use backend 'gloo', or start the engine with device 'cuda'")
        self.groups[group_name] = await asyncio.to_thread(
            WeightGroup.join, master_address, master_port, rank_offset, world_size, backend=backend,
            timeout_s=self.timeout_s, name=group_name, sglang=True)

    async def destroy_group(self, group_name: str) -> None:
        group = self.groups.pop(group_name, None)
        if group is None:
            raise ValueError(f"no weight update group {group_name!r} (have: {', '.join(self.groups) or 'none'})")
        await asyncio.to_thread(group.close)

    async def begin_session(self) -> None:
        self.in_session = True

    async def end_session(self) -> str:
        """Commit the session's update; return the label now served."""
        self.in_session = False
        if self.store.updating is None:
            return self.store.label  # nothing was sent
        return await self.store.commit_update()

    async def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
                      weight_version: str | None) -> str | None:
        """Receive one bucket; return the label now served if it completed the update, else None."""
        group = self.groups.get(group_name)
        if group is None:
            raise ValueError(f"no weight update group {group_name!r}: POST /init_weights_update_group first")
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})")
        kinds = [_dtype(d) for d in dtypes]
        # NCCL receives on the engine's GPU; gloo on the host (`write` then copies to the engine's device)
        device = self.store.device if group.backend == "nccl" else torch.device("cpu")
        # Receive first, whatever the names say: the pusher is blocked in its broadcasts until then.
        tensors = await asyncio.to_thread(self._receive, group, kinds, shapes, device)
        store = self.store
        version, label = parse_version(weight_version, store.version)
        items = list(zip(names, tensors))
        try:
            store.check(items)  # before begin() tears anything
            if store.updating is None:
                await store.begin_update(version, label)
            elif weight_version is not None and version != store.updating:
                store.retarget(version, label)
            await compute.run(store.write, items)
        except BaseException as e:  # a bad bucket ends the update: the pusher starts over
            await store.abort_update(f"{type(e).__name__}: {e}")
            raise
        if self.in_session or store.num_missing:
            return None
        return await store.commit_update()

    @staticmethod
    def _receive(group: WeightGroup, kinds: list[torch.dtype], shapes: list[list[int]],
                 device: torch.device) -> list[torch.Tensor]:
        tensors = []
        for kind, shape in zip(kinds, shapes):
            tensor = torch.empty(shape, dtype=kind, device=device)
            group.broadcast(tensor, src=0)
            tensors.append(tensor)
        return tensors

    async def close(self) -> None:
        for name in list(self.groups):
            await self.destroy_group(name)


def _dtype(name: str) -> torch.dtype:
    """SGLang's dtype text ("bfloat16", or "torch.bfloat16") -> the torch dtype."""
    kind = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(kind, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype (e.g. 'float32', 'bfloat16')")  # noqa: TRY004 - a bad value (HTTP 400)
    return kind
