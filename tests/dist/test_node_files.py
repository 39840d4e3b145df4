"""A node without the model folder gets it from node 0: the agent's `MissingFiles` / `PutFile`
over real ZeroMQ mailboxes (the agent in a process of its own, as on another node)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _support import config, scenario

from miles_async.launch.agent import CHUNK_BYTES, FileStat, NodeAgent, PutFile, RemoteSpawner, list_folder
from miles_async.runtime import ActorSystem, RemoteError

TIMEOUT_S = 60.0


def make_folder(root: Path) -> Path:
    root.mkdir()
    (root / "config.json").write_text('{"model_type": "qwen3"}')
    (root / "model.safetensors").write_bytes(os.urandom(2 * CHUNK_BYTES + 12345))  # three pieces
    (root / "sub").mkdir()
    (root / "sub" / "empty.txt").write_bytes(b"")
    (root / ".hidden").write_text("left out")
    return root


def contents(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()
            and not p.name.startswith(".")}


def test_a_node_lacking_the_folder_receives_it_whole_and_only_what_it_lacks_after(tmp_path: Path) -> None:
    src, dest = make_folder(tmp_path / "model"), tmp_path / "elsewhere" / "model"

    async def main() -> None:
        async with ActorSystem(config=config("ipc")) as system:
            agent = await system.spawn(NodeAgent, "node-1-test", kwargs={"node_rank": 1, "host": "127.0.0.1"},
                                       process=True)
            spawner = RemoteSpawner(system, agent, timeout_s=TIMEOUT_S)
            assert await spawner.ensure_folder(src) == 0  # the same path on a shared filesystem: nothing to send
            size = sum(f.size for f in list_folder(src))
            assert await spawner.ensure_folder(src, dest) == size
            assert contents(dest) == contents(src) and not (dest / ".hidden").exists()
            assert list_folder(dest) == list_folder(src)  # times too: the next check reads nothing
            assert await spawner.ensure_folder(src, dest) == 0
            (dest / "config.json").write_text('{"model_type": "llama"}')  # same size, other bytes (and time)
            assert await spawner.ensure_folder(src, dest) == (src / "config.json").stat().st_size
            assert contents(dest) == contents(src)
            assert await spawner.shares(src / "config.json")  # one machine: the same file (a node that does not
            # see it is tests/e2e/test_launch.py's, in a mount namespace of its own)
            bad = FileStat(name="x.bin", size=3, mtime_ns=0, sha256="0" * 64)
            with pytest.raises(RemoteError, match="does not match its size or SHA-256"):
                await agent.ask(PutFile(folder=str(dest), file=bad, offset=0, data=b"abc"))
            assert not (dest / "x.bin").exists() and not (dest / ".part-x.bin").exists()
            with pytest.raises(RemoteError, match="refusing file '../x.bin'"):
                await agent.ask(PutFile(folder=str(dest), file=FileStat(name="../x.bin", size=1, mtime_ns=0),
                                        offset=0, data=b"a"))
            assert await agent.ask(PutFile(folder=str(dest), file=FileStat(name="y", size=1, mtime_ns=0), offset=0,
                                           data=b"")) is None  # a piece short of the size: still partial
            assert not (dest / "y").exists()

    scenario(main, TIMEOUT_S)
