"""A decode of two tensor-parallel ranks reading a prefill of one, on
real vLLM engines (CPU backend): each decode rank reads its share of the
heads of every block from the one prefill rank, whose lends wait for
both readers; the decode's tokens are the aggregated instance's, and
under a killed prefill each is the aggregated one (policy recompute) or
an error (policy fail)."""

from __future__ import annotations

import pytest

from harness import free_port
from instance import Instance, decoded_as_aggregated, killed_prefill_drill, kv_config

N = 6
MAX_TOKENS = 8


def prompts():
    return [[(13 * n + 5 * i) % 500 + 3 for i in range(11 + 9 * n)] for n in range(N)]


@pytest.fixture(scope="module")
def reference(model_dir):
    agg = Instance(model_dir).ready()
    try:
        return [o["token_ids"] for o in agg.generate(prompts(), MAX_TOKENS)]
    finally:
        agg.close()


@pytest.fixture(scope="module")
def instances(model_dir, reference):
    """(prefill of one rank, two-rank decode with policy fail, two-rank
    decode with policy recompute)."""
    fast = dict(read_deadline_s=20.0, handshake_timeout_s=5.0)
    made = [
        Instance(model_dir, kv_config(free_port(), lease_s=60.0, decode_tp_size=2)),
        Instance(model_dir, kv_config(free_port(), "fail", **fast), tp=2),
        Instance(model_dir, kv_config(free_port(), "recompute", **fast), tp=2),
    ]
    try:
        for i in made:
            i.ready()
        yield made
    finally:
        for i in made:
            i.close()


def test_a_two_rank_decode_reading_a_one_rank_prefill_gives_the_aggregated_output(instances, reference):
    p, d, _ = instances
    ps = prompts()
    params = [o["kv_transfer_params"] for o in p.generate(ps, 1, [{"do_remote_decode": True}] * N)]
    assert all(x["kvpoll_readers"] == 2 for x in params), params[0]
    decoded_as_aggregated(d, ps, params, reference, MAX_TOKENS)


def test_a_killed_prefill_read_by_a_two_rank_decode_gives_recomputed_or_failed_responses_never_other_tokens(
    instances, reference
):
    # Each decode rank reads its own heads: vLLM's aggregator merges the
    # two ranks' reports into one outcome a request, so a request whose
    # load failed on either rank is recomputed or failed whole.
    p, d_fail, d_rec = instances
    killed_prefill_drill(p, d_fail, d_rec, prompts(), reference, MAX_TOKENS)
