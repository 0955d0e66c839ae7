"""A hybrid model (sliding-window and full-attention layers alternating,
as Gemma 2/3 and gpt-oss lay them out): the tiny Llama with
``layer_types`` and a 32-token window, which vLLM's Llama honours per
layer, served by ``vllm serve`` with vLLM's hybrid KV cache manager on
(kvpoll declares hybrid support, so vLLM keeps it on): two KV cache
groups whose layers share one tensor, the window group holding only the
window's blocks. kvpoll moves each group's blocks, the window group's in
the window only: the decode answers as the prefill does alone, and the
bytes it read are those blocks' and no more. A killed prefill gives the
aggregated tokens (policy recompute) or errors (policy fail), never
other tokens: failed loads go to vLLM by request, as it requires with
several groups."""

from __future__ import annotations

import json
import os
import signal
import urllib.error
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List

import pytest

from harness import HEAD, KV_HEADS, free_port, tiny_model
from instance import kv_config
from serving import healthy, metrics, post, server, stop
from test_block_sizes import completion
from test_serve import kvpoll_lines

N = 6
MAX_TOKENS = 8
WINDOW = 32
#: Tokens a block holds, as asked; vLLM's CPU backend may choose larger
#: blocks for a hybrid model's groups (the params name the size used).
BLOCK = 16
NAMES = ("prefill", "fail", "recompute")
LOGS = tuple(f"{n}.log" for n in NAMES)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory) -> str:
    path = tiny_model(str(tmp_path_factory.mktemp("tiny-hybrid")))
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


@pytest.fixture(scope="module")
def served(hybrid_dir, tmp_path_factory):
    """(``{name: URL}``, ``{name: process}``, logs folder): a prefill and
    two decodes (policies fail and recompute) of the hybrid model."""
    logs = tmp_path_factory.mktemp("hybrid")
    ports = {name: free_port() for name in NAMES}
    # The prefix cache on, as vLLM serves by default: the prompts of each
    # test share no prefix with another's, except where a test says so.
    args = ["--block-size", str(BLOCK)]
    kv = dict(read_deadline_s=20.0, handshake_timeout_s=5.0, lease_s=60.0)
    policies = {"prefill": "fail", "fail": "fail", "recompute": "recompute"}
    procs = {
        name: server(hybrid_dir, ports[name], kv_config(free_port(), policies[name], **kv), str(logs / f"{name}.log"), args=args)
        for name in NAMES
    }
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    try:
        for name, proc in procs.items():
            healthy(urls[name], proc, log=str(logs / f"{name}.log"))
        yield urls, procs, logs
    finally:
        for proc in procs.values():
            stop(proc)


def prompts(n: int, seed: int) -> List[List[int]]:
    return [[(seed * k + 5 * i) % 500 + 3 for i in range(3 * WINDOW + 17 * k)] for k in range(n)]


def answer(model: str, url: str, prompt: List[int], max_tokens: int, params: Any = None) -> Dict[str, Any]:
    try:
        return post(url + "/v1/completions", completion(model, prompt, max_tokens, params))
    except urllib.error.HTTPError as e:
        # A server error is an error answer; a refused request is not.
        return {"choices": [{"finish_reason": "error" if e.code >= 500 else f"HTTP {e.code}"}]}


