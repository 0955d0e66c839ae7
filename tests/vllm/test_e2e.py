"""End to end on real vLLM engines (CPU backend): a prefill instance and a
decode instance with KvpollConnector, driven as vLLM's disaggregated
proxy drives them (the prefill's kv_transfer_params passed to the
decode), against one aggregated instance. Greedy sampling on a
deterministic model: the disaggregated output must be token for token
the aggregated one's; under faults, each response is either that or an
error (per the failure policy), never other tokens."""

from __future__ import annotations

import signal
import time

import pytest

from harness import free_port
from instance import Instance, decoded_as_aggregated, killed_prefill_drill, kv_config

N = 24
MAX_TOKENS = 8


def prompts():
    return [[(11 * n + 3 * i) % 500 + 3 for i in range(9 + 7 * n)] for n in range(N)]


@pytest.fixture(scope="module")
def reference(model_dir):
    agg = Instance(model_dir).ready()
    try:
        return [o["token_ids"] for o in agg.generate(prompts(), MAX_TOKENS)]
    finally:
        agg.close()


@pytest.fixture(scope="module")
def instances(model_dir, reference):
    """(prefill, decode with policy fail, decode with policy recompute)."""
    p = Instance(model_dir, kv_config(free_port(), lease_s=8.0))
    d_fail = Instance(model_dir, kv_config(free_port(), "fail", read_deadline_s=3.0, handshake_timeout_s=2.0))
    d_rec = Instance(model_dir, kv_config(free_port(), "recompute", read_deadline_s=3.0, handshake_timeout_s=2.0))
    made = [p, d_fail, d_rec]
    try:
        for i in made:
            i.ready()
        yield p, d_fail, d_rec
    finally:
        for i in made:
            i.close()


def prefill(p: Instance, ps):
    outs = p.generate(ps, 1, [{"do_remote_decode": True} for _ in ps])
    params = [o["kv_transfer_params"] for o in outs]
    assert all(x and x["do_remote_prefill"] and x["remote_block_ids"][0] for x in params), params[:2]
    return params


def test_disaggregated_output_is_token_for_token_the_aggregated_output(instances, reference):
    p, d_fail, _ = instances
    ps = prompts()
    decoded_as_aggregated(d_fail, ps, prefill(p, ps), reference, MAX_TOKENS)


def test_a_decode_handed_another_requests_blocks_under_a_live_lend_fails_the_load_never_other_tokens(
    instances, reference
):
    # A proxy or router mix-up: the params of prompt 0's lend with the
    # block ids of prompt 1's lend (both live, one block each). The token
    # is right, the blocks are not the lend's: the prefill refuses the
    # read, and the policy applies; never prompt 1's KV under prompt 0.
    p, d_fail, d_rec = instances
    ps = prompts()
    params = prefill(p, [ps[0], ps[1], ps[0], ps[1]])
    assert len(params[0]["remote_block_ids"][0]) == len(params[1]["remote_block_ids"][0])
    mixed = [{**params[i], "remote_block_ids": params[i + 1]["remote_block_ids"]} for i in (0, 2)]
    (failed,) = d_fail.generate([ps[0]], MAX_TOKENS, [mixed[0]])
    assert failed["finish_reason"] == "error", failed
    (recomputed,) = d_rec.generate([ps[0]], MAX_TOKENS, [mixed[1]])
    assert recomputed["token_ids"] == reference[0]


@pytest.fixture(scope="module")
def other_prefills(model_dir, instances):
    """A prefill of two tensor-parallel ranks (the decodes have one) and a
    prefill in push mode, started together."""
    made = [
        Instance(model_dir, kv_config(free_port(), lease_s=20.0), tp=2),
        Instance(model_dir, kv_config(free_port(), lease_s=20.0, mode="push")),
    ]
    try:
        for i in made:
            i.ready()
        yield made
    finally:
        for i in made:
            i.close()


def test_a_two_rank_prefill_read_by_a_one_rank_decode_gives_the_aggregated_output(other_prefills, instances, reference):
    tp2, _ = other_prefills
    _, d_fail, _ = instances
    ps = prompts()
    params = prefill(tp2, ps)
    assert all(x["tp_size"] == 2 for x in params)
    decoded_as_aggregated(d_fail, ps, params, reference, MAX_TOKENS)


def test_a_push_mode_prefill_gives_the_aggregated_output(other_prefills, instances, reference):
    _, push = other_prefills
    _, d_fail, _ = instances
    ps = prompts()
    params = prefill(push, ps)
    assert all(x["kvpoll_mode"] == "push" for x in params)
    decoded_as_aggregated(d_fail, ps, params, reference, MAX_TOKENS)


def test_a_prefill_paused_past_its_lease_gives_recomputed_or_failed_responses_never_other_tokens(instances, reference):
    p, d_fail, d_rec = instances
    ps = prompts()
    params = prefill(p, ps)
    half = N // 2
    p.signal(signal.SIGSTOP)
    try:
        rec = d_rec.generate(ps[:half], MAX_TOKENS, params[:half])
        failed = d_fail.generate(ps[half:], MAX_TOKENS, params[half:])
        time.sleep(9.0)  # past the prefill's 8 s lease
    finally:
        p.signal(signal.SIGCONT)
    assert [o["token_ids"] for o in rec] == reference[:half]
    for o, ref in zip(failed, reference[half:]):
        assert o["token_ids"] == ref or o["finish_reason"] == "error", o
    assert any(o["finish_reason"] == "error" for o in failed)
    # The prefill serves again after it resumed.
    again = prefill(p, ps[:2])
    assert [o["token_ids"] for o in d_fail.generate(ps[:2], MAX_TOKENS, again)] == reference[:2]


def test_a_killed_prefill_gives_recomputed_or_failed_responses_never_other_tokens(instances, reference):
    p, d_fail, d_rec = instances
    killed_prefill_drill(p, d_fail, d_rec, prompts(), reference, MAX_TOKENS)


def test_a_killed_two_rank_prefill_gives_recomputed_or_failed_responses_never_other_tokens(
    other_prefills, instances, reference
):
    # Each decode rank reads its share from both prefill ranks, which die
    # together: the loads end at the handshake or the read, never with
    # half of the heads.
    tp2, _ = other_prefills
    _, d_fail, d_rec = instances
    killed_prefill_drill(tp2, d_fail, d_rec, prompts(), reference, MAX_TOKENS)
