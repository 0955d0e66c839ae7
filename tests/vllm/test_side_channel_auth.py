"""The side channel with the deployment's key: a keyed client is served; a
client without the key, with another, or replaying a request is refused
with a reason and counted, before any push reaches the worker; a keyed
client refuses an answer its server did not tag; the connector's stats
carry the count."""

from __future__ import annotations

import socket
import threading
from typing import List

import pytest

from kvpoll.vllm.auth import SideChannelKey, load_secret
from kvpoll.vllm.side_channel import (
    Handshake,
    HandshakeError,
    HandshakeServer,
    PushRequest,
    fetch_handshake,
    send_push_request,
)
from kvpoll.vllm.stats import KvpollStats
from serving import read_to_end

HS = Handshake("engine-a", "00ff", 0, 1, 4096, 2, 64, b"\x01\x02meta", block_heads=2)
SECRET = b"the deployment's shared secret"
ASK = PushRequest("engine-a", "req-1", "engine-b", "0a0b", 0, b"meta", (1, 2), 77)


@pytest.fixture
def keyed():
    key = SideChannelKey(SECRET)
    pushed: List[PushRequest] = []
    srv = HandshakeServer("127.0.0.1", 0, HS, on_push=lambda r: pushed.append(r), key=key)
    yield srv, key, pushed
    srv.close()


def test_a_client_with_the_key_gets_the_handshake_and_its_push_through(keyed):
    srv, key, pushed = keyed
    host, port = srv.address
    client = SideChannelKey(SECRET)
    assert fetch_handshake(host, port, 0, key=client) == HS
    send_push_request(host, port, 0, ASK, key=client)
    assert pushed == [ASK]
    assert key.take_refused() == 0


def test_a_client_without_the_key_or_with_another_is_refused_and_counted(keyed):
    srv, key, pushed = keyed
    host, port = srv.address
    with pytest.raises(HandshakeError, match="needs the deployment's key"):
        fetch_handshake(host, port, 0)
    with pytest.raises(HandshakeError, match="tag does not check out"):
        fetch_handshake(host, port, 0, key=SideChannelKey(b"another deployment's secret"))
    with pytest.raises(HandshakeError, match="needs the deployment's key"):
        send_push_request(host, port, 0, ASK)
    assert pushed == [], "an unauthenticated push reached the worker"
    assert key.take_refused() == 3
    assert key.take_refused() == 0, "taken once"


def exchange(address, data: bytes) -> bytes:
    with socket.create_connection(address, timeout=5) as s:
        s.sendall(data)
        return read_to_end(s)


def test_a_replayed_request_is_refused_and_counted(keyed):
    srv, key, _ = keyed
    sealed, _nonce = SideChannelKey(SECRET).seal_request(b"GET 0\n")
    assert exchange(srv.address, sealed).startswith(b"KEY ")
    assert exchange(srv.address, sealed) == b"NO a request seen before (replayed)\n"
    assert key.take_refused() == 1


def test_a_keyed_client_refuses_an_untagged_answer_and_an_unkeyed_server_says_it_has_no_key():
    fake = socket.create_server(("127.0.0.1", 0))
    address = fake.getsockname()[:2]

    def answer_plainly():
        conn, _ = fake.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(HS.encode())

    t = threading.Thread(target=answer_plainly, daemon=True)
    t.start()
    with pytest.raises(HandshakeError, match="tag does not check out"):
        fetch_handshake(*address, 0, key=SideChannelKey(SECRET))
    t.join(5)
    fake.close()
    plain = HandshakeServer("127.0.0.1", 0, HS)
    try:
        with pytest.raises(HandshakeError, match="has no key"):
            fetch_handshake(*plain.address, 0, key=SideChannelKey(SECRET))
    finally:
        plain.close()


def test_the_secret_comes_from_the_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("KVPOLL_AUTH_KEY", raising=False)
    assert load_secret(None) is None
    monkeypatch.setenv("KVPOLL_AUTH_KEY", " the env's shared secret \n")
    assert load_secret(None) == b"the env's shared secret"
    path = tmp_path / "key"
    path.write_bytes(SECRET + b"\n")
    assert load_secret(str(path)) == SECRET
    path.write_bytes(b"short\n")
    with pytest.raises(ValueError, match="at least 16"):
        load_secret(str(path))


def test_the_connectors_stats_count_unauthenticated_peers():
    a = KvpollStats(data={"num_transfers": 0, "num_failed": 0, "bytes": 0, "durations_s": [], "num_unauthenticated": 2})
    b = KvpollStats(data={"num_transfers": 1, "num_failed": 0, "bytes": 8, "durations_s": [0.1], "num_unauthenticated": 1})
    assert not a.is_empty()
    assert a.aggregate(b).reduce()["Num unauthenticated peers"] == 3
