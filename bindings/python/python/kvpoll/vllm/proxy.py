"""A minimal disaggregated-serving proxy for two ``vllm serve`` instances
with ``KvpollConnector``: each ``/v1/completions`` request goes to the
prefill instance with ``max_tokens`` 1 and ``kv_transfer_params``
``{"do_remote_decode": true}``, then to the decode instance with the
``kv_transfer_params`` the prefill answered; the decode's answer is the
client's. Non-streaming requests only; one thread per connection::

    python -m kvpoll.vllm.proxy --prefill http://10.0.0.1:8100 \\
        --decode http://10.0.0.2:8200 --port 8000
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, Tuple

#: The largest request body the proxy reads.
MAX_BODY = 16 * 1024 * 1024


def post(url: str, body: Dict[str, Any], timeout_s: float) -> Tuple[int, bytes]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def disaggregate(prefill: str, decode: str, path: str, body: Dict[str, Any], timeout_s: float) -> Tuple[int, bytes]:
    """The prefill's step, then the decode's; an error of either is the answer."""
    first = dict(body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    first.pop("max_completion_tokens", None)
    status, data = post(prefill + path, first, timeout_s)
    if status != 200:
        return status, data
    try:
        params = json.loads(data).get("kv_transfer_params")
    except (ValueError, AttributeError):
        return 502, b'{"error": "the prefill answered no JSON object"}'
    if not isinstance(params, dict):
        return 502, b'{"error": "the prefill answered no kv_transfer_params"}'
    return post(decode + path, dict(body, kv_transfer_params=params), timeout_s)


def serve(prefill: str, decode: str, host: str, port: int, timeout_s: float = 300.0) -> ThreadingHTTPServer:
    """A server on ``(host, port)``; call ``serve_forever`` on it."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            if self.path not in ("/v1/completions", "/v1/chat/completions"):
                return self._answer(404, b'{"error": "not found"}')
            try:
                length = int(self.headers.get("Content-Length", "0"))
                if not 0 <= length <= MAX_BODY:
                    raise ValueError(f"body of {length} bytes")
                body = json.loads(self.rfile.read(length))
                if not isinstance(body, dict) or body.get("stream"):
                    raise ValueError("a non-streaming request object")
            except ValueError as e:
                return self._answer(400, json.dumps({"error": f"bad request: {e}"}).encode())
            self._answer(*disaggregate(prefill, decode, self.path, body, timeout_s))

        def _answer(self, status: int, data: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            return

    return ThreadingHTTPServer((host, port), Handler)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", required=True, help="the prefill instance's base URL")
    ap.add_argument("--decode", required=True, help="the decode instance's base URL")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    a = ap.parse_args()
    serve(a.prefill.rstrip("/"), a.decode.rstrip("/"), a.host, a.port).serve_forever()


if __name__ == "__main__":
    main()