def test_a_hybrid_models_groups_load_the_window_groups_window_only_and_answer_as_aggregated(hybrid_dir, served):
    urls, _, logs = served
    ps = prompts(N, 13)

    def disaggregated(prompt):
        first = post(urls["prefill"] + "/v1/completions", completion(hybrid_dir, prompt, 1, {"do_remote_decode": True}))
        params = first["kv_transfer_params"]
        return params, answer(hybrid_dir, urls["fail"], prompt, MAX_TOKENS, params)

    with ThreadPoolExecutor(N) as pool:
        results = list(pool.map(disaggregated, ps))
    blocks = 0
    for prompt, (params, out) in zip(ps, results):
        window, full = params["remote_block_ids"]
        size = params["remote_block_size"]
        # The prompt's blocks in the full-attention group, the window's in
        # the other (wherever it starts inside a block): vLLM ran that
        # group as a sliding window.
        assert len(full) == -(-len(prompt) // size) and 0 < len(window) <= -(-WINDOW // size) + 1 < len(full), params
        blocks += len(full) + len(window)
        choice = out["choices"][0]
        assert choice["finish_reason"] == "length", (choice, kvpoll_lines(logs, LOGS))
        # Aggregated: the prefill instance computes the whole request.
        alone = post(urls["prefill"] + "/v1/completions", completion(hybrid_dir, prompt, MAX_TOKENS))["choices"][0]
        assert choice["token_ids"] == alone["token_ids"], kvpoll_lines(logs, LOGS)
    # The two layers (one a group) share the KV cache's tensor: a block
    # read moves its group's layer once, float32 keys and values of every
    # KV head.
    layer_block = KV_HEADS * size * 2 * HEAD * 4
    moved = metrics(urls["fail"], "vllm:kvpoll_")
    assert moved["vllm:kvpoll_num_transfers_total"] == N
    assert moved["vllm:kvpoll_num_failed_transfers_total"] == 0
    assert moved["vllm:kvpoll_bytes_transferred_total"] == blocks * layer_block, (moved, blocks)


def test_a_hybrid_decode_with_part_of_a_prompt_cached_loads_the_rest_of_each_group_and_answers_as_aggregated(
    hybrid_dir, served
):
    # Each prompt once, then extended by 70 tokens: the decode finds the
    # first prompt's whole blocks in its prefix cache (in both groups) and
    # loads the rest from the prefill.
    urls, _, logs = served
    base = prompts(3, 19)
    longer = [q + [(3 * i + 7) % 500 + 3 for i in range(70)] for q in base]
    before = metrics(urls["fail"], "vllm:kvpoll_")
    named = 0  # the blocks a load of the whole of each longer prompt reads
    for q in base + longer:
        params = post(urls["prefill"] + "/v1/completions", completion(hybrid_dir, q, 1, {"do_remote_decode": True}))[
            "kv_transfer_params"
        ]
        if q in longer:
            named += sum(len(g) for g in params["remote_block_ids"])
            if q is longer[0]:
                base_bytes = metrics(urls["fail"], "vllm:kvpoll_")["vllm:kvpoll_bytes_transferred_total"]
        choice = answer(hybrid_dir, urls["fail"], q, MAX_TOKENS, params)["choices"][0]
        alone = post(urls["prefill"] + "/v1/completions", completion(hybrid_dir, q, MAX_TOKENS))["choices"][0]
        assert choice.get("token_ids") == alone["token_ids"], (choice, kvpoll_lines(logs, LOGS))
    after = metrics(urls["fail"], "vllm:kvpoll_")
    assert after["vllm:kvpoll_num_failed_transfers_total"] == before["vllm:kvpoll_num_failed_transfers_total"]
    assert after["vllm:kvpoll_num_transfers_total"] - before["vllm:kvpoll_num_transfers_total"] == len(base + longer)
    # The longer prompts read fewer blocks than the prefill named: their
    # first blocks were the decode's own.
    layer_block = KV_HEADS * params["remote_block_size"] * 2 * HEAD * 4
    read = after["vllm:kvpoll_bytes_transferred_total"] - base_bytes
    assert 0 < read < named * layer_block, (read, named * layer_block)


def test_a_killed_hybrid_prefill_gives_recomputed_or_failed_responses_never_other_tokens(hybrid_dir, served):
    urls, procs, logs = served
    ps = prompts(N, 17)
    reference = [
        post(urls["prefill"] + "/v1/completions", completion(hybrid_dir, q, MAX_TOKENS))["choices"][0]["token_ids"]
        for q in ps
    ]
    params = [
        post(urls["prefill"] + "/v1/completions", completion(hybrid_dir, q, 1, {"do_remote_decode": True}))[
            "kv_transfer_params"
        ]
        for q in ps
    ]
    assert all(len(x["remote_block_ids"]) == 2 for x in params), params[0]
    stop(procs["prefill"], signal.SIGKILL)
    half = N // 2
    rec = [answer(hybrid_dir, urls["recompute"], q, MAX_TOKENS, x)["choices"][0] for q, x in zip(ps[:half], params[:half])]
    failed = [answer(hybrid_dir, urls["fail"], q, MAX_TOKENS, x)["choices"][0] for q, x in zip(ps[half:], params[half:])]
    assert [c.get("token_ids") for c in rec] == reference[:half], kvpoll_lines(logs, LOGS)
    assert all(c["finish_reason"] == "error" for c in failed), (failed, kvpoll_lines(logs, LOGS))
    # Both decodes serve on: a failed load with several KV cache groups
    # does not stop vLLM's engine.
    for name in ("fail", "recompute"):
        again = answer(hybrid_dir, urls[name], ps[0], MAX_TOKENS)["choices"][0]
        assert again.get("token_ids") == reference[0], (name, again)
