"""Behind vllm-router, the Rust load balancer users run in front of vLLM's
NixlConnector (``--vllm-pd-disaggregation``, its default ``nixl``
connector): a prefill and a decode ``vllm serve`` with KvpollConnector,
the router between them and the client, prompts over HTTP. The router
sends the prefill NIXL's ``kv_transfer_params`` with their keys null and
forwards the prefill's answer to the decode as it came. Greedy, policy
"fail" on the decode: each completion, streamed or not, is token for
token what the decode answers for the same request alone (an aggregated
instance: it computes the prompt itself), and the decode's /metrics
counts a load for each, so the KV came over kvpoll.

The router is installed from the package registry into
``target/vllm-router-env`` (kept between runs); the test is skipped only
when it cannot be installed."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Dict, List

import pytest

from harness import free_port
from instance import kv_config
from serving import healthy, metrics, post, server, stop
from test_serve import kvpoll_lines

ROUTER = "vllm-router==0.1.17"
ROUTER_ENV = Path(__file__).resolve().parents[2] / "target" / "vllm-router-env"
N = 6
MAX_TOKENS = 8


def router_binary() -> Path:
    """vllm-router's command, installed into its own environment first if
    it is not there (pip, from the registry)."""
    exe = ROUTER_ENV / "bin" / "vllm-router"
    pip = ROUTER_ENV / "bin" / "pip"
    name, version = ROUTER.split("==")
    have = subprocess.run([str(pip), "show", name], capture_output=True, text=True) if pip.exists() else None
    if exe.exists() and have is not None and f"Version: {version}" in have.stdout:
        return exe
    steps = [[sys.executable, "-m", "venv", str(ROUTER_ENV)], [str(pip), "install", "-q", ROUTER]]
    for cmd in steps:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"{ROUTER} could not be installed into {ROUTER_ENV}: {done.stderr.strip()[-500:]}")
    return exe


@pytest.fixture(scope="module")
def routed(model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """(router URL, decode URL, logs folder): a prefill and a decode
    `vllm serve` behind vllm-router."""
    exe = router_binary()
    p_port, d_port, r_port = free_port(), free_port(), free_port()
    logs = tmp_path_factory.mktemp("router")
    procs = [
        server(model_dir, p_port, kv_config(free_port()), str(logs / "prefill.log")),
        # A starved machine's read may take long: up to 90 s, within the
        # prefill's default lease (120 s).
        server(model_dir, d_port, kv_config(free_port(), "fail", read_deadline_s=90.0), str(logs / "decode.log")),
    ]
    try:
        healthy(f"http://127.0.0.1:{p_port}", procs[0])
        healthy(f"http://127.0.0.1:{d_port}", procs[1])
        cmd = [str(exe), "--vllm-pd-disaggregation", "--host", "127.0.0.1", "--port", str(r_port)]
        cmd += ["--prefill", f"http://127.0.0.1:{p_port}", "--decode", f"http://127.0.0.1:{d_port}"]
        # One attempt each: a retried request would be a second prefill.
        cmd += ["--disable-retries", "--log-level", "warning"]
        with open(logs / "router.log", "wb") as out:
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        url = f"http://127.0.0.1:{r_port}"
        healthy(url, procs[-1], 120.0, str(logs / "router.log"))
        yield url, f"http://127.0.0.1:{d_port}", logs
    finally:
        for proc in reversed(procs):
            stop(proc)


def loads(decode: str) -> Dict[str, float]:
    """The decode's kvpoll counters on its /metrics."""
    return metrics(decode, "vllm:kvpoll_")


def completion(model_dir: str, prompt: List[int], **more: Any) -> Dict[str, Any]:
    return {
        "model": model_dir,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "return_token_ids": True,
        **more,
    }


def test_completions_behind_vllm_router_are_token_for_token_the_aggregated_ones_and_loaded_over_kvpoll(
    routed, model_dir
):
    router, decode, logs = routed
    before = loads(decode)
    prompts: List[List[int]] = [[(13 * n + 5 * i) % 500 + 3 for i in range(11 + 9 * n)] for n in range(N)]
    for p in prompts:
        body = completion(model_dir, p)
        try:
            dis = post(router + "/v1/completions", body)["choices"][0]
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[-500:]
            pytest.fail(f"completion through the router: HTTP {e.code} {detail}\n{kvpoll_lines(logs)}")
        alone = post(decode + "/v1/completions", body)["choices"][0]
        assert dis["finish_reason"] == "length", dis
        assert len(dis["token_ids"]) == MAX_TOKENS
        assert dis["token_ids"] == alone["token_ids"]
    after = loads(decode)
    assert after["vllm:kvpoll_num_transfers_total"] - before["vllm:kvpoll_num_transfers_total"] == N, kvpoll_lines(logs)
    assert after["vllm:kvpoll_num_failed_transfers_total"] == before["vllm:kvpoll_num_failed_transfers_total"]
    assert after["vllm:kvpoll_bytes_transferred_total"] > before["vllm:kvpoll_bytes_transferred_total"]


def test_a_completion_streamed_behind_vllm_router_is_token_for_token_the_aggregated_one(routed, model_dir):
    # The router asks the prefill without streaming and streams the
    # decode's answer: the decode must have loaded the KV all the same.
    router, decode, logs = routed
    before = loads(decode)
    prompt = [(7 * i) % 500 + 3 for i in range(45)]
    body = completion(model_dir, prompt, stream=True)
    req = urllib.request.Request(
        router + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    streamed: List[int] = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            data = line.decode().strip()
            if not data.startswith("data: ") or data == "data: [DONE]":
                continue
            for choice in json.loads(data[len("data: ") :]).get("choices", ()):
                streamed.extend(choice.get("token_ids") or ())
    alone = post(decode + "/v1/completions", completion(model_dir, prompt))["choices"][0]
    assert streamed == alone["token_ids"] and len(streamed) == MAX_TOKENS, (streamed, alone)
    after = loads(decode)
    assert after["vllm:kvpoll_num_transfers_total"] - before["vllm:kvpoll_num_transfers_total"] == 1, kvpoll_lines(logs)
    assert after["vllm:kvpoll_num_failed_transfers_total"] == before["vllm:kvpoll_num_failed_transfers_total"]
