"""The deployment's key on the side channel (``auth_key_file`` in
``kv_connector_extra_config``, or the secret itself in ``KVPOLL_AUTH_KEY``).

With a key every side-channel request starts with a line::

    KEY <nonce, 32 hex> <unix time, ms> <tag, 64 hex>

the tag being HMAC-SHA-256, under a key derived from the secret, of the
nonce, the time, a newline (the time's digits end there) and every
request byte after the line. The server refuses
(answers ``NO <why>`` and counts) a request without that line, with a tag
that does not check out (another key, altered bytes), with a time more
than ``WINDOW_S`` from its own clock, or with a nonce it accepted before
(it remembers nonces for twice the window). Its answer starts with ``KEY
<tag>``, the tag of the request's nonce and the answer's bytes, which the
asking side checks: a forged or replayed answer is refused there. Nothing
is encrypted: the key tells the deployment's workers from others, it does
not hide the metadata from whoever watches the network.

The same secret keys the kvpoll engine (``Engine(auth_key=...)``): its
metadata and notifications are tagged too.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
import time
from typing import Dict, Optional, Tuple

#: The environment variable the secret is read from when no key file is named.
ENV = "KVPOLL_AUTH_KEY"
#: Fewest bytes a secret may have (as the engine's).
MIN_SECRET = 16
#: How far a request's clock may be from the server's, seconds.
WINDOW_S = 60.0
#: Nonces a server remembers at most; past that it refuses until some expire.
MAX_NONCES = 65536


def load_secret(path: Optional[str]) -> Optional[bytes]:
    """The secret in the file ``path`` (white space around it left out), or
    else in ``KVPOLL_AUTH_KEY``; ``None`` if neither is given. A secret
    under ``MIN_SECRET`` bytes is a ``ValueError``."""
    if path is not None:
        with open(path, "rb") as f:
            secret = f.read().strip()
        where = f"auth_key_file {path}"
    elif os.environ.get(ENV) is not None:
        secret = os.environb[ENV.encode()].strip()
        where = ENV
    else:
        return None
    if len(secret) < MIN_SECRET:
        raise ValueError(f"{where}: a secret of {len(secret)} bytes; at least {MIN_SECRET} are needed")
    return secret


class SideChannelKey:
    """Tags and checks side-channel requests and answers (see the module)."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_SECRET:
            raise ValueError(f"a secret of {len(secret)} bytes; at least {MIN_SECRET} are needed")
        self._key = hmac.new(secret, b"kvpoll 1 side channel", hashlib.sha256).digest()
        self._lock = threading.Lock()
        self._seen: Dict[bytes, float] = {}
        #: Requests refused as unauthenticated, since the last ``take_refused``.
        self._refused = 0

    def __repr__(self) -> str:
        return "SideChannelKey(..)"

    def _tag(self, *parts: bytes) -> bytes:
        return hmac.new(self._key, b"".join(parts), hashlib.sha256).digest()

    # -- the asking side -----------------------------------------------------

    def seal_request(self, request: bytes) -> Tuple[bytes, bytes]:
        """``request`` with its key line first, and the nonce to check the
        answer with."""
        nonce = os.urandom(16)
        ms = str(int(time.time() * 1000)).encode()
        tag = self._tag(b"request", nonce, ms, b"\n", request)
        return b"KEY %s %s %s\n" % (nonce.hex().encode(), ms, tag.hex().encode()) + request, nonce

    def open_answer(self, nonce: bytes, answer: bytes) -> Optional[bytes]:
        """The answer without its key line, if its tag checks out."""
        line, sep, rest = answer.partition(b"\n")
        parts = line.split(b" ")
        if not sep or len(parts) != 2 or parts[0] != b"KEY":
            return None
        try:
            tag = bytes.fromhex(parts[1].decode())
        except ValueError:
            return None
        if not hmac.compare_digest(tag, self._tag(b"answer", nonce, rest)):
            return None
        return rest

    # -- the serving side ----------------------------------------------------

    def check_request(self, line: bytes, request: bytes) -> Tuple[Optional[bytes], str]:
        """The request's nonce if its key ``line`` authenticates ``request``
        (the bytes after the line), else ``None`` and why (counted)."""
        nonce, why = self._check(line, request)
        if nonce is None:
            with self._lock:
                self._refused += 1
        return nonce, why

    def _check(self, line: bytes, request: bytes) -> Tuple[Optional[bytes], str]:
        parts = line.split(b" ")
        if len(parts) != 4 or parts[0] != b"KEY":
            return None, "the side channel needs the deployment's key (auth_key_file or KVPOLL_AUTH_KEY): the request has none"
        try:
            nonce, ms, tag = bytes.fromhex(parts[1].decode()), int(parts[2]), bytes.fromhex(parts[3].decode())
        except ValueError:
            return None, "a malformed KEY line"
        if len(nonce) != 16 or not hmac.compare_digest(tag, self._tag(b"request", nonce, parts[2], b"\n", request)):
            return None, "the request's tag does not check out: another key, or altered bytes"
        now = time.time()
        if abs(now - ms / 1000) > WINDOW_S:
            return None, f"the request's time is more than {WINDOW_S:g} s from this host's clock"
        with self._lock:
            if len(self._seen) >= MAX_NONCES // 2:
                self._seen = {n: t for n, t in self._seen.items() if t > now}
            if nonce in self._seen:
                return None, "a request seen before (replayed)"
            if len(self._seen) >= MAX_NONCES:
                return None, "too many requests in the window: try again"
            self._seen[nonce] = now + 2 * WINDOW_S
        return nonce, ""

    def seal_answer(self, nonce: bytes, answer: bytes) -> bytes:
        """``answer`` with its key line first, for the request of ``nonce``."""
        return b"KEY %s\n" % self._tag(b"answer", nonce, answer).hex().encode() + answer

    def take_refused(self) -> int:
        """Requests refused as unauthenticated since the last call."""
        with self._lock:
            n, self._refused = self._refused, 0
        return n
