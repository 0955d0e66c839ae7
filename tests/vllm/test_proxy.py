"""kvpoll.vllm.proxy between a client and two stand-in instances (plain
HTTP servers that answer as vLLM's OpenAI server does): a streamed answer
passes through as it comes, and a client that goes away makes the proxy
close its connection to the instance serving it, the signal on which vLLM
aborts the request."""

from __future__ import annotations

import json
import select
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List

import pytest

from kvpoll.vllm.proxy import serve
from serving import read_to_end as read_all

PARAMS = {"kvpoll_lend": "x", "remote_block_ids": [1, 2]}
BOUND_S = 30.0


class Instance:
    """A stand-in for one vLLM instance: records the bodies it got; its
    answers are held until ``release`` is set; ``gone`` is set when the
    proxy closed the connection of a request still held."""

    def __init__(self, answer_chunks: List[bytes], hold: bool = False, port: int = 0) -> None:
        self.bodies: List[Dict[str, Any]] = []
        self.release = threading.Event()
        self.held = threading.Event()
        self.gone = threading.Event()
        if not hold:
            self.release.set()
        inst = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                inst.bodies.append(body)
                inst.held.set()
                while not inst.release.wait(0.05):
                    r, _, _ = select.select([self.connection], [], [], 0)
                    if r and not self.connection.recv(1, socket.MSG_PEEK):
                        inst.gone.set()
                        return
                if body.get("stream"):
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    for c in answer_chunks:
                        self.wfile.write(c)
                        self.wfile.flush()
                else:
                    data = json.dumps({"choices": [{"text": "t1"}], "kv_transfer_params": PARAMS}).encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


CHUNKS = [b'data: {"choices": [{"text": " t5"}]}\n\n', b'data: {"choices": [{"text": " t9"}]}\n\n', b"data: [DONE]\n\n"]


@pytest.fixture
def pair():
    made: List[Any] = []

    def make(prefill_hold: bool = False, decode_hold: bool = False):
        p, d = Instance([], prefill_hold), Instance(CHUNKS, decode_hold)
        proxy = serve(p.url, d.url, "127.0.0.1", 0, timeout_s=BOUND_S)
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        made.extend([p, d, proxy])
        return p, d, proxy.server_address[1]

    yield make
    for m in made:
        if isinstance(m, Instance):
            m.close()
        else:
            m.shutdown()
            m.server_close()


def request(port: int, body: Dict[str, Any]) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=BOUND_S)
    data = json.dumps(body).encode()
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return s


def test_a_streamed_request_is_prefilled_whole_then_streamed_from_the_decode_with_the_prefills_params(pair):
    p, d, port = pair()
    s = request(port, {"prompt": "t3 t4", "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}})
    head, _, rest = read_all(s).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") or head.startswith(b"HTTP/1.1 200"), head
    assert b"text/event-stream" in head
    assert rest == b"".join(CHUNKS)
    (first,) = p.bodies
    assert first["max_tokens"] == 1 and first["stream"] is False and "stream_options" not in first
    assert first["kv_transfer_params"] == {"do_remote_decode": True}
    (second,) = d.bodies
    assert second["stream"] is True and second["max_tokens"] == 8
    assert second["kv_transfer_params"] == PARAMS


def test_a_client_gone_while_the_decode_works_closes_the_decodes_connection(pair):
    p, d, port = pair(decode_hold=True)
    s = request(port, {"prompt": "t3", "max_tokens": 8, "stream": True})
    assert d.held.wait(BOUND_S), "the decode never got the request"
    s.close()
    assert d.gone.wait(BOUND_S), "the proxy kept the decode's connection open for a client that left"


def test_a_client_gone_during_the_prefill_closes_the_prefills_connection_and_never_asks_the_decode(pair):
    p, d, port = pair(prefill_hold=True)
    s = request(port, {"prompt": "t3", "max_tokens": 8})
    assert p.held.wait(BOUND_S), "the prefill never got the request"
    s.close()
    assert p.gone.wait(BOUND_S), "the proxy kept the prefill's connection open for a client that left"
    p.release.set()
    assert not d.held.wait(1.0), "the decode was asked for a client that had left"


def test_a_non_streamed_request_gets_the_decodes_whole_answer(pair):
    p, d, port = pair()
    s = request(port, {"prompt": "t3", "max_tokens": 8})
    head, _, rest = read_all(s).partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0]
    assert json.loads(rest)["kv_transfer_params"] == PARAMS  # the stand-in decode echoes its shape
    assert d.bodies[0]["kv_transfer_params"] == PARAMS


def test_a_request_waits_for_a_prefill_that_is_restarting_instead_of_failing(pair):
    # A prefill that is down (killed, being restarted): its port refuses
    # connections until the new one listens.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    d = Instance(CHUNKS)
    proxy = serve(f"http://127.0.0.1:{port}", d.url, "127.0.0.1", 0, timeout_s=BOUND_S)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    answer: List[bytes] = []
    try:
        s = request(proxy.server_address[1], {"prompt": "t3", "max_tokens": 8, "stream": True})
        reader = threading.Thread(target=lambda: answer.append(read_all(s)))
        reader.start()
        reader.join(1.5)
        assert reader.is_alive(), f"answered before the prefill was back: {answer}"
        p = Instance([], port=port)
        reader.join(BOUND_S)
        assert answer and answer[0].partition(b"\r\n\r\n")[2] == b"".join(CHUNKS), answer
        assert len(p.bodies) == 1 and len(d.bodies) == 1
        p.close()
    finally:
        proxy.shutdown()
        proxy.server_close()
        d.close()


def test_a_proxy_holding_more_than_1024_descriptors_still_serves(pair):
    # Hundreds of clients at once give the proxy's process descriptors
    # numbered past 1024, where select() cannot watch a socket.
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"a descriptor limit of {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    held = [socket.socket() for _ in range(1100)]
    try:
        p, d, port = pair()
        s = request(port, {"prompt": "t3", "max_tokens": 8, "stream": True})
        assert s.fileno() > 1024
        head, _, rest = read_all(s).partition(b"\r\n\r\n")
        assert b" 200 " in head.split(b"\r\n")[0], head
        assert rest == b"".join(CHUNKS)
    finally:
        for h in held:
            h.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_an_instance_url_the_proxy_cannot_reach_is_refused_at_start():
    for bad in ("https://127.0.0.1:8100", "127.0.0.1:8100", "http://"):
        with pytest.raises(ValueError, match="http://"):
            serve(bad, "http://127.0.0.1:8200", "127.0.0.1", 0)
