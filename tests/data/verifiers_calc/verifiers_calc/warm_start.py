"""This environment's ideal conversations, for a trainer's SFT warm start before RL (a Verifiers
taskset has none of its own): ask, call `multiply`, read the product, reply with it.

    [task.config]   # miles-async's recipes/verifiers-calculator.toml
    environment = "verifiers-calc"
    demonstrations = "verifiers_calc.warm_start:demonstration"

`demonstration(data)` takes a task's data (`CalcData` as JSON) and returns the conversation with the
tool list the harness offers, so a warm start renders the prompt an episode sees.
"""

from __future__ import annotations

import json
from typing import Any

from verifiers_calc import TOOLS


def demonstration(data: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(messages, tools): multiply, then reply with the product alone."""
    a, b = int(data["a"]), int(data["b"])
    call = {"id": "call_0", "type": "function", "function": {"name": "multiply", "arguments": json.dumps({"a": a, "b": b})}}
    return ([{"role": "user", "content": data["prompt"]},
             {"role": "assistant", "content": "", "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_0", "content": str(a * b)},
             {"role": "assistant", "content": str(a * b)}], TOOLS)
