"""Discrete-event simulator (installed as `miles_async.sim`).

This folder will hold the trace format, the virtual clock driver, cost models, reports and plots:
it replays a run's `trace.jsonl` through the real scheduler and buffer policies on a virtual clock
to choose scheduling settings before spending GPU hours (DESIGN.md, "Simulator"). It never
imports an engine, a transport or ZeroMQ. Nothing is written yet.
"""
