"""A minimal disaggregated-serving proxy for two ``vllm serve`` instances
with ``KvpollConnector``: each ``/v1/completions`` (or chat) request goes
to the prefill instance with ``max_tokens`` 1 and ``kv_transfer_params``
``{"do_remote_decode": true}``, then to the decode instance with the
``kv_transfer_params`` the prefill answered; the decode's answer is the
client's, streamed through as it comes when the client asked for a
stream. An instance that refuses connections (restarting) is tried
again for up to a minute before the request fails. A client that goes away is not served further: the proxy closes
its connection to whichever instance it is waiting on, so that instance
aborts the request (vLLM aborts a request whose client disconnected), as
it would for a client connected to it directly. One thread per
connection::

    python -m kvpoll.vllm.proxy --prefill http://10.0.0.1:8100 \\
        --decode http://10.0.0.2:8200 --port 8000
"""

from __future__ import annotations

import argparse
import http.client
import json
import select
import socket
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

#: The largest request body the proxy reads.
MAX_BODY = 16 * 1024 * 1024
#: The most bytes of a non-streamed answer the proxy holds.
MAX_ANSWER = 256 * 1024 * 1024
#: How often a waiting request looks whether its client is still there.
WATCH_S = 0.2
#: How long a request waits for an instance that refuses connections (one
#: restarting) before it fails; nothing was sent to it yet, so trying
#: again is safe.
CONNECT_WAIT_S = 60.0


class ClientGone(Exception):
    """The client closed its connection before its answer was complete."""


