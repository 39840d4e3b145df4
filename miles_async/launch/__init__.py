"""Command line and per-node launcher (installed as `miles_async.launch`).

`cli.py` is the `miles-async` console script (docs/design.md, "Launch and the command line"). This
folder will also hold the per-node launcher, placement and recipes. Nothing imports `launch`.
"""
