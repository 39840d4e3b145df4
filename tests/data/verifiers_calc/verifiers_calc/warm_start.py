"""miles-async's side of this environment: `CalcTask`, the Verifiers task plug-in with this
environment's demonstrations (the ideal conversations) for an SFT warm start before RL.

    [task]
    plugin = "verifiers_calc.warm_start:CalcTask"   # instead of miles_async.agents.verifiers:VerifiersTask

A Verifiers taskset has no ideal conversations of its own; an environment that can write them
subclasses `VerifiersTask` with them, as here: ask, call `multiply`, read the product, reply with it.
Rendered with the harness's own tool list, so the warm start sees the prompt an episode sees.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from miles_async.agents.api import sft_example
from miles_async.agents.verifiers import VerifiersItem, VerifiersTask
from verifiers_calc import TOOLS


def demonstration(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The ideal conversation for a task's data: multiply, then reply with the product alone."""
    a, b = int(data["a"]), int(data["b"])
    call = {"id": "call_0", "type": "function", "function": {"name": "multiply", "arguments": json.dumps({"a": a, "b": b})}}
    return [{"role": "user", "content": data["prompt"]},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": str(a * b)},
            {"role": "assistant", "content": str(a * b)}]


class CalcTask(VerifiersTask):
    """`VerifiersTask` with this environment's demonstrations."""

    def sft_examples(self, items: Sequence[VerifiersItem]) -> list[tuple[list[int], list[int]]]:
        return [sft_example(self.tokenizer, demonstration(item.data), TOOLS) for item in items]
