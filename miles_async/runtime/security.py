"""ZeroMQ CURVE for runs that cross hosts: one keypair per run, only its holders may talk.

Every process of a run loads the same keypair from the run's key folder (created owner-only:
the folder 0700, the secret file 0600). Each ROUTER is a CURVE server with that key and a ZAP
authenticator that admits exactly one client key, the run's; each DEALER is a CURVE client
with the same keypair. A peer without the run's secret key cannot finish the handshake, so
it cannot deliver a single message.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

KEY_NAME = "run"


@dataclass(frozen=True, slots=True)
class CurveKeys:
    public: bytes
    secret: bytes


def generate_run_keys(key_dir: str | Path) -> Path:
    """Create a fresh keypair for a run in `key_dir` (owner-only) and return the folder."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE; install pyzmq's wheel (it bundles libsodium)")
    key_dir = Path(key_dir)
    key_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(key_dir, 0o700)
    for old in key_dir.glob(f"{KEY_NAME}.key*"):
        old.unlink()
    old_umask = os.umask(0o077)
    try:
        public_file, secret_file = zmq.auth.create_certificates(str(key_dir), KEY_NAME)
    finally:
        os.umask(old_umask)
    os.chmod(secret_file, 0o600)
    os.chmod(public_file, 0o600)
    return key_dir


def load_run_keys(key_dir: str | Path) -> CurveKeys:
    secret_file = Path(key_dir) / f"{KEY_NAME}.key_secret"
    if not secret_file.exists():
        raise FileNotFoundError(f"no CURVE keys for this run in {key_dir} (expected {secret_file.name})")
    public, secret = zmq.auth.load_certificate(str(secret_file))
    if secret is None:
        raise ValueError(f"{secret_file} holds no secret key")
    return CurveKeys(public=public, secret=secret)


def start_authenticator(ctx: zmq.Context, key_dir: str | Path) -> ThreadAuthenticator:
    """A ZAP handler on `ctx` that admits only clients holding the run's key."""
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(key_dir))  # loads the public `*.key` files
    return auth


def make_server(sock: zmq.Socket, keys: CurveKeys) -> None:
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def make_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.public
