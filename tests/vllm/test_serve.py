"""`vllm serve` for real: a prefill and a decode OpenAI server with
KvpollConnector, kvpoll's proxy between them, prompts over HTTP. Greedy:
each disaggregated completion is token for token what the decode instance
answers for the same request alone (policy "fail", so identical tokens
mean the KV came over kvpoll), and the decode's /metrics counts the loads."""

from __future__ import annotations

import threading
import urllib.error
from typing import Any, List, Tuple

import pytest

from harness import free_port
from serving import healthy, kv_config, metrics, post, server, stop

N = 6
MAX_TOKENS = 8


def kvpoll_lines(logs: Any, names: Tuple[str, ...] = ("prefill.log", "decode.log")) -> str:
    """The connector's lines of both instances' logs (failed loads carry
    their reason)."""
    out = []
    for name in names:
        with open(logs / name, errors="replace") as f:
            out += [f"{name}: {line.rstrip()}" for line in f if "kvpoll" in line and "non-default args" not in line]
    return "\n".join(out[-40:])


@pytest.fixture(scope="module")
def served(model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """(proxy URL, decode URL, logs folder) of a prefill and a decode
    `vllm serve`."""
    from kvpoll.vllm.proxy import serve

    p_port, d_port = free_port(), free_port()
    logs = tmp_path_factory.mktemp("serve")
    procs = [
        server(model_dir, p_port, kv_config("kvpoll", free_port(), ucx_tls="tcp"), str(logs / "prefill.log")),
        # A read may take long on a starved CI machine: the decode waits
        # up to 90 s, within the prefill's default lease (120 s).
        server(
            model_dir,
            d_port,
            kv_config("kvpoll", free_port(), "fail", ucx_tls="tcp", read_deadline_s=90.0),
            str(logs / "decode.log"),
        ),
    ]
    proxy = serve(f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}", "127.0.0.1", 0)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        healthy(f"http://127.0.0.1:{p_port}", procs[0])
        healthy(f"http://127.0.0.1:{d_port}", procs[1])
        yield f"http://127.0.0.1:{proxy.server_address[1]}", f"http://127.0.0.1:{d_port}", logs
    finally:
        proxy.shutdown()
        for proc in procs:
            stop(proc)


def test_completions_through_the_proxy_are_token_for_token_the_decode_alone_and_metrics_count_them(served, model_dir):
    proxy, decode, logs = served
    prompts: List[List[int]] = [[(11 * n + 3 * i) % 500 + 3 for i in range(9 + 7 * n)] for n in range(N)]
    for p in prompts:
        body = {"model": model_dir, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0.0, "return_token_ids": True}
        try:
            dis = post(proxy + "/v1/completions", body)["choices"][0]
        except urllib.error.HTTPError as e:
            pytest.fail(f"disaggregated completion: HTTP {e.code}; the connector's lines:\n{kvpoll_lines(logs)}")
        alone = post(decode + "/v1/completions", body)["choices"][0]
        assert dis["finish_reason"] == "length", dis
        assert len(dis["token_ids"]) == MAX_TOKENS
        assert dis["token_ids"] == alone["token_ids"]
    counts = metrics(decode, "vllm:kvpoll_")
    assert counts["vllm:kvpoll_num_transfers_total"] == N
    assert counts["vllm:kvpoll_num_failed_transfers_total"] == 0
    assert counts["vllm:kvpoll_bytes_transferred_total"] > 0
