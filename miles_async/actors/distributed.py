"""The `distributed` weight transport: SGLang's own weight-update group, for `rollout.backend = "sglang"`.

    WeightPusher, rank 0 ──torch.distributed broadcast, one tensor at a time, in order──► SGLang server(s)
        │ BeginUpdate, JoinWeightGroup, ReceiveDistributed, CommitUpdate                     ▲ ranks 1..
        ▼                                                                                  │
    ExternalEngineActor ──/init_weights_update_group, /begin_weight_update, /update_weights_from_distributed
                          (one per bucket: names, dtypes, shapes, group_name, flush_cache, weight_version),
                          /end_weight_update, the probe, /destroy_weights_update_group────┘

Set `weights.transport = "distributed"` (and `weights.backend`: "gloo" on CPU, "nccl" on GPU).
Try it: `pytest tests/e2e/test_sglang_attach.py -k distributed -s` (a run attached to
`miles-async serve engine`, which serves these endpoints as SGLang 0.5.23 defines them).

Design choices, and why:
- **Its own name.** "distributed" is SGLang's (`/update_weights_from_distributed`), not our
  "broadcast": the wire differs. Ours sends a layout fingerprint first and packs small tensors into
  byte buffers (miles_async/transport/broadcast.py); SGLang receives exactly one broadcast per tensor named in
  the request, in the request's order and dtype, and nothing else. The recipe accepts it only with
  `rollout.backend = "sglang"` (embedded engines have "broadcast"; vLLM's CPU build has no group:
  "disk"). "auto" stays "disk" for SGLang: a group needs the server to reach the pusher's address
  and port, which attaching to a URL does not promise.
- **Who holds what.** The pusher holds the tensors, so it is rank 0 and hosts the group's store
  (on `weights.host`, a free port). The ExternalEngineActor owns the conversation with its server:
  it has the server join (`JoinWeightGroup`) and posts each bucket's request while the pusher
  broadcasts (`ReceiveDistributed`). A server with tensor parallelism is `tp_size` ranks
  (`WeightGroupRanks`), which set each server's `rank_offset` and the `world_size`. The group's
  store keys are SGLang's (miles_async/transport/groups.py, `sglang=True`): a member keyed otherwise waits
  forever.
- **Atomic from the loop's point of view.** The engines are paused around the update as for every
  transport. The buckets go inside SGLang's weight-update session (`/begin_weight_update` ..
  `/end_weight_update`: SGLang 0.5.23 refuses `/update_weights_from_distributed` outside one), and
  the version label rides on the last bucket, so the label switches when the last tensor is in.
  SGLang loads each bucket in place, so a failure midway leaves the server torn: its actor pauses
  it and keeps it paused (`weights_error`) until a version commits, as after a failed probe.
- **Verified by the probe, as the disk path.** Checksums would need the bytes on the receiving
  side, which only the server holds. So the pusher computes the probe's expected log-probs from
  the very tensors it broadcasts (our model, built from `weights.model_dir`; before pausing), sends
  them with `ReceiveDistributed`, and at `CommitUpdate` the actor compares the server's log-probs
  of the same tokens (miles_async/actors/external.py): a skipped, misplaced or mis-typed tensor shows there.
- **Prefix cache.** The last bucket asks SGLang to flush its cache only when the server was paused
  with "abort": SGLang fails the whole update when a flush finds requests held (paused in place or
  retracted). Under `rollout.partial = "continue"` (in_place) cached prefixes of the old version
  may be reused until they age out, as their requests' KV is kept; our engine salts its cache per
  version anyway.
- **Failure and recovery.** A failed request or broadcast fails the push with the engine's name
  and the server's message, and closes the pusher's group once its broadcast has ended (a gloo
  broadcast ends when a peer leaves; closing the group under a running broadcast would block).
  The next attempt forms a new group under a new name: each actor has its server leave the old
  one (best effort: a restarted server holds none) and join the new. A group that worked before
  (a server restarted since, or a peer lost) is re-formed once within the same push; a new group
  that fails is not retried.
- **Not the tensor path.** `/update_weights_from_tensor` takes `serialized_named_tensors`:
  SGLang's `MultiprocessingSerializer`, torch's `ForkingPickler` over tensors shared by handle
  (CUDA IPC on GPU once `monkey_patch_torch_reductions` has run, file descriptors on CPU),
  unpickled by the server's scheduler (`tp_worker.deserialize_own_rank`): seen in SGLang 0.5.23's
  srt/utils/common.py and srt/managers/tp_worker.py. It needs a trainer colocated with the
  server, on its GPU; our CPU server refuses it on purpose (engine/server.py: unpickling a request
  body runs whatever it holds), so nothing here could test it, and our own colocated handoff is
  the in-process `colocated` transport.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch

from miles_async.actors.engine import EngineState
from miles_async.actors.external import JoinWeightGroup, ReceiveDistributed, WeightGroupRanks
from miles_async.runtime import ActorRef, RemoteError
from miles_async.transport.broadcast import layout_of, layout_to_json
from miles_async.transport.errors import TransportError
from miles_async.transport.groups import WeightGroup

log = logging.getLogger("miles_async.actors.distributed")
OnThread = Callable[..., Awaitable[Any]]
Buckets = Sequence[Sequence[tuple[str, torch.Tensor]]]


def rank_offsets(ranks: Sequence[int]) -> tuple[list[int], int]:
    """Each server's `rank_offset` in a group whose rank 0 is the pusher, and the `world_size`,
    from the number of ranks each server joins with (its tensor-parallel size)."""
    if any(r < 1 for r in ranks):
        raise ValueError(f"every server joins with at least one rank, got {list(ranks)}")
    offsets, next_rank = [], 1
    for count in ranks:
        offsets.append(next_rank)
        next_rank += count
    return offsets, next_rank


def send_tensors(buckets: Buckets, group: WeightGroup, device: str) -> None:
    """SGLang's wire: one broadcast from rank 0 per tensor, bucket after bucket, in order (on device
    memory for NCCL). All are started at once; returns when every one has completed."""
    pieces = [t.detach().contiguous().to(device) for bucket in buckets for _, t in bucket]
    works = [group.start_broadcast(piece, 0) for piece in pieces]
    for work in works:
        work.wait()


class DistributedPush:
    """The pusher's side of the distributed transport (module docstring): rank 0 of one group with
    every server, formed at the first push and kept; `on_thread` runs blocking work on the pusher's
    worker thread."""

    def __init__(self, host: str, backend: str, timeout_s: float, on_thread: OnThread) -> None:
        self.host = host
        self.backend = backend
        self.timeout_s = timeout_s
        self.on_thread = on_thread
        self.group: WeightGroup | None = None
        self.group_name = ""

    async def push(self, refs: Sequence[ActorRef], buckets: Buckets,
                   probe: tuple[list[int], list[float]] | None) -> None:
        """Move one version into every engine (after BeginUpdate; CommitUpdate follows). An engine
        found dead is the pusher's to handle (it forgets it and pushes again to the rest)."""
        for attempt in (1, 2):
            formed = self.group is None
            try:
                if formed:
                    await self._form(refs)
                await self._send(refs, buckets, probe)
                return
            except (RemoteError, TransportError, RuntimeError) as e:  # gloo's errors are RuntimeErrors
                await self.close()
                if formed or attempt == 2:
                    raise
                log.warning("weight-update group %s failed (%s): forming a new one", self.group_name, e)
            except BaseException:
                await self.close()
                raise

    async def _form(self, refs: Sequence[ActorRef]) -> None:
        """A new group under a new name: rank 0 here, each server at its rank offset."""
        ranks = await asyncio.gather(*(ref.ask(WeightGroupRanks(), timeout_s=self.timeout_s) for ref in refs))
        offsets, world_size = rank_offsets(ranks)
        store = await self.on_thread(WeightGroup.open_store, self.host, world_size, self.timeout_s)
        name = f"miles-weights-{uuid.uuid4().hex[:12]}"
        joins = [ref.ask_future(JoinWeightGroup(host=self.host, port=store.port, rank_offset=offset,
                                                world_size=world_size, group_name=name, backend=self.backend),
                                timeout_s=self.timeout_s) for ref, offset in zip(refs, offsets)]
        join = self.on_thread(functools.partial(WeightGroup.join, self.host, store.port, 0, world_size,
                                                backend=self.backend, timeout_s=self.timeout_s, name=name,
                                                store=store, local_host=self.host, sglang=True))
        results = await asyncio.gather(join, *joins, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:  # a member that did not join leaves the others waiting until the timeout: all fail
            if isinstance(results[0], WeightGroup):
                await self.on_thread(results[0].close)
            raise errors[0]
        assert isinstance(results[0], WeightGroup)
        self.group, self.group_name = results[0], name
        log.info("weight-update group %s formed: %d rank(s) over %d server(s), %s", name, world_size, len(refs),
                 self.backend)

    async def _send(self, refs: Sequence[ActorRef], buckets: Buckets,
                    probe: tuple[list[int], list[float]] | None) -> None:
        assert self.group is not None
        ids, expected = probe or ([], [])
        msg = ReceiveDistributed(group_name=self.group_name, layout_json=layout_to_json(layout_of(buckets)),
                                 probe_ids=ids, expected=expected)
        receives: list[asyncio.Future[EngineState]] = [ref.ask_future(msg, timeout_s=self.timeout_s) for ref in refs]
        device = "cuda" if self.backend == "nccl" else "cpu"
        try:
            await self.on_thread(send_tensors, buckets, self.group, device)
        finally:
            results = await asyncio.gather(*receives, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]

    async def close(self) -> None:
        """Drop rank 0's side (its servers leave at the next group's JoinWeightGroup)."""
        if self.group is not None:
            group, self.group = self.group, None
            await self.on_thread(group.close)
