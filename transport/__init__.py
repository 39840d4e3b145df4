"""Bulk-tensor data planes for weight updates (installed as `miles_async.transport`).

The transports move converted weights, in buckets, from the trainer into the engines
(DESIGN.md, "Weight transports"). Written so far, pure torch + stdlib:

- `buckets`: `split_buckets` / `split_sizes` (ordered, at most N bytes, an oversized tensor
  alone) and `convert(family, named)`, the per-family trainer -> engine name/layout table
  (`CONVERTERS`; identity for our engine, `fuse_qkv` as a layout-changing example).
- `verify`: exact per-tensor `checksum`s, `compare`, and `random_fill` for the random-fill check.
- `disk_delta`: `write_delta` / `apply_delta`, changed elements only, compressed, checksummed,
  version-ordered, written atomically.
- `rdma_plan`: `plan_writes`, the pure schedule of one-sided writes; `rdma`: `require_pyverbs`.
- `shm`: `SharedWeights`, all tensors in one shared-memory segment with a seqlock version
  (odd while a write is in progress), attachable by name from another process.
- `broadcast`: `send_buckets` / `recv_buckets`, buckets from one rank to the others over
  torch.distributed (gloo on CPU), after a layout fingerprint check.

Still to come: the colocated handoff, the RDMA wire, the engine keeping its weights in a
`SharedWeights` segment, and the `WeightPusher` actor that drives them (it lives in `actors/`: a
transport never imports one).
Try it: `pytest tests/unit/test_transport_*.py -s`.
"""
