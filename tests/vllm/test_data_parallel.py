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

import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Dict

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


def test_two_decode_dp_ranks_on_one_host_answer_as_aggregated_and_both_load(model_dir, tmp_path):
    ports = {name: free_port() for name in ("prefill", "decode")}
    dp = ["--data-parallel-size", "2"]
    # Three engines and their workers on a small host: vLLM's DP engines
    # stall for seconds at a time (an engine core waiting out its workers'
    # message queue), and a starved worker answers handshakes late: the
    # read deadline, the lease and the handshake timeout are set for such
    # a host.
    kv = dict(read_deadline_s=90.0, lease_s=180.0, handshake_timeout_s=30.0)
    procs = {
        "prefill": server(model_dir, ports["prefill"], kv_config(free_port(), **kv), str(tmp_path / "prefill.log")),
        "decode": server(model_dir, ports["decode"], kv_config(free_port(), **kv), str(tmp_path / "decode.log"), args=dp),
    }
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    try:
        for name, proc in procs.items():
            healthy(urls[name], proc, log=str(tmp_path / f"{name}.log"))
        prompts = [[(7 * n + 5 * i) % 500 + 3 for i in range(15 + 23 * n)] for n in range(N)]

        def disaggregated(prompt):
            first = post(urls["prefill"] + "/v1/completions", completion(model_dir, prompt, 1, {"do_remote_decode": True}))
            params = first["kv_transfer_params"]
            return post(urls["decode"] + "/v1/completions", completion(model_dir, prompt, MAX_TOKENS, params))

        with ThreadPoolExecutor(N) as pool:
            results = list(pool.map(disaggregated, prompts))
        for prompt, answer in zip(prompts, results):
            choice = answer["choices"][0]
            assert choice["finish_reason"] == "length", (choice, kvpoll_lines(tmp_path, LOGS))
            # Aggregated: the prefill instance computes the whole request.
            alone = post(urls["prefill"] + "/v1/completions", completion(model_dir, prompt, MAX_TOKENS))["choices"][0]
            assert choice["token_ids"] == alone["token_ids"], kvpoll_lines(tmp_path, LOGS)
        loads = transfers_by_engine(urls["decode"])
        assert sum(loads.values()) == N and len([v for v in loads.values() if v > 0]) == 2, loads
    finally:
        for proc in procs.values():
            stop(proc)
