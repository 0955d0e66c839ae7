"""A prefill and a decode whose blocks hold different numbers of tokens:
kvpoll moves whole blocks, so the decode refuses such params when it
matches the request (the prefill's responses name its block size) and
computes the prompt itself: the answer is the aggregated one, never an
error, whatever the failure policy. The scheduler half alone, then real
`vllm serve` instances of 32- and 64-token blocks (vLLM's CPU backend
takes multiples of 32), both ways round."""

from __future__ import annotations

import urllib.error
from typing import Any, Dict, List

import pytest

from harness import free_port, request, scheduler, vllm_config
from instance import kv_config
from serving import healthy, post, server, stop
from test_router import loads
from test_serve import kvpoll_lines
from test_transfer_params import PROMPT, _params, finished_prefill

MAX_TOKENS = 8
SIZES = (32, 64)
LOGS = tuple(f"{size}.log" for size in SIZES)


def test_a_prefill_names_the_tokens_its_blocks_hold(model_dir):
    params = finished_prefill(model_dir, [4, 5, 6], {"do_remote_decode": True})
    assert params["remote_block_size"] == 16  # the harness's block size


@pytest.mark.parametrize(
    "block_size, claimed", [(16, len(PROMPT)), (32, 0), (8, 0), (0, len(PROMPT)), (None, len(PROMPT))]
)
def test_params_of_another_block_size_claim_no_tokens_and_of_the_same_or_unnamed_one_do(
    model_dir, block_size, claimed
):
    # The decode's blocks hold 16 tokens; 0 and null are what params that
    # do not name a block size (kvpoll's earlier ones) amount to.
    d = scheduler(vllm_config(model_dir, free_port()))
    r = request("d-0", PROMPT, 3, {**_params([[4, 5, 6]]), "remote_block_size": block_size})
    assert d.connector.get_num_new_matched_tokens(r, 0) == (claimed, claimed > 0)


@pytest.mark.parametrize("block_size", [-16, "16", 16.0, True])
def test_a_block_size_that_is_no_count_of_tokens_is_refused_at_the_match_with_a_typed_error(model_dir, block_size):
    from kvpoll.vllm.metadata import RemotePrefill, TransferParamsError

    params = {**_params([[4, 5, 6]]), "remote_block_size": block_size}
    with pytest.raises(TransferParamsError, match="remote_block_size"):
        RemotePrefill.from_params(params)
    d = scheduler(vllm_config(model_dir, free_port()))
    assert d.connector.get_num_new_matched_tokens(request("d-0", PROMPT, 3, params), 0) == (0, False)


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    """``{block size: URL}`` of a `vllm serve` of each block size (policy
    fail), and the logs folder."""
    logs = tmp_path_factory.mktemp("block-sizes")
    ports = {size: free_port() for size in SIZES}
    procs = [
        server(
            model_dir, port, kv_config(free_port(), "fail"), str(logs / f"{size}.log"), args=["--block-size", str(size)]
        )
        for size, port in ports.items()
    ]
    try:
        for size, proc in zip(SIZES, procs):
            healthy(f"http://127.0.0.1:{ports[size]}", proc)
        yield {size: f"http://127.0.0.1:{port}" for size, port in ports.items()}, logs
    finally:
        for proc in procs:
            stop(proc)


def completion(model_dir: str, prompt: List[int], max_tokens: int, params: Any = None) -> Dict[str, Any]:
    body = {"model": model_dir, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    return dict(body, return_token_ids=True, **({"kv_transfer_params": params} if params else {}))


@pytest.mark.parametrize("p_block, d_block", [(32, 64), (64, 32)])
def test_a_decode_of_another_block_size_computes_the_prompt_itself_and_answers_as_aggregated_under_policy_fail(
    model_dir, served, p_block, d_block
):
    urls, logs = served
    p, d = urls[p_block], urls[d_block]
    before = loads(d)
    for n in range(4):
        prompt = [(d_block + 11 * n + 3 * i) % 500 + 3 for i in range(9 + 37 * n)]
        params = post(p + "/v1/completions", completion(model_dir, prompt, 1, {"do_remote_decode": True}))[
            "kv_transfer_params"
        ]
        try:
            dis = post(d + "/v1/completions", completion(model_dir, prompt, MAX_TOKENS, params))["choices"][0]
        except urllib.error.HTTPError as e:
            pytest.fail(f"HTTP {e.code} {e.read()[-300:]!r}\n{kvpoll_lines(logs, LOGS)}")
        assert dis["finish_reason"] == "length", (dis, kvpoll_lines(logs, LOGS))
        assert params["remote_block_size"] == p_block, params
        alone = post(d + "/v1/completions", completion(model_dir, prompt, MAX_TOKENS))["choices"][0]
        assert dis["token_ids"] == alone["token_ids"]
    after = loads(d)
    # Nothing was read, nothing failed.
    assert after["vllm:kvpoll_num_transfers_total"] == before["vllm:kvpoll_num_transfers_total"]
    assert after["vllm:kvpoll_num_failed_transfers_total"] == before["vllm:kvpoll_num_failed_transfers_total"]
