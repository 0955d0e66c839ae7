"""The handshake side channel refuses what is not a handshake, with an
error that says what was wrong."""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Any, Dict

import pytest

from kvpoll.vllm.side_channel import (
    HEADER,
    FRAME_DEADLINE_S,
    MAGIC,
    MAX_FRAME,
    VERSION,
    Handshake,
    HandshakeCache,
    HandshakeError,
    HandshakeServer,
    fetch_handshake,
)

HS = Handshake("engine-a", "00ff", 0, 1, 4096, 2, 64, b"\x01\x02meta", block_heads=2)


def frame(body: bytes, magic: bytes = MAGIC, version: int = VERSION) -> bytes:
    return HEADER.pack(magic, version, len(body)) + body


def test_a_handshake_round_trips():
    assert Handshake.decode(HS.encode()) == HS


@pytest.mark.parametrize(
    "data, says",
    [
        (b"KV", "short frame"),
        (frame(b"{}", magic=b"HTTP"), "not a kvpoll handshake"),
        (frame(b"{}", version=VERSION + 1), "version"),
        (HS.encode()[:-3], "arrived"),
        (HS.encode() + b"xx", "arrived"),
        (struct.pack(">4sHI", MAGIC, VERSION, MAX_FRAME), "exceeds"),
        (frame(b"not json"), "not a handshake object"),
        (frame(b"[1, 2]"), "not a handshake object"),
        (frame(b"5"), "not a handshake object"),
        (frame(b'{"engine_id": "e"}'), "'instance' missing"),
        (frame(HS.encode()[HEADER.size :].replace(b'"tp_rank": 0', b'"tp_rank": 5')), "outside tp_size"),
        (frame(HS.encode()[HEADER.size :].replace(b'"block_bytes": 4096', b'"block_bytes": 0')), "must be positive"),
        (frame(HS.encode()[HEADER.size :].replace(b'"tp_size": 1', b'"tp_size": true')), "'tp_size' missing"),
        (frame(HS.encode()[HEADER.size :].replace(b'"block_heads": 2', b'"block_heads": -1')), "must not be negative"),
        (frame(HS.encode()[HEADER.size :].replace(b'{"engine_id"', b'{"rogue": 1, "engine_id"')), "unknown field"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_a_malformed_answer_is_refused_with_what_was_wrong(data, says):
    with pytest.raises(HandshakeError, match=says):
        Handshake.decode(data)


def _answer_once(payload: bytes) -> int:
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def serve():
        conn, _ = srv.accept()
        with conn:
            conn.recv(64)
            conn.sendall(payload)
        srv.close()

    threading.Thread(target=serve, daemon=True).start()
    return port


def test_a_server_that_answers_garbage_is_refused():
    port = _answer_once(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    with pytest.raises(HandshakeError, match="not a kvpoll handshake"):
        fetch_handshake("127.0.0.1", port, 0, timeout_s=5)


def test_a_server_that_answers_too_much_is_refused():
    port = _answer_once(b"x" * (MAX_FRAME + 10))
    with pytest.raises(HandshakeError, match="more than"):
        fetch_handshake("127.0.0.1", port, 0, timeout_s=5)


def test_the_cache_fetches_once_per_engine_and_rank_and_again_after_forget():
    srv = HandshakeServer("127.0.0.1", 0, HS)
    try:
        port = srv.address[1]
        cache = HandshakeCache(timeout_s=5)
        assert cache.get("engine-a", "127.0.0.1", port, 0) == HS
        srv.close()  # a second fetch would fail now
        assert cache.get("engine-a", "127.0.0.1", port, 0) == HS
        cache.forget("engine-a")
        with pytest.raises(HandshakeError, match="no handshake"):
            cache.get("engine-a", "127.0.0.1", port, 0)
    finally:
        srv.close()


def test_an_answer_from_another_engine_is_refused():
    srv = HandshakeServer("127.0.0.1", 0, HS)
    try:
        with pytest.raises(HandshakeError, match="is engine 'engine-a'"):
            HandshakeCache(5).get("engine-b", "127.0.0.1", srv.address[1], 0)
    finally:
        srv.close()


def _trickle(port: int, data: bytes, every_s: float, stop: threading.Event) -> Dict[str, Any]:
    """Sends ``data`` to ``port`` one byte every ``every_s`` seconds from a
    thread until it is sent, the server drops the connection or ``stop``;
    the result says how many bytes went out and whether it was dropped."""
    out: Dict[str, Any] = {"sent": 0, "dropped": False, "done": threading.Event()}

    def run():
        with socket.create_connection(("127.0.0.1", port)) as s:
            try:
                for b in data:
                    if stop.wait(every_s):
                        break
                    s.sendall(bytes([b]))
                    out["sent"] += 1
                s.settimeout(0.2)
                if not stop.is_set() and s.recv(1) == b"":
                    out["dropped"] = True
            except OSError:
                out["dropped"] = True
        out["done"].set()

    threading.Thread(target=run, daemon=True).start()
    return out


def test_a_client_trickling_its_request_delays_no_other_handshake():
    # One client sends its request line a byte at a time, each byte well
    # inside any per-read timeout; every other client is answered as usual
    # meanwhile.
    srv = HandshakeServer("127.0.0.1", 0, HS)
    stop = threading.Event()
    try:
        port = srv.address[1]
        slow = _trickle(port, b"G" * 60, 0.1, stop)
        time.sleep(0.3)  # the trickle has started
        for _ in range(3):
            assert fetch_handshake("127.0.0.1", port, 0, timeout_s=1.0) == HS
        assert not slow["done"].is_set(), "the trickling client ended before the others were served"
    finally:
        stop.set()
        srv.close()


def test_a_request_that_does_not_arrive_within_its_deadline_is_dropped():
    # 60 bytes at 0.1 s each would take 6 s; the server gives a request
    # FRAME_DEADLINE_S from its first byte, whatever the pace.
    srv = HandshakeServer("127.0.0.1", 0, HS)
    stop = threading.Event()
    try:
        slow = _trickle(srv.address[1], b"G" * 60, 0.1, stop)
        assert slow["done"].wait(FRAME_DEADLINE_S + 3.0)
        assert slow["dropped"] and slow["sent"] < 60, slow
    finally:
        stop.set()
        srv.close()


def test_an_answer_trickled_slower_than_the_handshake_timeout_is_refused():
    # The asking side bounds the whole answer too, not each read.
    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve():
        conn, _ = srv.accept()
        with conn:
            conn.recv(64)
            for b in HS.encode():
                if stop.wait(0.05):
                    break
                try:
                    conn.sendall(bytes([b]))
                except OSError:
                    break
        srv.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        with pytest.raises(HandshakeError, match="within"):
            fetch_handshake("127.0.0.1", srv.getsockname()[1], 0, timeout_s=1.0)
    finally:
        stop.set()


def _poll_until(cache: HandshakeCache, *key: Any, bound_s: float = 10.0) -> Handshake:
    end = time.monotonic() + bound_s
    while True:
        hs = cache.poll(*key)
        if hs is not None or time.monotonic() > end:
            return hs
        time.sleep(0.01)


def test_the_cache_fetches_in_the_background_and_a_pending_fetch_is_not_a_failure():
    gate = threading.Event()
    srv = HandshakeServer("127.0.0.1", 0, HS)
    real = srv.address[1]
    # A relay that holds every connection until the gate opens: the
    # prefill's side channel as a hung process would show it.
    relay = socket.create_server(("127.0.0.1", 0))

    def hold():
        while True:
            try:
                conn, _ = relay.accept()
            except OSError:
                return
            gate.wait()
            with conn, socket.create_connection(("127.0.0.1", real)) as up:
                up.sendall(conn.recv(64))
                conn.sendall(up.recv(MAX_FRAME))

    threading.Thread(target=hold, daemon=True).start()
    cache = HandshakeCache(timeout_s=10)
    try:
        key = ("engine-a", "127.0.0.1", relay.getsockname()[1], 0)
        assert cache.poll(*key) is None  # asked, not answered: pending
        assert cache.poll(*key) is None
        gate.set()
        assert _poll_until(cache, *key) == HS
    finally:
        gate.set()
        relay.close()
        srv.close()
        cache.close()


def test_a_failed_fetch_is_remembered_and_fails_again_at_once_until_its_back_off_ends():
    srv = HandshakeServer("127.0.0.1", 0, HS)
    port = srv.address[1]
    srv.close()  # nobody answers
    cache = HandshakeCache(timeout_s=2, backoff_s=(1.0, 1.0))
    try:
        with pytest.raises(HandshakeError, match="no handshake"):
            _poll_until(cache, "engine-a", "127.0.0.1", port, 0)
        assert cache.fetches == 1
        for _ in range(5):  # no new connection while backing off
            with pytest.raises(HandshakeError, match="no handshake"):
                cache.poll("engine-a", "127.0.0.1", port, 0)
        assert cache.fetches == 1
        time.sleep(1.2)  # the back-off ended: asked again
        with pytest.raises(HandshakeError):
            _poll_until(cache, "engine-a", "127.0.0.1", port, 0)
        assert cache.fetches == 2
    finally:
        cache.close()
