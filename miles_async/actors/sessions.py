"""`SessionHost`: the TITO session server (`miles_async.agents.session`) as an actor, so a run can
place it on any node.

    controller ──AddSessionEngine / RemoveSessionEngine / CloseSessions──► SessionHost ─ SessionServer (HTTP)
    rollout workers (agents) ──────── chat.completions over HTTP ─────────────────────┘
    rollout workers ──TakeSession (episode over)──► SessionHost ──► Trajectory (arrays in its data plane)

On the controller's node it lives in the controller's process and serves on loopback; on another
node it is a process of its own serving on that node's address, and then every request must carry
the run's API key (`Authorization: Bearer ...`), as the engines' do.
"""

from __future__ import annotations

import msgspec

from miles_async.agents.session import SessionServer
from miles_async.engine.backend import Backend
from miles_async.runtime import Actor, Message, handler
from miles_async.trajectory import TokenData, Trajectory, encode_data


class SessionsUrl(Message[str], frozen=True):
    """The session server's base URL."""


class AddSessionEngine(Message[None], frozen=True):
    url: str


class RemoveSessionEngine(Message[None], frozen=True):
    url: str


class CloseSessions(Message[None], frozen=True):
    """Close these sessions where they are open (the others are already closed)."""

    session_ids: list[str]


class TakeSession(Message[Trajectory | None], frozen=True):
    """Close a session and return its latest branch (the trajectory the agent finished on), its
    token arrays put into this process's data plane; None when the session never ran a turn."""

    session_id: str


class SessionHost(Actor):
    """Runs a `SessionServer` from `on_start` to `on_stop` (module docstring)."""

    def __init__(self, engine_urls: list[str], model_dir: str, host: str = "127.0.0.1",
                 api_key: str | None = None, engine_api_key: str | None = None, backend: Backend = "embedded",
                 adapter: str = "") -> None:
        self.server = SessionServer(engine_urls, model_dir, host=host, api_key=api_key,
                                    engine_api_key=engine_api_key, backend=backend, adapter=adapter)

    async def on_start(self) -> None:
        await self.server.start()

    async def on_stop(self) -> None:
        await self.server.stop()

    @handler
    def url(self, msg: SessionsUrl) -> str:
        return self.server.url

    @handler
    def add_engine(self, msg: AddSessionEngine) -> None:
        self.server.add_engine(msg.url)

    @handler
    async def remove_engine(self, msg: RemoveSessionEngine) -> None:
        await self.server.remove_engine(msg.url)

    @handler
    def close_sessions(self, msg: CloseSessions) -> None:
        for session_id in msg.session_ids:
            if session_id in self.server.sessions:
                self.server.close_session(session_id)

    @handler
    def take_session(self, msg: TakeSession) -> Trajectory | None:
        if msg.session_id not in self.server.sessions:
            return None
        branches = self.server.close_session(msg.session_id)
        if not branches:
            return None
        latest = branches[-1]
        assert isinstance(latest.data, TokenData)
        return msgspec.structs.replace(latest, data=self.system.dataplane.put(encode_data(latest.data)))

