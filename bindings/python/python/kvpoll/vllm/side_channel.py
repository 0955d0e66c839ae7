"""The side channel: how a decode worker learns a prefill worker's engine
metadata.

Each worker that lends answers on ``host:port + tp_rank`` (TCP) with one
framed message, its ``Handshake``, and closes. A frame is::

    magic b"KVPH" | version u16 | length u32 | payload (length bytes)

(big-endian), the payload a JSON object. A frame is at most
``MAX_FRAME`` bytes; anything else (another magic or version, a short or
long frame, a payload that is not the expected object) is refused with a
``HandshakeError`` that says what was wrong. The asking side sends nothing
but its request line (``GET <rank>``) so a stray connection costs the
server one small read.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

MAGIC = b"KVPH"
VERSION = 2
HEADER = struct.Struct(">4sHI")
#: The largest frame either side accepts (kvpoll's engine metadata is a
#: few hundred bytes).
MAX_FRAME = 64 * 1024
_REQUEST_MAX = 64

logger = logging.getLogger(__name__)


class HandshakeError(Exception):
    """A side-channel answer was missing or malformed."""


@dataclass(frozen=True)
class Handshake:
    """What a lending worker tells its readers about itself."""

    #: vLLM's engine id of the instance.
    engine_id: str
    #: Random per process: a restarted instance has a new one.
    instance: str
    tp_rank: int
    tp_size: int
    #: Bytes of one block in one region, and how the KV is cut in regions.
    block_bytes: int
    num_regions: int
    num_blocks: int
    #: kvpoll's engine metadata, for ``Engine.add_peer``.
    metadata: bytes
    #: KV heads per block of this rank when they are outermost in each
    #: block (a head range is then one byte range); 0 otherwise.
    block_heads: int = 0

    def encode(self) -> bytes:
        body = json.dumps(
            {
                "engine_id": self.engine_id,
                "instance": self.instance,
                "tp_rank": self.tp_rank,
                "tp_size": self.tp_size,
                "block_bytes": self.block_bytes,
                "num_regions": self.num_regions,
                "num_blocks": self.num_blocks,
                "metadata": base64.b64encode(self.metadata).decode(),
                "block_heads": self.block_heads,
            }
        ).encode()
        if HEADER.size + len(body) > MAX_FRAME:
            raise HandshakeError(f"handshake of {len(body)} bytes exceeds {MAX_FRAME}")
        return HEADER.pack(MAGIC, VERSION, len(body)) + body

    @classmethod
    def decode(cls, frame: bytes) -> "Handshake":
        if len(frame) < HEADER.size:
            raise HandshakeError(f"short frame: {len(frame)} bytes, the header alone is {HEADER.size}")
        magic, version, length = HEADER.unpack_from(frame)
        if magic != MAGIC:
            raise HandshakeError(f"not a kvpoll handshake (magic {magic!r})")
        if version != VERSION:
            raise HandshakeError(f"handshake version {version}, this side speaks {VERSION}")
        if HEADER.size + length > MAX_FRAME:
            raise HandshakeError(f"handshake of {length} bytes exceeds {MAX_FRAME}")
        if len(frame) != HEADER.size + length:
            raise HandshakeError(f"frame says {length} payload bytes, {len(frame) - HEADER.size} arrived")
        try:
            obj = json.loads(frame[HEADER.size :])
            fields = {
                "engine_id": str,
                "instance": str,
                "tp_rank": int,
                "tp_size": int,
                "block_bytes": int,
                "num_regions": int,
                "num_blocks": int,
                "metadata": str,
                "block_heads": int,
            }
            if not isinstance(obj, dict):
                raise HandshakeError(f"handshake payload is not a handshake object: {type(obj).__name__}")
            unknown = sorted(set(obj) - set(fields))
            if unknown:
                raise HandshakeError(f"handshake has unknown fields {unknown}")
            for name, kind in fields.items():
                if not isinstance(obj.get(name), kind) or isinstance(obj.get(name), bool):
                    raise HandshakeError(f"handshake field {name!r} missing or not {kind.__name__}")
            metadata = base64.b64decode(obj["metadata"], validate=True)
        except HandshakeError:
            raise
        except (ValueError, AttributeError) as e:
            raise HandshakeError(f"handshake payload is not a handshake object: {e}") from e
        for name in ("tp_size", "block_bytes", "num_regions", "num_blocks"):
            if obj[name] <= 0:
                raise HandshakeError(f"handshake field {name!r} must be positive, got {obj[name]}")
        if obj["block_heads"] < 0:
            raise HandshakeError(f"handshake field 'block_heads' must not be negative, got {obj['block_heads']}")
        if not 0 <= obj["tp_rank"] < obj["tp_size"]:
            raise HandshakeError(f"handshake tp_rank {obj['tp_rank']} outside tp_size {obj['tp_size']}")
        return cls(**{**obj, "metadata": metadata})


def new_instance() -> str:
    return os.urandom(8).hex()


class HandshakeServer:
    """Answers ``GET <rank>`` on ``(host, port)`` with the handshake, from a
    daemon thread, until ``close()``."""

    def __init__(self, host: str, port: int, handshake: Handshake) -> None:
        self._frame = handshake.encode()
        self._rank = handshake.tp_rank
        self._sock = socket.create_server((host, port), reuse_port=False)
        self._sock.settimeout(0.5)
        self.address: Tuple[str, int] = self._sock.getsockname()[:2]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvpoll-handshake", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(2.0)
                    line = _read_line(conn)
                    if line == f"GET {self._rank}".encode():
                        conn.sendall(self._frame)
                    else:
                        logger.warning("kvpoll side channel: refused request %r", line[:_REQUEST_MAX])
                except OSError:
                    continue

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(5)


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while b"\n" not in data and len(data) <= _REQUEST_MAX:
        chunk = conn.recv(_REQUEST_MAX)
        if not chunk:
            break
        data += chunk
    return data.split(b"\n", 1)[0]


def fetch_handshake(host: str, port: int, tp_rank: int, timeout_s: float = 5.0) -> Handshake:
    """Asks the worker at ``(host, port)`` for its handshake; raises
    ``HandshakeError`` if it cannot be reached or answers anything but a
    valid handshake for ``tp_rank``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.sendall(f"GET {tp_rank}\n".encode())
            frame = b""
            while len(frame) <= MAX_FRAME:
                chunk = s.recv(65536)
                if not chunk:
                    break
                frame += chunk
    except OSError as e:
        raise HandshakeError(f"no handshake from {host}:{port}: {e}") from e
    if len(frame) > MAX_FRAME:
        raise HandshakeError(f"{host}:{port} sent more than {MAX_FRAME} bytes")
    hs = Handshake.decode(frame)
    if hs.tp_rank != tp_rank:
        raise HandshakeError(f"{host}:{port} answered for tp_rank {hs.tp_rank}, asked for {tp_rank}")
    return hs


class HandshakeCache:
    """Handshakes by (engine id, rank), fetched once; ``forget`` drops one
    so that the next use fetches it again (the remote may have restarted)."""

    def __init__(self, timeout_s: float = 5.0) -> None:
        self.timeout_s = timeout_s
        self._known: Dict[Tuple[str, int], Handshake] = {}

    def get(self, engine_id: str, host: str, port: int, tp_rank: int) -> Handshake:
        key = (engine_id, tp_rank)
        hs = self._known.get(key)
        if hs is None:
            hs = fetch_handshake(host, port + tp_rank, tp_rank, self.timeout_s)
            if hs.engine_id != engine_id:
                raise HandshakeError(
                    f"{host}:{port + tp_rank} is engine {hs.engine_id!r}, the request names {engine_id!r}"
                )
            self._known[key] = hs
        return hs

    def forget(self, engine_id: str, tp_rank: Optional[int] = None) -> None:
        for key in [k for k in self._known if k[0] == engine_id and tp_rank in (None, k[1])]:
            del self._known[key]
