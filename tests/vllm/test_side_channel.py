"""The handshake side channel refuses what is not a handshake, with an
error that says what was wrong."""

from __future__ import annotations

import socket
import struct
import threading

import pytest

from kvpoll.vllm.side_channel import (
    HEADER,
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
