"""The calculator environment served by OpenEnv's own server (`create_app`, as an OpenEnv
environment's `server/app.py`): `uvicorn openenv_calc.app:app --port 8000`, then a recipe's
`[agent] environment = "http://127.0.0.1:8000"`. Each WebSocket session gets an environment of
its own, up to `max_concurrent_envs` at once (OPENENV_CALC_MAX_ENVS, default 128: a run's episodes
in flight and its evaluation's together)."""

from __future__ import annotations

import os

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation

from openenv_calc import CalcEnvironment

app = create_app(CalcEnvironment, CallToolAction, CallToolObservation, env_name="openenv_calc",
                 max_concurrent_envs=int(os.environ.get("OPENENV_CALC_MAX_ENVS", "128")))
