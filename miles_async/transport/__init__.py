"""Bulk-tensor data planes for weight updates (installed as `miles_async.transport`).

The transports move converted weights, in buckets, from the trainer into the engines
(docs/design.md, "Weight transports"); `actors.weights.WeightPusher` drives them and
`engine.weights.WeightStore` is the receiving end (versions, double buffer, torn state).
Pure torch + stdlib, never an actor:

- `buckets`: `split_buckets` / `split_sizes` (ordered, at most N bytes, an oversized tensor
  alone) and `convert(family, named)`, the per-family trainer -> engine name/layout table
  (`CONVERTERS`; identity for our engine, `fuse_qkv` as a layout-changing example).
- `verify`: exact per-tensor `checksum`s, `compare`, and `random_fill` for the random-fill check.
- `colocated`: the same-process handoff (engines register by name; matching tensors are taken
  without a copy).
- `broadcast`: `send_buckets` / `recv_buckets`, buckets from one rank to the others over
  torch.distributed, after a layout fingerprint check; `groups.WeightGroup` is the standalone
  process group (pusher + engines) they run on, gloo on CPU and NCCL on GPU.
- `shm`: `SharedWeights`, all tensors in one shared-memory segment with a seqlock version
  (odd while a write is in progress), attachable by name from another process.
- `disk_delta`: `write_delta` / `apply_delta`, changed elements only, compressed, checksummed,
  version-ordered, written atomically.
- `rdma_plan`: `plan_writes`, the pure schedule of one-sided writes; `rdma`: the pyverbs wire
  (`RdmaEngineSide` / `RdmaPusherSide`, `[rdma]` extra, runs only where an RDMA device is).

Try it: `pytest tests/unit/test_transport_*.py tests/dist/test_weight_updates.py -s`.
"""
