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
server one small read. In push mode a decode also sends ``PUSH <rank>``
with a ``PushRequest`` frame (write my blocks) or ``FREE <rank>`` with a
``PushRelease`` frame (nobody will ask: free yours).

Both sides bound a whole exchange, not each read: a server gives each
client ``FRAME_DEADLINE_S`` to send its request and serves clients on
threads of their own, and an asking side gives the answer its timeout, so
bytes trickled in keep nobody waiting. Nothing here runs on vLLM's step:
``HandshakeCache`` fetches on a thread pool and the worker half sends its
push requests and releases there too.

With the deployment's key (``auth.SideChannelKey``) every request starts
with a ``KEY`` line and every answer with one: a client without the key,
with another, or replaying a request is refused (``NO <why>``) and
counted, and a client refuses an answer whose tag does not check out.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from .auth import SideChannelKey
from .log import get_logger

MAGIC = b"KVPH"
VERSION = 2
HEADER = struct.Struct(">4sHI")
#: The largest frame either side accepts (kvpoll's engine metadata is a
#: few hundred bytes).
MAX_FRAME = 64 * 1024
#: The longest request line (a ``KEY`` line is 115 bytes).
_REQUEST_MAX = 192

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
    #: The order of the elements inside a block (for vLLM's CPU layout
    #: ``cpu_attn/`` and the kernels' instruction set, which decides it);
    #: "" where not known.
    block_layout: str = ""
    #: Each rank holds the whole KV (MLA's latent cache, replicated across
    #: tensor-parallel ranks) rather than a share of its heads.
    kv_replicated: bool = False

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
                "block_layout": self.block_layout,
                "kv_replicated": self.kv_replicated,
            },
            "handshake",
        )

    @classmethod
    def decode(cls, frame: bytes) -> "Handshake":
        obj = _object_of(frame, "handshake")
        # From a peer that does not name them.
        obj.setdefault("block_layout", "")
        obj.setdefault("kv_replicated", False)
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
    "block_layout": str,
    "kv_replicated": bool,
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


@dataclass(frozen=True)
class PushRelease:
    """What a decode worker tells a push-mode prefill worker when the
    request will not be loaded after all (aborted before it was scheduled,
    or nothing left to load): free the blocks held for it now."""

    engine_id: str
    request_id: str

    def encode(self) -> bytes:
        return _frame_of({"engine_id": self.engine_id, "request_id": self.request_id}, "release")

    @classmethod
    def decode(cls, frame: bytes) -> "PushRelease":
        obj = _object_of(frame, "release")
        _check_fields(obj, {"engine_id": str, "request_id": str}, "release")
        return cls(engine_id=obj["engine_id"], request_id=obj["request_id"])


class _Deadline:
    """Reads from a socket against one deadline for a whole message,
    however its bytes are paced: each ``recv`` waits at most what is left."""

    def __init__(self, conn: socket.socket, seconds: float, what: str) -> None:
        self.conn = conn
        self.what = what
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def recv(self, n: int) -> bytes:
        left = self.end - time.monotonic()
        if left <= 0:
            raise socket.timeout(f"{self.what} not complete within {self.seconds:g} s")
        self.conn.settimeout(left)
        try:
            return self.conn.recv(n)
        except socket.timeout as e:
            raise socket.timeout(f"{self.what} not complete within {self.seconds:g} s") from e


#: How long a client of the side channel has, from its connection, to send
#: its whole request (line and frame); a slower one is dropped.
FRAME_DEADLINE_S = 2.0
#: Clients served at once; one past it is dropped at once (a handshake is
#: one small exchange: only a flood of stalled clients reaches this).
MAX_CLIENTS = 64


