"""Bulk-tensor data planes for weight updates (installed as `miles_async.transport`).

This folder will hold the transports that move converted weights, in buckets, from the trainer
into the engines: colocated handoff, torch.distributed broadcast, same-node shared memory, RDMA
(pyverbs, the `[rdma]` extra) and disk-delta, with a verification pass (DESIGN.md, "Weight
transports"). None of them is written yet.
"""
