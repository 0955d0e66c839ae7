"""A decode of two tensor-parallel ranks reading a prefill of one, on
real vLLM engines (CPU backend): each decode rank reads its share of the
heads of every block from the one prefill rank, whose lends wait for
both readers; the decode's tokens are the aggregated instance's."""

from __future__ import annotations

from harness import free_port
from instance import Instance, kv_config

N = 6
MAX_TOKENS = 8


def test_a_two_rank_decode_reading_a_one_rank_prefill_gives_the_aggregated_output(model_dir):
    ps = [[(13 * n + 5 * i) % 500 + 3 for i in range(11 + 9 * n)] for n in range(N)]
    agg = Instance(model_dir).ready()
    try:
        reference = [o["token_ids"] for o in agg.generate(ps, MAX_TOKENS)]
    finally:
        agg.close()
    p = Instance(model_dir, kv_config(free_port(), lease_s=60.0, decode_tp_size=2))
    d = Instance(model_dir, kv_config(free_port(), "fail", read_deadline_s=20.0, handshake_timeout_s=5.0), tp=2)
    try:
        p.ready()
        d.ready()
        params = [o["kv_transfer_params"] for o in p.generate(ps, 1, [{"do_remote_decode": True}] * N)]
        assert all(x["kvpoll_readers"] == 2 for x in params), params[0]
        # Policy fail: a load that did not happen is an error.
        outs = d.generate(ps, MAX_TOKENS, params)
        assert [o["finish_reason"] for o in outs] == ["length"] * N
        assert [o["token_ids"] for o in outs] == reference
    finally:
        p.close()
        d.close()
