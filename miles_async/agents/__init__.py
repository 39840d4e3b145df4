"""Multi-turn agents (docs/design.md, "Models and numerics": TITO).

- `api`: the three plug-in layers, each a Protocol: `Agent` (`async def agent(ctx)`), `Environment`
  (tools and verifier) and `RolloutFn` (drives a group's episodes); `run_episode`, `rollout_group`.
- `session`: the TITO session server (`SessionServer`, `miles-async serve session`): OpenAI's chat
  completions per session URL, the server owning tokenization, checkpoints and branches, training
  samples with exact masks and rollout log-probs, engine affinity per session.
- `toolcalls`: `parse_tool_calls`, the chat template's `<tool_call>` blocks as OpenAI tool calls.

Try it: `pytest tests/unit/test_agents_api.py tests/e2e/test_session_server.py -s`.
"""

from miles_async.agents.api import (
           AgentContext,
           Environment,
           Episode,
           RolloutFn,
           ToolError,
           rollout_group,
           run_episode,
)
from miles_async.agents.session import SessionServer
from miles_async.agents.toolcalls import ToolCall, parse_tool_calls

__all__ = ["AgentContext", "Environment", "Episode", "RolloutFn", "SessionServer", "ToolCall",
           "ToolError", "parse_tool_calls", "rollout_group", "run_episode"]
