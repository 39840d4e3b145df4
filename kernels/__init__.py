"""Numerics (installed as `miles_async.kernels`).

This folder will hold chunked log-probs and entropy, batch-invariant ops, quantizers (FP8
blockwise, MXFP8, NVFP4, INT4) and routing capture/replay. It is a leaf: it imports torch (and
Triton lazily) and nothing of ours (DESIGN.md, "Who may import whom"). Nothing is written yet.
"""