class Upstream:
    """The connection a request has open to an instance, which the
    client's watcher closes when the client goes away (the instance then
    sees its client gone and aborts the request)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conn: Optional[http.client.HTTPConnection] = None
        self.gone = False

    def open(self, url: str, timeout_s: float) -> http.client.HTTPConnection:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"not an http:// URL: {url!r}")
        conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout_s)
        with self._lock:
            if self.gone:
                raise ClientGone()
            self._conn = conn
        return conn

    def done(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def abandon(self) -> None:
        """The client went away: cut what is open, refuse what comes."""
        with self._lock:
            self.gone = True
            conn = self._conn
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _request(
    up: Upstream, url: str, body: Dict[str, Any], timeout_s: float
) -> Tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    parts = urllib.parse.urlsplit(url)
    give_up = time.monotonic() + min(CONNECT_WAIT_S, timeout_s)
    while True:
        conn = up.open(url, timeout_s)
        try:
            conn.connect()
            break
        except ConnectionRefusedError:
            up.done()
            if time.monotonic() >= give_up:
                raise
            time.sleep(0.5)
    try:
        conn.request(
            "POST",
            parts.path or "/",
            body=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        return conn, conn.getresponse()
    except (OSError, http.client.HTTPException):
        if up.gone:
            raise ClientGone() from None
        raise


def post(url: str, body: Dict[str, Any], timeout_s: float, up: Optional[Upstream] = None) -> Tuple[int, bytes]:
    """POSTs ``body`` as JSON; the status and the whole answer."""
    up = up or Upstream()
    try:
        _, resp = _request(up, url, body, timeout_s)
        data = resp.read(MAX_ANSWER + 1)
        if len(data) > MAX_ANSWER:
            return 502, json.dumps({"error": f"an answer of more than {MAX_ANSWER} bytes"}).encode()
        return resp.status, data
    except (OSError, http.client.HTTPException) as e:
        if up.gone:
            raise ClientGone() from None
        return 502, json.dumps({"error": f"{url}: {type(e).__name__}: {e}"}).encode()
    finally:
        up.done()


def _prefill(prefill: str, path: str, body: Dict[str, Any], timeout_s: float, up: Upstream):
    """The prefill's step: the decode's params, or an error answer."""
    first = dict(body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    first.pop("max_completion_tokens", None)
    first.pop("stream_options", None)
    status, data = post(prefill + path, first, timeout_s, up)
    if status != 200:
        return None, (status, data)
    try:
        params = json.loads(data).get("kv_transfer_params")
    except (ValueError, AttributeError):
        return None, (502, b'{"error": "the prefill answered no JSON object"}')
    if not isinstance(params, dict):
        return None, (502, b'{"error": "the prefill answered no kv_transfer_params"}')
    return params, None


def disaggregate(
    prefill: str, decode: str, path: str, body: Dict[str, Any], timeout_s: float, up: Optional[Upstream] = None
) -> Tuple[int, bytes]:
    """The prefill's step, then the decode's; an error of either is the
    answer (non-streaming)."""
    up = up or Upstream()
    params, err = _prefill(prefill, path, body, timeout_s, up)
    if err is not None:
        return err
    return post(decode + path, dict(body, kv_transfer_params=params), timeout_s, up)


def stream(
    prefill: str, decode: str, path: str, body: Dict[str, Any], timeout_s: float, up: Upstream
) -> Tuple[int, Optional[bytes], Iterator[bytes]]:
    """The prefill's step, then the decode's, its answer as it comes:
    ``(status, error body or None, chunks)``."""
    params, err = _prefill(prefill, path, body, timeout_s, up)
    if err is not None:
        return err[0], err[1], iter(())
    try:
        _, resp = _request(up, decode + path, dict(body, kv_transfer_params=params), timeout_s)
    except (OSError, http.client.HTTPException) as e:
        up.done()
        return 502, json.dumps({"error": f"{decode}: {type(e).__name__}: {e}"}).encode(), iter(())
    if resp.status != 200:
        try:
            return resp.status, resp.read(MAX_BODY), iter(())
        finally:
            up.done()

    def chunks() -> Iterator[bytes]:
        try:
            while True:
                chunk = resp.read1(64 * 1024)
                if not chunk:
                    return
                yield chunk
        except (OSError, http.client.HTTPException):
            if up.gone:
                raise ClientGone() from None
            raise
        finally:
            up.done()

    return 200, None, chunks()


def _watch(sock: socket.socket, up: Upstream, stop: threading.Event) -> None:
    """Until ``stop``: abandons the request once its client closed. (poll,
    not select: a busy proxy holds descriptors past select's 1024.)"""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
    while not stop.is_set():
        try:
            if poller.poll(int(WATCH_S * 1000)):
                if not sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                    up.abandon()
                    return
                stop.wait(WATCH_S)  # bytes of a next request: not a close
        except BlockingIOError:
            continue
        except (OSError, ValueError):
            up.abandon()
            return


class _Server(ThreadingHTTPServer):
    # Hundreds of clients may connect at once (a benchmark's burst).
    request_queue_size = 1024
    daemon_threads = True


def serve(prefill: str, decode: str, host: str, port: int, timeout_s: float = 300.0) -> ThreadingHTTPServer:
    """A server on ``(host, port)``; call ``serve_forever`` on it. The
    instances' URLs must be ``http://host:port`` (a ``ValueError`` if not)."""
    for url in (prefill, decode):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"not an http:// URL: {url!r}")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            if self.path not in ("/v1/completions", "/v1/chat/completions"):
                return self._answer(404, b'{"error": "not found"}')
            try:
                length = int(self.headers.get("Content-Length", "0"))
                if not 0 <= length <= MAX_BODY:
                    raise ValueError(f"body of {length} bytes")
                body = json.loads(self.rfile.read(length))
                if not isinstance(body, dict):
                    raise ValueError("not a JSON object")
            except ValueError as e:
                return self._answer(400, json.dumps({"error": f"bad request: {e}"}).encode())
            self._watched(lambda up: self._serve(body, up))

        def _serve(self, body: Dict[str, Any], up: Upstream) -> None:
            if not body.get("stream"):
                return self._answer(*disaggregate(prefill, decode, self.path, body, timeout_s, up))
            status, error, chunks = stream(prefill, decode, self.path, body, timeout_s, up)
            if error is not None:
                return self._answer(status, error)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
            for chunk in chunks:
                self.wfile.write(chunk)
                self.wfile.flush()

        def _watched(self, serve_one: Callable[[Upstream], None]) -> None:
            up = Upstream()
            stop = threading.Event()
            watcher = threading.Thread(target=_watch, args=(self.connection, up, stop), daemon=True)
            watcher.start()
            try:
                serve_one(up)
            except (ClientGone, OSError, http.client.HTTPException):
                # The client went away, or the decode did mid-stream (the
                # client sees its stream end without its final event).
                up.abandon()
                self.close_connection = True
            finally:
                stop.set()
                up.done()
                watcher.join()

        def _answer(self, status: int, data: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            return

    return _Server((host, port), Handler)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", required=True, help="the prefill instance's base URL")
    ap.add_argument("--decode", required=True, help="the decode instance's base URL")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds an instance may take to answer")
    a = ap.parse_args()
    serve(a.prefill.rstrip("/"), a.decode.rstrip("/"), a.host, a.port, a.timeout).serve_forever()


if __name__ == "__main__":
    main()