class HandshakeServer:
    """Answers ``GET <rank>`` on ``(host, port)`` with the handshake,
    ``PUSH <rank>`` followed by a ``PushRequest`` frame with ``OK`` or
    ``NO <why>`` (what ``on_push`` says), and ``FREE <rank>`` followed by
    a ``PushRelease`` frame with ``OK`` (``on_free`` takes it), until
    ``close()``. Each client is served on a thread of its own and has
    ``FRAME_DEADLINE_S`` from its connection to send its whole request,
    however its bytes trickle in: a slow or hostile client never holds up
    another. ``on_push`` and ``on_free`` are called on those threads."""

    def __init__(
        self,
        host: str,
        port: int,
        handshake: Handshake,
        on_push: Optional[Callable[[PushRequest], Optional[str]]] = None,
        on_free: Optional[Callable[["PushRelease"], None]] = None,
        key: Optional[SideChannelKey] = None,
    ) -> None:
        self._frame = handshake.encode()
        self._key = key
        self._on_push = on_push
        self._on_free = on_free
        self._rank = handshake.tp_rank
        self._sock = socket.create_server((host, port), reuse_port=False)
        self._sock.settimeout(0.5)
        self.address: Tuple[str, int] = self._sock.getsockname()[:2]
        self._stop = threading.Event()
        self._clients = threading.BoundedSemaphore(MAX_CLIENTS)
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
            if not self._clients.acquire(blocking=False):
                logger.warning("kvpoll side channel: %d clients at once, one more dropped", MAX_CLIENTS)
                conn.close()
                continue
            threading.Thread(target=self._client, args=(conn,), name="kvpoll-handshake-client", daemon=True).start()

    def _client(self, conn: socket.socket) -> None:
        try:
            with conn:
                reader = _Deadline(conn, FRAME_DEADLINE_S, "side-channel request")
                line, rest = _read_line(reader)
                key_line = None
                if line.startswith(b"KEY "):
                    key_line, (line, rest) = line, _read_line(reader, rest)
                frame = b""
                if line in (f"PUSH {self._rank}".encode(), f"FREE {self._rank}".encode()):
                    frame = _read_frame(reader, rest)
                nonce = None
                if self._key is not None or key_line is not None:
                    if self._key is None:
                        why = "this side channel has no key (auth_key_file or KVPOLL_AUTH_KEY): its workers run without one"
                    else:
                        nonce, why = self._key.check_request(key_line or b"", line + b"\n" + frame)
                    if nonce is None:
                        logger.warning("kvpoll side channel: unauthenticated request refused: %s", why)
                        conn.settimeout(FRAME_DEADLINE_S)
                        conn.sendall(f"NO {why}\n".encode())
                        return
                if line == f"GET {self._rank}".encode():
                    answer = self._frame
                elif line == f"PUSH {self._rank}".encode() and self._on_push is not None:
                    answer = self._push(frame)
                elif line == f"FREE {self._rank}".encode() and self._on_free is not None:
                    answer = self._free(frame)
                else:
                    logger.warning("kvpoll side channel: refused request %r", line[:_REQUEST_MAX])
                    return
                if self._key is not None and nonce is not None:
                    answer = self._key.seal_answer(nonce, answer)
                conn.settimeout(FRAME_DEADLINE_S)
                conn.sendall(answer)
        except OSError as e:
            logger.debug("kvpoll side channel: client dropped: %s", e)
        finally:
            self._clients.release()

    def _push(self, frame: bytes) -> bytes:
        """Answers one push request frame."""
        assert self._on_push is not None
        try:
            why = self._on_push(PushRequest.decode(frame))
        except HandshakeError as e:
            why = str(e)
        if why is not None:
            logger.warning("kvpoll side channel: push request refused: %s", why)
            return f"NO {why}\n".encode()[:MAX_FRAME]
        return b"OK\n"

    def _free(self, frame: bytes) -> bytes:
        """Hands one release frame on."""
        assert self._on_free is not None
        try:
            self._on_free(PushRelease.decode(frame))
        except HandshakeError as e:
            logger.warning("kvpoll side channel: release refused: %s", e)
            return f"NO {e}\n".encode()[:MAX_FRAME]
        return b"OK\n"

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(5)


