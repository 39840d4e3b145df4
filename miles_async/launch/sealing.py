"""Sealing the rendezvous's secrets: `seal` and `unseal`, an AEAD under a key of the run's secret.

Node 0 hands every node the run's CURVE keys and the node list through a TCPStore that anyone who
reaches it can read and write (`miles_async/launch/rendezvous.py`); these two functions are what makes that
safe.

ChaCha20-Poly1305, the AEAD of RFC 8439, from the `cryptography` package (backed by
OpenSSL), under a key derived from the secret with HKDF-SHA256 (RFC 5869):

* `key = HKDF(secret, salt=b"miles-async/rendezvous/seal/v1", info=JSON ["seal key", run_id])`,
  one key per run;
* per message, a fresh random 12-byte nonce (`secrets.token_bytes`);
* the associated data names what the message is for: `b"miles-async/rendezvous/seal/v1|" +
  JSON [run_id, rank, purpose]`, with rank the node it is for and purpose `"keys"` (the initial
  rendezvous) or `"join/S"` (the answer to join request S);
* the sealed blob is msgpack `{format, key_id, run_id, rank, purpose, nonce, box}`: `box` is
  the ciphertext and its 16-byte tag; the other fields are in clear, and serve only to name
  the cause of a refusal ("sealed under another secret", "sealed for node 1, not node 2");
  `key_id` is 8 bytes of HKDF of the secret under another info, a name for it. `unseal` opens
  the box with the context it expects, never with the one the blob states, so an attacker who
  edits those fields gets a tag that fails, not a message accepted for another node.

Why this is sound, against an attacker who can read and write the TCPStore but does not know
the secret: ChaCha20-Poly1305 keeps the plaintext secret and makes any change to the nonce, the
ciphertext, the tag or the associated data fail the tag check (IND-CCA and INT-CTXT), provided
that the key is unknown to the attacker and a nonce is never reused under one key. HKDF of a
high-entropy secret is a pseudorandom key (HKDF is not a password hash: the secret must be
random, as `rendezvous.MAKE_SECRET` makes it); 96-bit random nonces under a key that seals a handful of
messages (one per node, one per join) repeat with probability about n^2 / 2^97. The associated
data makes each blob hold only where node 0 put it: a blob copied from `keys/1` to `keys/2`,
from one join request to another, from a join to the initial rendezvous or from another run
fails to open. What it cannot stop is the deletion or overwriting of a blob (denial of service:
the rendezvous's "Security argument"). The rendezvous's proofs and abort tags are HMAC-SHA256
(standard library `hmac`), a MAC used as a MAC, checked with `hmac.compare_digest`.

Why not derive the keypair on every node from the secret and run id (HKDF), so that no keys
travel: the nodes still need the node list (the addresses they go on to connect to) from node
0, authenticated, so an authenticated message is needed anyway; and shipping keeps one source
of CURVE keys for the runtime, a fresh keypair from libzmq's generator
(`security.generate_run_keys`), rather than a second, seed-derived path. Why ChaCha20-Poly1305
rather than AES-GCM: equally standard, constant-time in software on any CPU.

Try it:
    blob = seal(b"a long random secret", b"keys", run_id="r1", rank=1, purpose="keys")
    unseal(b"a long random secret", blob, run_id="r1", rank=1, purpose="keys")  # b"keys"
    unseal(b"a long random secret", blob, run_id="r1", rank=2, purpose="keys")  # SealError("context")
"""

from __future__ import annotations

import hmac
import secrets as _secrets

import msgspec
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

__all__ = ["SealError", "seal", "unseal"]

# The sealed messages (see "Encryption"): their format, and the sizes of their nonce and key id.
SEAL_FORMAT = 1
SEAL_LABEL = b"miles-async/rendezvous/seal/v1"
NONCE_BYTES = 12  # ChaCha20-Poly1305's
KEY_ID_BYTES = 8


