"""A prefill and a decode whose blocks hold different numbers of tokens:
the prefill's responses name its block size; where one size divides the
other (vLLM's CPU backend, equal TP sizes, pull) the decode reads the
prefill's blocks whole, each in token order across the blocks of its
group, and reorders them in place (vLLM's CPU kernels keep keys in an
order of their own inside a block: ``kvpoll.vllm.layout``) before vLLM
sees them; elsewhere it refuses the params when it matches the request
and computes the prompt itself. The layout's reordering against vLLM's
own cache writer, the scheduler half alone, then real `vllm serve`
instances of 32- and 64-token blocks (vLLM's CPU backend takes
multiples of 32), both ways round."""

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


def _written(dtype, block_tokens: int, heads: int, head_size: int, key, value, blocks: List[int]):
    """A cache of ``block_tokens``-token blocks holding ``key``/``value``
    (one row a token) in ``blocks``, as vLLM's CPU attention writes it."""
    import torch
    from vllm import _custom_ops as ops

    from kvpoll.vllm.layout import attention_isa

    cache = torch.zeros(max(blocks) + 1, heads, block_tokens, 2 * head_size, dtype=dtype)
    kv = cache.view(cache.shape[0], heads, 2 * block_tokens, head_size)
    key_cache, value_cache = kv.chunk(2, dim=2)
    slots = torch.tensor([blocks[t // block_tokens] * block_tokens + t % block_tokens for t in range(len(key))])
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, attention_isa(dtype, block_tokens, head_size))
    return cache


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("p_block, d_block", [(32, 64), (64, 32), (16, 64), (64, 16), (16, 32)])
def test_prefill_blocks_read_whole_and_reordered_hold_what_the_decode_would_have_written(dtype_name, p_block, d_block):
    import torch

    from kvpoll.vllm.layout import attention_isa, block_plan, element_offsets, group_order, regroup

    dtype = getattr(torch, dtype_name)
    heads, head_size, tokens = 2, 64, 203
    gen = torch.Generator().manual_seed(p_block * d_block)
    key = torch.randn(tokens, heads, head_size, generator=gen).to(dtype)
    value = torch.randn(tokens, heads, head_size, generator=gen).to(dtype)
    p_ids = [9, 2, 7, 0, 3, 1, 6, 4, 12, 5, 8, 11, 10, 13][: -(-tokens // p_block)]
    d_ids = [3, 9, 1, 4, 0, 8, 2, 5, 7, 6, 12, 10, 11, 13][: -(-tokens // d_block)]
    prefill = _written(dtype, p_block, heads, head_size, key, value, p_ids)
    expected = _written(dtype, d_block, heads, head_size, key, value, d_ids)
    # What the scheduler loads: the whole prompt, or its whole prefill blocks.
    end = tokens if d_block >= p_block else tokens // p_block * p_block
    decode = torch.full_like(expected, float("nan"))
    reads, groups = block_plan(
        d_ids[: -(-end // d_block)], p_ids[: -(-end // p_block)], d_block, p_block,
        expected[0].numel() * expected.element_size(), prefill[0].numel() * prefill.element_size(),
    )
    src, dst = prefill.view(prefill.shape[0], -1).view(torch.uint8), decode.view(decode.shape[0], -1).view(torch.uint8)
    for local, remote, (l0, l1), (r0, r1) in reads:  # what the engine's part reads move
        for a, b in zip(local, remote):
            dst[a, l0:l1] = src[b, r0:r1]
    offsets = {
        size: element_offsets(dtype, size, heads, head_size, attention_isa(dtype, size, head_size))
        for size in (p_block, d_block)
    }
    regroup([decode], groups, group_order(offsets[p_block], p_block, offsets[d_block], d_block))
    for t in range(end):
        block, slot = d_ids[t // d_block], t % d_block
        at = offsets[d_block][slot].flatten()
        assert torch.equal(decode[block].flatten()[at], expected[block].flatten()[at]), f"token {t}"


@pytest.mark.parametrize(
    "block_size, computed, claimed",
    [
        (16, 0, len(PROMPT)),
        (0, 0, len(PROMPT)),
        (None, 0, len(PROMPT)),
        # Smaller prefill blocks: the whole prompt, reordered.
        (8, 0, len(PROMPT)),
        # Larger ones: their whole blocks (37 tokens: one of 32).
        (32, 0, 32),
        # A local prefix ending inside a prefill block: computed here.
        (32, 16, 0),
        # Neither divides the other; one over 8 times the other.
        (24, 0, 0),
        (256, 0, 0),
    ],
)
def test_params_of_another_block_size_claim_what_the_decode_can_reorder(model_dir, block_size, computed, claimed):
    # The decode's blocks hold 16 tokens; 0 and null are what params that
    # do not name a block size (kvpoll's earlier ones) amount to.
    d = scheduler(vllm_config(model_dir, free_port()))
    r = request("d-0", PROMPT, 3, {**_params([[4, 5, 6]]), "remote_block_size": block_size})
    assert d.connector.get_num_new_matched_tokens(r, computed) == (claimed, claimed > 0)


def test_params_of_another_block_size_into_a_quantized_kv_cache_claim_no_tokens(model_dir):
    # An fp8 cache's bytes are not the model dtype's the reordering is
    # derived in: refused at the match rather than failed at the handshake.
    config = vllm_config(model_dir, free_port())
    config.cache_config.cache_dtype = "fp8"
    d = scheduler(config)
    r = request("d-0", PROMPT, 3, {**_params([[4, 5, 6]]), "remote_block_size": 32})
    assert d.connector.get_num_new_matched_tokens(r, 0) == (0, False)
    same = request("d-1", PROMPT, 3, {**_params([[4, 5, 6]]), "remote_block_size": 16})
    assert d.connector.get_num_new_matched_tokens(same, 0) == (len(PROMPT), True)


def test_params_of_another_block_size_in_push_mode_claim_no_tokens(model_dir):
    d = scheduler(vllm_config(model_dir, free_port()))
    r = request("d-0", PROMPT, 3, {**_params([[4, 5, 6]]), "remote_block_size": 32, "kvpoll_mode": "push"})
    assert d.connector.get_num_new_matched_tokens(r, 0) == (0, False)


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
            model_dir,
            port,
            kv_config(free_port(), "fail"),
            str(logs / f"{size}.log"),
            # Without a prefix cache each answer below is computed or
            # loaded afresh, never taken from the one before.
            args=["--block-size", str(size), "--no-enable-prefix-caching"],
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
def test_a_decode_of_another_block_size_loads_the_prompt_and_answers_as_aggregated_under_policy_fail(
    model_dir, served, p_block, d_block
):
    urls, logs = served
    p, d = urls[p_block], urls[d_block]
    before = loads(d)
    loaded = 0
    for n in range(4):
        prompt = [(d_block + 11 * n + 3 * i) % 500 + 3 for i in range(9 + 53 * n)]
        # Larger prefill blocks: only whole ones are loaded, the rest computed.
        loaded += (len(prompt) if d_block >= p_block else len(prompt) // p_block) > 0
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
        assert dis["token_ids"] == alone["token_ids"], (n, kvpoll_lines(logs, LOGS))
    after = loads(d)
    # Every load that had whole blocks to read read them; none failed.
    assert after["vllm:kvpoll_num_transfers_total"] - before["vllm:kvpoll_num_transfers_total"] == loaded, (
        kvpoll_lines(logs, LOGS)
    )
    assert after["vllm:kvpoll_num_failed_transfers_total"] == before["vllm:kvpoll_num_failed_transfers_total"]


@pytest.mark.parametrize("p_block, d_block", [(32, 64), (64, 32)])
def test_a_killed_prefill_of_other_block_size_gives_recomputed_or_failed_responses_never_other_tokens(
    model_dir, p_block, d_block
):
    from instance import Instance, killed_prefill_drill

    # Each prompt holds a whole prefill block at least: each one loads.
    prompts = [[(7 * n + 3 * i) % 500 + 3 for i in range(70 + 29 * n)] for n in range(6)]
    fast = dict(read_deadline_s=5.0, handshake_timeout_s=2.0)
    agg = Instance(model_dir, block_size=d_block)
    p = Instance(model_dir, kv_config(free_port(), lease_s=60.0), block_size=p_block)
    d_fail = Instance(model_dir, kv_config(free_port(), "fail", **fast), block_size=d_block)
    d_rec = Instance(model_dir, kv_config(free_port(), "recompute", **fast), block_size=d_block)
    made = [agg, p, d_fail, d_rec]
    try:
        for i in made:
            i.ready()
        reference = [o["token_ids"] for o in agg.generate(prompts, MAX_TOKENS)]
        killed_prefill_drill(p, d_fail, d_rec, prompts, reference, MAX_TOKENS)
    finally:
        for i in made:
            i.close()
