"""The data path's handshake: a connection proves it holds the server's secret.

On an authenticated connection the listener sends a fresh nonce of ``NONCE_BYTES``; the
connector answers ``HMAC-SHA256(secret, DOMAIN + nonce)`` (``Handshake.MAC_BYTES``) and
only then sends messages; the listener reads none of them until the answer is right, and
closes a connection that answers wrong or not within ``AUTH_TIMEOUT_S``. The secret is
random per server (``ppipe serve`` makes it) and reaches the workers and shards with their
start-up calls. A fresh nonce per connection makes a recorded answer useless on another.
"""

from __future__ import annotations

import hashlib
import hmac
import os

AUTH_TIMEOUT_S = 5.0  # a connection that has not proved the secret by then is closed
NONCE_BYTES = 16
DOMAIN = b"ppipe-datapath-v1\0"  # what the answer's HMAC covers besides the nonce


class Handshake:
    """The challenge-response of an authenticated connection (see the module's docstring)."""

    MAC_BYTES = hashlib.sha256().digest_size

    def __init__(self, secret: bytes):
        if len(secret) < 16:
            raise ValueError(f"a data-path secret needs at least 16 bytes, got {len(secret)}")
        self.secret = secret

    @staticmethod
    def nonce() -> bytes:
        return os.urandom(NONCE_BYTES)

    def answer(self, nonce: bytes) -> bytes:
        return hmac.new(self.secret, DOMAIN + nonce, hashlib.sha256).digest()

    def verify(self, nonce: bytes, answer: bytes) -> bool:
        return hmac.compare_digest(self.answer(nonce), answer)