class SealError(ValueError):
    """A sealed message that does not open; the message says why, and `cause` names it:
    "malformed" (not a sealed message of this format), "secret" (sealed under another secret),
    "context" (sealed for another run, node or purpose) or "altered" (its tag does not verify)."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


class _Sealed(msgspec.Struct, frozen=True, kw_only=True):
    """A sealed message as it sits in the store. Only `nonce` and `box` are cryptographic; the
    rest is in clear to name the cause of a refusal, and trusted for nothing else."""

    format: int
    key_id: bytes  # a name for the secret that sealed it (see _key_id)
    run_id: str
    rank: int  # the node it is for
    purpose: str  # "keys", or "join/S"
    nonce: bytes
    box: bytes  # the ciphertext, then its 16-byte Poly1305 tag


_SEALED = msgspec.msgpack.Decoder(_Sealed)


def _hkdf(secret: bytes, info: list[str], length: int) -> bytes:
    kdf = HKDF(algorithm=hashes.SHA256(), length=length, salt=SEAL_LABEL, info=msgspec.json.encode(info))
    return kdf.derive(secret)


def _seal_key(secret: bytes, run_id: str) -> bytes:
    return _hkdf(secret, ["seal key", run_id], 32)


def _key_id(secret: bytes) -> bytes:
    # Public: it only lets a node tell "another secret" from "altered". It exposes no more than
    # the proofs in the store already do (a value an offline guess of the secret can be checked on).
    return _hkdf(secret, ["key id"], KEY_ID_BYTES)


def _associated_data(run_id: str, rank: int, purpose: str) -> bytes:
    return SEAL_LABEL + b"|" + msgspec.json.encode([run_id, rank, purpose])


def seal(secret: bytes, plaintext: bytes, *, run_id: str, rank: int, purpose: str) -> bytes:
    """Encrypt and authenticate `plaintext` for node `rank` of run `run_id`, for `purpose`.

    Only `unseal` with the same secret, run id, rank and purpose opens it (see "Encryption").
    """
    nonce = _secrets.token_bytes(NONCE_BYTES)
    box = ChaCha20Poly1305(_seal_key(secret, run_id)).encrypt(
        nonce, plaintext, _associated_data(run_id, rank, purpose))
    return msgspec.msgpack.encode(_Sealed(format=SEAL_FORMAT, key_id=_key_id(secret), run_id=run_id,
                                          rank=rank, purpose=purpose, nonce=nonce, box=box))


def unseal(secret: bytes, blob: bytes, *, run_id: str, rank: int, purpose: str) -> bytes:
    """The plaintext of a blob `seal`ed with `secret` for (`run_id`, `rank`, `purpose`).

    SealError otherwise, naming the cause: not a sealed message, sealed under another secret,
    sealed for another run, node or purpose, or altered. The fields a blob states in clear only
    choose the message: the box is opened with the context given here, so a blob whose clear
    fields were edited to pass the checks fails as "altered".
    """
    try:
        sealed = _SEALED.decode(blob)
    except msgspec.DecodeError as e:  # ValidationError included
        raise SealError("malformed", f"it is not a sealed message ({e}): cut short or altered in the "
                                     f"store, or not written by seal()") from e
    if sealed.format != SEAL_FORMAT:
        raise SealError("malformed", f"it is a sealed message of format {sealed.format}, and this node "
                                     f"reads format {SEAL_FORMAT} (does the sender run another version?)")
    key_id = _key_id(secret)
    if not hmac.compare_digest(sealed.key_id, key_id):
        raise SealError("secret", f"it was sealed under another secret (key id {sealed.key_id.hex()}; "
                                  f"this node's is {key_id.hex()})")
    moved = [f"{what} {theirs!r}, not {ours!r}" for what, theirs, ours in (
        ("run", sealed.run_id, run_id), ("node", sealed.rank, rank), ("purpose", sealed.purpose, purpose))
        if theirs != ours]
    if moved:
        raise SealError("context", f"it was sealed for {', '.join(moved)}: a sealed message opens only "
                                   f"for the run, node and purpose it was sealed for")
    if len(sealed.nonce) != NONCE_BYTES:
        raise SealError("malformed", f"its nonce is {len(sealed.nonce)} bytes, not {NONCE_BYTES}")
    try:
        return ChaCha20Poly1305(_seal_key(secret, run_id)).decrypt(
            sealed.nonce, sealed.box, _associated_data(run_id, rank, purpose))
    except InvalidTag as e:
        raise SealError("altered", "its authentication tag does not verify: it was altered in the store "
                                   "(or forged by someone without the secret)") from e
