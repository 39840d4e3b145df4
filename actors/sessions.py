"""`SessionHost`: the TITO session server (`miles_async.agents.session`) as an actor, so a run can
place it on any node.

    controller ──AddSessionEngine / RemoveSessionEngine / CloseSessions──► SessionHost ─ SessionServer (HTTP)
    rollout workers (agents) ──────── chat.completions over HTTP ─────────────────────┘

On the controller's node it lives in the controller's process and serves on loopback; on another
node it is a process of its own serving on that node's address, and then every request must carry
the run's API key (`Authorization: Bearer ...`), as the engines' do.
"""

from __future__ import annotations

from typing import Any, ClassVar

from miles_async.agents.session import SessionServer
from miles_async.runtime import Actor, Message, handler


class SessionsUrl(Message):
    Reply: ClassVar[Any] = str


class AddSessionEngine(Message):
    url: str
    Reply: ClassVar[Any] = None


class RemoveSessionEngine(Message):
    url: str
    Reply: ClassVar[Any] = None


class CloseSessions(Message):
    """Close these sessions where they are open (the others are already closed)."""

    session_ids: list[str]
    Reply: ClassVar[Any] = None


class SessionHost(Actor):
    """Runs a `SessionServer` from `on_start` to `on_stop` (module docstring)."""

    def __init__(self, engine_urls: list[str], model_dir: str, host: str = "127.0.0.1",
                 api_key: str | None = None, engine_api_key: str | None = None) -> None:
        self.server = SessionServer(engine_urls, model_dir, host=host, api_key=api_key,
                                    engine_api_key=engine_api_key)

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
