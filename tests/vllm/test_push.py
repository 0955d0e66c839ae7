"""Push mode on vLLM's Scheduler: the decode lends its allocated blocks to
the prefill ranks as writers and asks each (over the side channel) to
write its share; the prefill writes once every decode rank asked, and
frees its blocks when the write is acknowledged or, unasked, when its
lease ends. The decode's KV is checked byte for byte against what the
prefill's forward wrote, for the same and for different TP sizes, and
both schedulers end with every block free."""

from __future__ import annotations

import time
from typing import List

import pytest

from harness import assert_scheduler_empty, decode_requests, prefill_all, run_until_empty, step
from test_hetero_tp import LEASE_S, decode_kind, disaggregate_and_check, prefill_kind


@pytest.fixture(
    params=[(1, 1), (2, 1), (1, 2)],
    ids=["push-tp1-tp1", "push-prefill-tp2-decode-tp1", "push-prefill-tp1-decode-tp2"],
)
def pd_push(request, pool):
    p_tp, d_tp = request.param
    (p, pws), (d, dws) = pool.get(prefill_kind(p_tp, d_tp, "push"), decode_kind(d_tp))
    return p, pws, d, dws


def test_pushed_kv_equals_the_prefill_kv_byte_for_byte_and_both_end_empty(pd_push):
    p, pws, d, dws = pd_push
    prompts = {f"u{n}": [(13 * n + i) % 500 + 3 for i in range(18 + 14 * n)] for n in range(5)}
    params, _ = disaggregate_and_check(p, pws, d, dws, prompts)
    assert all(prm["kvpoll_mode"] == "push" for prm in params.values())


def test_a_push_nobody_asks_for_frees_the_prefill_blocks_when_its_lease_ends(pool):
    ((pp, ppw),) = pool.get(prefill_kind(1, 1, "push"))
    prompts = {"x0": list(range(3, 40)), "x1": list(range(5, 60))}
    prefill_all(pp, ppw, prompts)
    assert set(pp.requests) == set(prompts)  # held for their decode
    end = time.monotonic() + 3 * LEASE_S
    while pp.requests and time.monotonic() < end:
        step(pp, ppw)
        time.sleep(0.05)
    step(pp, ppw)
    assert_scheduler_empty(pp)


def test_a_push_request_the_prefill_refuses_fails_the_load_and_the_decode_recomputes(pool):
    # The decode is told to ask for a push from a prefill that lends to
    # readers (as a misconfigured proxy or a version mix would): refused,
    # so the decode's lend to writers ends and the load fails; vLLM
    # recomputes the prompt; the prefill's unread lend ends at its lease.
    (pl, plw), (d, dw) = pool.get(prefill_kind(2, 1), decode_kind(1))
    prompts = {"y0": list(range(7, 50))}
    params = prefill_all(pl, plw, prompts)
    params = {rid: {**prm, "kvpoll_mode": "push"} for rid, prm in params.items()}
    decode_requests(d, params, prompts)
    failed: List[str] = []

    def on_recv(so, kv_out):
        failed.extend(kv_out.invalid_block_ids or ())

    tokens = run_until_empty(pl, plw, d, dw, on_recv)
    assert failed, "the load did not fail"
    assert len(tokens["d-y0"]) == 3  # recomputed, then decoded
    assert_scheduler_empty(pl)
    assert_scheduler_empty(d)
