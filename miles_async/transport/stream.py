"""`stream`: a weight version over ZeroMQ, authenticated and encrypted with the run's CURVE key.

    pusher                                            engine (each, concurrently)
    StreamServer(host, keys, buckets)  ◄── "ready" ── receive(address, keys, layout, target)
      serve(num_engines)               ── frames ──►  one frame per tensor, written into `target`

The transport for engines on other machines when the network between them is not trusted: the
pusher's socket is a CURVE server holding the run's key, so only the run's processes can fetch
a version, and the bytes are encrypted on the wire (`broadcast`'s gloo sockets have no
authentication at all). Point to point, so the pusher's link carries one copy per engine.
Without keys (a one-node run on loopback) it is plain tcp on 127.0.0.1.

Try it: tests/dist/test_weight_updates.py pushes with it between processes.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import zmq

from miles_async.runtime import security
from miles_async.transport.broadcast import Layout
from miles_async.transport.errors import TransportError

__all__ = ["StreamServer", "receive"]

READY = b"ready"


class StreamServer:
    """Serves one version's tensors (bucket by bucket, tensor by tensor) to each engine that asks."""

    def __init__(self, host: str, keys: Any, buckets: list[list[tuple[str, torch.Tensor]]]) -> None:
        # the arrays' memoryviews (`.data`): numpy's stubs declare ndarray a Buffer only on Python 3.12+
        self._frames = [t.detach().contiguous().cpu().view(torch.uint8).numpy().data for bucket in buckets
                        for _, t in bucket]
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            security.make_server(self._sock, keys)
        self._sock.bind(f"tcp://{host}:*")
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stopped = False

    def serve(self, num_clients: int, timeout_s: float) -> None:
        """Answer `num_clients` requests; TransportError when they do not all come within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        served = 0
        while served < num_clients and not self._stopped:
            left_ms = int(max(deadline - time.monotonic(), 0.0) * 1000)
            if not left_ms:
                raise TransportError(f"stream: {served} of {num_clients} engines fetched the weights within "
                                     f"{timeout_s:g}s from {self.address}")
            if not self._sock.poll(min(left_ms, 100)):
                continue
            ident, request = self._sock.recv_multipart()
            if request != READY:
                continue  # not a fetch: ignore it (only the run's key holders can even get here)
            self._sock.send_multipart([ident, *self._frames], copy=False)
            served += 1

    def stop(self) -> None:
        """Make `serve` return within 0.1 s (from another thread); `close` after it has."""
        self._stopped = True

    def close(self) -> None:
        self._sock.close(linger=0)


def receive(address: str, keys: Any, layout: Layout, target: dict[str, torch.Tensor],
            timeout_s: float) -> list[str]:
    """Fetch one version from `address` into `target` (names as in `layout`); the names written."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if keys is not None:
            security.make_client(sock, keys)  # pins the run's own key as the server's
        sock.connect(address)
        sock.send(READY)
        if not sock.poll(int(timeout_s * 1000)):
            raise TransportError(f"stream: no weights from {address} within {timeout_s:g}s")
        frames = sock.recv_multipart(copy=False)
    finally:
        sock.close(linger=0)
    specs = [spec for bucket in layout for spec in bucket]
    if len(frames) != len(specs):
        raise TransportError(f"stream: {len(frames)} tensors from {address}, the layout has {len(specs)}")
    names = []
    for spec, frame in zip(specs, frames):
        dest = target[spec.name]
        data = torch.frombuffer(bytearray(frame.buffer), dtype=torch.uint8)
        if data.numel() != dest.numel() * dest.element_size():
            raise TransportError(f"stream: {spec.name} has {data.numel()} bytes, the engine's tensor "
                                 f"{dest.numel() * dest.element_size()}")
        dest.copy_(data.view(dest.dtype).view(dest.shape))
        names.append(spec.name)
    return names
