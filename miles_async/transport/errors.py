"""The transports' one runtime fault: a weight update that cannot be applied as sent.

Input mistakes (a bad bucket size, an unknown family) raise ValueError at the boundary; a
TransportError means the bytes on the wire or on disk do not make a valid update (a checksum
mismatch, a partial folder, a version that does not follow the engine's).
"""

from __future__ import annotations


class TransportError(RuntimeError):
    """A weight update that must not be applied: corrupt, incomplete or out of order."""
