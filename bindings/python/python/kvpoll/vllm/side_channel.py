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
import os
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from .log import get_logger

MAGIC = b"KVPH"
VERSION = 2
HEADER = struct.Struct(">4sHI")
#: The largest frame either side accepts (kvpoll's engine metadata is a
#: few hundred bytes).
MAX_FRAME = 64 * 1024
_REQUEST_MAX = 64

logger = get_logger(__name__)


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
        return _frame_of(
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
            },
            "handshake",
        )

    @classmethod
    def decode(cls, frame: bytes) -> "Handshake":
        obj = _object_of(frame, "handshake")
        _check_fields(obj, _HANDSHAKE_FIELDS, "handshake")
        try:
            metadata = base64.b64decode(obj["metadata"], validate=True)
        except ValueError as e:
            raise HandshakeError(f"handshake metadata is not base64: {e}") from e
        for name in ("tp_size", "block_bytes", "num_regions", "num_blocks"):
            if obj[name] <= 0:
                raise HandshakeError(f"handshake field {name!r} must be positive, got {obj[name]}")
        if obj["block_heads"] < 0:
            raise HandshakeError(f"handshake field 'block_heads' must not be negative, got {obj['block_heads']}")
        if not 0 <= obj["tp_rank"] < obj["tp_size"]:
            raise HandshakeError(f"handshake tp_rank {obj['tp_rank']} outside tp_size {obj['tp_size']}")
        return cls(**{**obj, "metadata": metadata})


_HANDSHAKE_FIELDS: Dict[str, Any] = {
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


def new_instance() -> str:
    return os.urandom(8).hex()


def _frame_of(obj: Dict[str, Any], what: str) -> bytes:
    body = json.dumps(obj).encode()
    if HEADER.size + len(body) > MAX_FRAME:
        raise HandshakeError(f"{what} of {len(body)} bytes exceeds {MAX_FRAME}")
    return HEADER.pack(MAGIC, VERSION, len(body)) + body


def _object_of(frame: bytes, what: str) -> Dict[str, Any]:
    """The JSON object of a frame, or a HandshakeError saying what is wrong."""
    if len(frame) < HEADER.size:
        raise HandshakeError(f"short frame: {len(frame)} bytes, the header alone is {HEADER.size}")
    magic, version, length = HEADER.unpack_from(frame)
    if magic != MAGIC:
        raise HandshakeError(f"not a kvpoll {what} (magic {magic!r})")
    if version != VERSION:
        raise HandshakeError(f"{what} version {version}, this side speaks {VERSION}")
    if HEADER.size + length > MAX_FRAME:
        raise HandshakeError(f"{what} of {length} bytes exceeds {MAX_FRAME}")
    if len(frame) != HEADER.size + length:
        raise HandshakeError(f"frame says {length} payload bytes, {len(frame) - HEADER.size} arrived")
    try:
        obj = json.loads(frame[HEADER.size :])
    except ValueError as e:
        raise HandshakeError(f"{what} payload is not a {what} object: {e}") from e
    if not isinstance(obj, dict):
        raise HandshakeError(f"{what} payload is not a {what} object: {type(obj).__name__}")
    return obj


def _check_fields(obj: Dict[str, Any], fields: Dict[str, Any], what: str) -> None:
    unknown = sorted(set(obj) - set(fields))
    if unknown:
        raise HandshakeError(f"{what} has unknown fields {unknown}")
    for name, kind in fields.items():
        v = obj.get(name)
        if not isinstance(v, kind) or (isinstance(v, bool) and kind is not bool):
            raise HandshakeError(f"{what} field {name!r} missing or not {getattr(kind, '__name__', kind)}")


def _byte_range(v: Any, what: str) -> Optional[Tuple[int, int]]:
    if v is None:
        return None
    if (
        not isinstance(v, list)
        or len(v) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in v)
        or not 0 <= v[0] < v[1]
    ):
        raise HandshakeError(f"push request field {what!r} is not a [start, end) byte range: {v!r}")
    return (v[0], v[1])


