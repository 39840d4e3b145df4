"""Benchmarks (installed as `miles_async.bench`, run through `miles-async bench TARGET`).

This folder holds the benchmarks, one module per target of `miles-async bench` (runtime, engine,
weights, loop), each with a `main(argv: list[str]) -> int` that the command line calls. Each one
measures a peer or a physical limit in the same run (Ray, HF generate, memcpy, sync vs async) and
prints JSON, so that every figure is a ratio (STYLE.md, rule 15). Written: `runtime`, `engine`,
`weights`.
"""
