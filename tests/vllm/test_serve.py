"""`vllm serve` for real: a prefill and a decode OpenAI server with
KvpollConnector, kvpoll's proxy between them, prompts over HTTP. Greedy:
each disaggregated completion is token for token what the decode instance
answers for the same request alone (policy "fail", so identical tokens
mean the KV came over kvpoll), and the decode's /metrics counts the loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Dict, List

import pytest

from harness import free_port
from instance import kv_config

N = 6
MAX_TOKENS = 8


def post(url: str, body: Dict[str, Any]) -> Dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def server(model: str, port: int, kv: Dict[str, Any], log: str) -> subprocess.Popen:
    # vLLM's CPU backend binds each instance's worker threads to the first
    # cores it finds: both instances (and the kvpoll pollers their workers
    # start, which inherit the binding) would share one core, the
    # prefill's engine stepping on it while it holds lent blocks.
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port)]
    cmd += ["--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager", "--max-model-len", "512", "--seed", "0"]
    cmd += ["--kv-transfer-config", json.dumps(kv)]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def healthy(port: int, proc: subprocess.Popen, timeout_s: float = 600.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        assert proc.poll() is None, f"the server on port {port} exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError(f"the server on port {port} did not come up")


def kvpoll_lines(logs: Any) -> str:
    """The connector's lines of both instances' logs (failed loads carry
    their reason)."""
    out = []
    for name in ("prefill.log", "decode.log"):
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
        server(model_dir, p_port, kv_config(free_port()), str(logs / "prefill.log")),
        # A read may take long on a starved CI machine: the decode waits
        # up to 90 s, within the prefill's default lease (120 s).
        server(model_dir, d_port, kv_config(free_port(), "fail", read_deadline_s=90.0), str(logs / "decode.log")),
    ]
    proxy = serve(f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}", "127.0.0.1", 0)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        healthy(p_port, procs[0])
        healthy(d_port, procs[1])
        yield f"http://127.0.0.1:{proxy.server_address[1]}", f"http://127.0.0.1:{d_port}", logs
    finally:
        proxy.shutdown()
        for proc in procs:
            try:
                os.killpg(proc.pid, 15)
            except ProcessLookupError:
                pass
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)


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
    with urllib.request.urlopen(decode + "/metrics", timeout=30) as r:
        metrics = {
            line.split("{")[0]: float(line.rsplit(" ", 1)[1])
            for line in r.read().decode().splitlines()
            if line.startswith("vllm:kvpoll_")
        }
    assert metrics["vllm:kvpoll_num_transfers_total"] == N
    assert metrics["vllm:kvpoll_num_failed_transfers_total"] == 0
    assert metrics["vllm:kvpoll_bytes_transferred_total"] > 0