@dataclass(frozen=True)
class PushRequest:
    """What a decode worker asks of a prefill worker in push mode: write
    prefill request ``request_id``'s KV into these blocks of mine, which I
    lent to writers under ``incarnation``."""

    #: The prefill's engine id and its request (``remote_*`` of the params).
    engine_id: str
    request_id: str
    #: The decode worker: its engine id, per-process instance and rank.
    decode_engine_id: str
    decode_instance: str
    decode_rank: int
    #: Its kvpoll engine metadata, for the prefill's ``Engine.add_peer``.
    metadata: bytes
    #: The decode's blocks, in the order of the prefill's last blocks.
    block_ids: Tuple[int, ...]
    incarnation: int
    #: The bytes of each prefill block to write, and where in each decode
    #: block (None: whole blocks, the same TP size).
    local_bytes: Optional[Tuple[int, int]] = None
    remote_bytes: Optional[Tuple[int, int]] = None

    def encode(self) -> bytes:
        return _frame_of(
            {
                "engine_id": self.engine_id,
                "request_id": self.request_id,
                "decode_engine_id": self.decode_engine_id,
                "decode_instance": self.decode_instance,
                "decode_rank": self.decode_rank,
                "metadata": base64.b64encode(self.metadata).decode(),
                "block_ids": list(self.block_ids),
                "incarnation": f"{self.incarnation:x}",
                "local_bytes": list(self.local_bytes) if self.local_bytes else None,
                "remote_bytes": list(self.remote_bytes) if self.remote_bytes else None,
            },
            "push request",
        )

    @classmethod
    def decode(cls, frame: bytes) -> "PushRequest":
        what = "push request"
        obj = _object_of(frame, what)
        _check_fields(
            obj,
            {
                "engine_id": str,
                "request_id": str,
                "decode_engine_id": str,
                "decode_instance": str,
                "decode_rank": int,
                "metadata": str,
                "block_ids": list,
                "incarnation": str,
                "local_bytes": (list, type(None)),
                "remote_bytes": (list, type(None)),
            },
            what,
        )
        blocks = obj["block_ids"]
        if not blocks or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in blocks):
            raise HandshakeError(f"push request block_ids is not a non-empty list of block ids: {blocks[:8]!r}")
        try:
            inc = int(obj["incarnation"], 16)
            metadata = base64.b64decode(obj["metadata"], validate=True)
        except ValueError as e:
            raise HandshakeError(f"push request incarnation or metadata malformed: {e}") from e
        if not 0 < inc < 2**64:
            raise HandshakeError(f"push request incarnation out of range: {obj['incarnation']!r}")
        if obj["decode_rank"] < 0:
            raise HandshakeError(f"push request decode_rank negative: {obj['decode_rank']}")
        lb, rb = _byte_range(obj["local_bytes"], "local_bytes"), _byte_range(obj["remote_bytes"], "remote_bytes")
        if (lb is None) != (rb is None) or (lb and lb[1] - lb[0] != rb[1] - rb[0]):
            raise HandshakeError(f"push request byte ranges {lb} and {rb} do not pair")
        return cls(
            engine_id=obj["engine_id"],
            request_id=obj["request_id"],
            decode_engine_id=obj["decode_engine_id"],
            decode_instance=obj["decode_instance"],
            decode_rank=obj["decode_rank"],
            metadata=metadata,
            block_ids=tuple(blocks),
            incarnation=inc,
            local_bytes=lb,
            remote_bytes=rb,
        )


class HandshakeServer:
    """Answers ``GET <rank>`` on ``(host, port)`` with the handshake, and
    ``PUSH <rank>`` followed by a ``PushRequest`` frame with ``OK`` or
    ``NO <why>`` (what ``on_push`` says, called on the server's thread),
    from a daemon thread, until ``close()``."""

    def __init__(
        self,
        host: str,
        port: int,
        handshake: Handshake,
        on_push: Optional[Callable[[PushRequest], Optional[str]]] = None,
    ) -> None:
        self._frame = handshake.encode()
        self._on_push = on_push
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
                    line, rest = _read_line(conn)
                    if line == f"GET {self._rank}".encode():
                        conn.sendall(self._frame)
                    elif line == f"PUSH {self._rank}".encode() and self._on_push is not None:
                        conn.sendall(self._push(conn, rest))
                    else:
                        logger.warning("kvpoll side channel: refused request %r", line[:_REQUEST_MAX])
                except OSError:
                    continue

    def _push(self, conn: socket.socket, data: bytes) -> bytes:
        """Reads one push request frame (``data`` is what came with the
        request line) and answers it."""
        assert self._on_push is not None
        while len(data) < HEADER.size:
            chunk = conn.recv(HEADER.size)
            if not chunk:
                break
            data += chunk
        if len(data) >= HEADER.size:
            length = HEADER.unpack_from(data)[2]
            want = HEADER.size + min(length, MAX_FRAME)
            while len(data) < want:
                chunk = conn.recv(want - len(data))
                if not chunk:
                    break
                data += chunk
        try:
            why = self._on_push(PushRequest.decode(data))
        except HandshakeError as e:
            why = str(e)
        if why is not None:
            logger.warning("kvpoll side channel: push request refused: %s", why)
            return f"NO {why}\n".encode()[:MAX_FRAME]
        return b"OK\n"

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(5)


def _read_line(conn: socket.socket) -> Tuple[bytes, bytes]:
    """The request line, and what arrived after it."""
    data = b""
    while b"\n" not in data and len(data) <= _REQUEST_MAX:
        chunk = conn.recv(_REQUEST_MAX)
        if not chunk:
            break
        data += chunk
    line, _, rest = data.partition(b"\n")
    return line, rest


def send_push_request(host: str, port: int, tp_rank: int, req: PushRequest, timeout_s: float = 5.0) -> None:
    """Asks prefill rank ``tp_rank`` at ``(host, port)`` to write ``req``;
    raises ``HandshakeError`` if it cannot be reached or refuses."""
    frame = req.encode()
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.sendall(f"PUSH {tp_rank}\n".encode() + frame)
            answer = b""
            while b"\n" not in answer and len(answer) <= MAX_FRAME:
                chunk = s.recv(4096)
                if not chunk:
                    break
                answer += chunk
    except OSError as e:
        raise HandshakeError(f"push request to {host}:{port} not delivered: {e}") from e
    line = answer.partition(b"\n")[0]
    if line != b"OK":
        raise HandshakeError(f"{host}:{port} refused the push request: {line.decode(errors='replace')[:200]}")


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
