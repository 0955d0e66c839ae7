"""Two data-parallel ranks on the decode side, on one host: `vllm serve
--data-parallel-size 2` starts one engine per DP rank (each with its own
engine id), whose workers answer handshakes on ports of their own
(``side_channel_port + dp_index * tp_size + tp_rank``); each decode DP
rank reads from the prefill. Requests run concurrently, so vLLM spreads
them over both decode ranks; every answer is the aggregated one and both
decode ranks load. (Prefill DP ranks name their own engine and port in
their responses: ``test_scheduler_pd.py``; a DP prefill's engines stall
and lend late: ``test_a_prefill_whose_next_step_comes_late_...``.)"""

from __future__ import annotations

import signal
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Dict

import pytest

from harness import free_port
from instance import kv_config
from serving import healthy, post, server, stop
from test_block_sizes import completion
from test_serve import kvpoll_lines

N = 8
MAX_TOKENS = 8
LOGS = ("prefill.log", "decode.log")


def transfers_by_engine(url: str) -> Dict[str, float]:
    """The decode's ``vllm:kvpoll_num_transfers_total`` by engine label."""
    out: Dict[str, float] = {}
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("vllm:kvpoll_num_transfers_total{"):
                labels = line[line.index("{") + 1 : line.index("}")]
                engine = dict(kv.split("=", 1) for kv in labels.split(",")).get("engine", "?").strip('"')
                out[engine] = out.get(engine, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


#: Three engines and their workers on a small host: vLLM's DP engines
#: stall for seconds at a time (an engine core waiting out its workers'
#: message queue), and a starved worker answers handshakes late: the read
#: deadline, the lease and the handshake timeout are set for such a host.
KV = dict(read_deadline_s=90.0, lease_s=180.0, handshake_timeout_s=30.0)
DP = ["--data-parallel-size", "2"]


def prompts(n: int, seed: int = 7):
    return [[(seed * k + 5 * i) % 500 + 3 for i in range(15 + 23 * k)] for k in range(n)]


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    """(urls, processes, log dir): a prefill of one DP rank and a decode of
    two (policy fail)."""
    logs = tmp_path_factory.mktemp("dp-logs")
    ports = {name: free_port() for name in ("prefill", "decode")}
    procs = {
        "prefill": server(model_dir, ports["prefill"], kv_config(free_port(), **KV), str(logs / "prefill.log")),
        "decode": server(model_dir, ports["decode"], kv_config(free_port(), **KV), str(logs / "decode.log"), args=DP),
    }
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    try:
        for name, proc in procs.items():
            healthy(urls[name], proc, log=str(logs / f"{name}.log"))
        yield urls, procs, logs
    finally:
        for proc in procs.values():
            stop(proc)


def prefilled(model_dir, url: str, prompt):
    first = post(url + "/v1/completions", completion(model_dir, prompt, 1, {"do_remote_decode": True}))
    return first["kv_transfer_params"]


def test_two_decode_dp_ranks_on_one_host_answer_as_aggregated_and_both_load(model_dir, servers):
    urls, _, logs = servers
    ps = prompts(N)

    def disaggregated(prompt):
        params = prefilled(model_dir, urls["prefill"], prompt)
        return post(urls["decode"] + "/v1/completions", completion(model_dir, prompt, MAX_TOKENS, params))

    with ThreadPoolExecutor(N) as pool:
        results = list(pool.map(disaggregated, ps))
    for prompt, answer in zip(ps, results):
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "length", (choice, kvpoll_lines(logs, LOGS))
        # Aggregated: the prefill instance computes the whole request.
        alone = post(urls["prefill"] + "/v1/completions", completion(model_dir, prompt, MAX_TOKENS))["choices"][0]
        assert choice["token_ids"] == alone["token_ids"], kvpoll_lines(logs, LOGS)
    loads = transfers_by_engine(urls["decode"])
    assert sum(loads.values()) == N and len([v for v in loads.values() if v > 0]) == 2, loads


def test_a_killed_prefill_read_by_two_decode_dp_ranks_gives_recomputed_or_failed_responses_never_other_tokens(
    model_dir, servers
):
    urls, procs, logs = servers
    ps = prompts(N, seed=11)
    reference = [
        post(urls["prefill"] + "/v1/completions", completion(model_dir, q, MAX_TOKENS))["choices"][0]["token_ids"]
        for q in ps
    ]
    params = [prefilled(model_dir, urls["prefill"], q) for q in ps]
    stop(procs["prefill"], signal.SIGKILL)
    half = N // 2

    def decoded(url):
        def one(args):
            q, x = args
            try:
                return post(url + "/v1/completions", completion(model_dir, q, MAX_TOKENS, x))["choices"][0]
            except urllib.error.HTTPError as e:
                # A server error is an error answer too; a refused request
                # (4xx) is not what is tested.
                return {"finish_reason": "error" if e.code >= 500 else f"HTTP {e.code}"}

        return one

    # Policy fail (concurrent, so both DP ranks take some): every one an error.
    with ThreadPoolExecutor(half) as pool:
        failed = list(pool.map(decoded(urls["decode"]), zip(ps[half:], params[half:])))
    assert all(c["finish_reason"] == "error" for c in failed), (failed, kvpoll_lines(logs, LOGS))
    # Policy recompute, on a decode of two DP ranks started now: the
    # aggregated tokens.
    port = free_port()
    rec = server(model_dir, port, kv_config(free_port(), "recompute", **KV), str(logs / "recompute.log"), args=DP)
    try:
        url = f"http://127.0.0.1:{port}"
        healthy(url, rec, log=str(logs / "recompute.log"))
        with ThreadPoolExecutor(half) as pool:
            recomputed = list(pool.map(decoded(url), zip(ps[:half], params[:half])))
        assert [c["token_ids"] for c in recomputed] == reference[:half], kvpoll_lines(logs, LOGS + ("recompute.log",))
        assert sum(transfers_by_engine(url).values()) == 0
    finally:
        stop(rec)