def _read_frame(reader: "_Deadline", data: bytes) -> bytes:
    """One frame: its header, then the length it says (at most MAX_FRAME)."""
    while len(data) < HEADER.size:
        chunk = reader.recv(HEADER.size)
        if not chunk:
            return data
        data += chunk
    length = HEADER.unpack_from(data)[2]
    want = HEADER.size + min(length, MAX_FRAME)
    while len(data) < want:
        chunk = reader.recv(want - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _read_line(reader: "_Deadline", data: bytes = b"") -> Tuple[bytes, bytes]:
    """The request line (after what already arrived, ``data``), and what
    arrived after it."""
    while b"\n" not in data and len(data) <= _REQUEST_MAX:
        chunk = reader.recv(_REQUEST_MAX)
        if not chunk:
            break
        data += chunk
    line, _, rest = data.partition(b"\n")
    return line, rest


def _exchange(
    host: str,
    port: int,
    request: bytes,
    timeout_s: float,
    what: str,
    until: Callable[[bytes], bool],
    key: Optional[SideChannelKey] = None,
) -> bytes:
    """Sends ``request`` and reads the answer until ``until(answer)``, the
    server closes, or MAX_FRAME is passed, all within ``timeout_s`` from
    the connect: an answer trickled in is refused like a missing one. With
    ``key``, the request is tagged and the answer's tag checked (a ``NO``
    refusal, which the server cannot tag for a request it refused, is
    given back as it came)."""
    if key is not None:
        request, nonce = key.seal_request(request)
        answer = _exchange(host, port, request, timeout_s, what, lambda a: b"\n" in a and until(a.partition(b"\n")[2]))
        if answer.startswith(b"NO "):
            return answer
        opened = key.open_answer(nonce, answer)
        if opened is None:
            raise HandshakeError(
                f"{host}:{port}: the {what}'s tag does not check out (the worker holds another key, or none)"
            )
        return opened
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            reader = _Deadline(s, timeout_s, what)
            s.sendall(request)
            answer = b""
            while not until(answer) and len(answer) <= MAX_FRAME:
                chunk = reader.recv(65536)
                if not chunk:
                    break
                answer += chunk
            return answer
    except OSError as e:
        raise HandshakeError(f"no {what} from {host}:{port}: {e}") from e


def _line_ok(host: str, port: int, answer: bytes, what: str) -> None:
    line = answer.partition(b"\n")[0]
    if line != b"OK":
        raise HandshakeError(f"{host}:{port} refused the {what}: {line.decode(errors='replace')[:200]}")


def send_push_request(
    host: str, port: int, tp_rank: int, req: PushRequest, timeout_s: float = 5.0, key: Optional[SideChannelKey] = None
) -> None:
    """Asks prefill rank ``tp_rank`` at ``(host, port)`` to write ``req``;
    raises ``HandshakeError`` if it cannot be reached or refuses."""
    request = f"PUSH {tp_rank}\n".encode() + req.encode()
    answer = _exchange(host, port, request, timeout_s, "answer to a push request", lambda a: b"\n" in a, key)
    _line_ok(host, port, answer, "push request")


def send_push_release(
    host: str, port: int, tp_rank: int, rel: "PushRelease", timeout_s: float = 5.0, key: Optional[SideChannelKey] = None
) -> None:
    """Tells prefill rank ``tp_rank`` that nobody will ask for ``rel``'s
    request: it frees the blocks it holds for it now, not at the lease's
    end. Raises ``HandshakeError`` if it cannot be reached or refuses."""
    request = f"FREE {tp_rank}\n".encode() + rel.encode()
    answer = _exchange(host, port, request, timeout_s, "answer to a release", lambda a: b"\n" in a, key)
    _line_ok(host, port, answer, "release")


def fetch_handshake(
    host: str, port: int, tp_rank: int, timeout_s: float = 5.0, key: Optional[SideChannelKey] = None
) -> Handshake:
    """Asks the worker at ``(host, port)`` for its handshake; raises
    ``HandshakeError`` if it cannot be reached, does not answer in full
    within ``timeout_s``, or answers anything but a valid handshake for
    ``tp_rank``."""
    frame = _exchange(host, port, f"GET {tp_rank}\n".encode(), timeout_s, "handshake", lambda a: False, key)
    if frame.startswith(b"NO "):
        why = frame[3:].partition(b"\n")[0].decode(errors="replace")[:200]
        raise HandshakeError(f"{host}:{port} refused the handshake: {why}")
    if len(frame) > MAX_FRAME:
        raise HandshakeError(f"{host}:{port} sent more than {MAX_FRAME} bytes")
    hs = Handshake.decode(frame)
    if hs.tp_rank != tp_rank:
        raise HandshakeError(f"{host}:{port} answered for tp_rank {hs.tp_rank}, asked for {tp_rank}")
    return hs


class HandshakeCache:
    """Handshakes by (engine id, rank), fetched once, in the background.

    ``poll`` never waits on the network: it returns the handshake when it
    is known, ``None`` while its fetch runs (on a small thread pool), and
    raises the fetch's ``HandshakeError`` once it failed. A failure is
    remembered: until its back-off ends (``backoff_s``: the first and the
    longest, doubling between) every ``poll`` raises it again at once,
    without a connection. ``forget`` drops what is known of an engine, so
    that the next use fetches again (the remote may have restarted).
    ``get`` is the same, waiting for the answer."""

    def __init__(
        self,
        timeout_s: float = 5.0,
        backoff_s: Tuple[float, float] = (1.0, 10.0),
        threads: int = 4,
        key: Optional[SideChannelKey] = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.key = key
        self.backoff_s = backoff_s
        self._known: Dict[Tuple[str, int], Handshake] = {}
        self._fetching: Dict[Tuple[str, int], "Future[Handshake]"] = {}
        # key -> (the error, when it may be tried again, the back-off used)
        self._failed: Dict[Tuple[str, int], Tuple[HandshakeError, float, float]] = {}
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvpoll-fetch")
        #: Fetches started (connections attempted), for the tests and stats.
        self.fetches = 0

    def poll(self, engine_id: str, host: str, port: int, tp_rank: int) -> Optional[Handshake]:
        key = (engine_id, tp_rank)
        hs = self._known.get(key)
        if hs is not None:
            return hs
        fut = self._fetching.get(key)
        if fut is None:
            failed = self._failed.get(key)
            if failed is not None:
                if time.monotonic() < failed[1]:
                    raise failed[0]
            self.fetches += 1
            self._fetching[key] = self._pool.submit(self._fetch, engine_id, host, port, tp_rank)
            return None
        if not fut.done():
            return None
        del self._fetching[key]
        try:
            hs = fut.result()
        except HandshakeError as e:
            last = self._failed.get(key)
            wait = self.backoff_s[0] if last is None else min(2 * last[2], self.backoff_s[1])
            self._failed[key] = (e, time.monotonic() + wait, wait)
            raise
        self._failed.pop(key, None)
        self._known[key] = hs
        return hs

    def get(self, engine_id: str, host: str, port: int, tp_rank: int) -> Handshake:
        while True:
            hs = self.poll(engine_id, host, port, tp_rank)
            if hs is not None:
                return hs
            wait([self._fetching[(engine_id, tp_rank)]])

    def _fetch(self, engine_id: str, host: str, port: int, tp_rank: int) -> Handshake:
        hs = fetch_handshake(host, port + tp_rank, tp_rank, self.timeout_s, self.key)
        if hs.engine_id != engine_id:
            raise HandshakeError(f"{host}:{port + tp_rank} is engine {hs.engine_id!r}, the request names {engine_id!r}")
        return hs

    def forget(self, engine_id: str, tp_rank: Optional[int] = None) -> None:
        """Drops the handshakes known of ``engine_id`` (one rank, or all):
        the next use fetches again. A remembered failure keeps its
        back-off: forgetting is for a handshake that turned out stale."""
        for key in [k for k in self._known if k[0] == engine_id and tp_rank in (None, k[1])]:
            del self._known[key]

    def submit(self, fn: Callable[..., Any], *args: Any) -> "Future[Any]":
        """Runs ``fn(*args)`` on the fetching threads (another exchange on
        the side channel that must not wait on vLLM's step)."""
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
