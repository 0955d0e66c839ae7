"""Prefill and decode instances of different tensor-parallel sizes: vLLM's
Scheduler on each side, one connector worker process per rank holding
that rank's share of the KV heads (the CPU backend's layout, heads
outermost in a block), vLLM's KVOutputAggregator merging the ranks'
reports. Every decode rank's KV is checked byte for byte against what the
prefill ranks' forward wrote: the right heads in the right place."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest

from harness import (
    BLOCK_BYTES,
    LAYERS,
    Worker,
    assert_scheduler_empty,
    decode_requests,
    fill_pattern,
    free_port,
    prefill_all,
    run_until_empty,
    scheduler,
    vllm_config,
)


def instance(model: str, tp: int, extra: Dict[str, Any] | None = None):
    """A scheduler of ``tp`` ranks and one worker process per rank."""
    port = free_port()
    sched = scheduler(vllm_config(model, port, tp=tp, extra=extra))
    return sched, [Worker(model, port, rank=r, tp=tp, extra=extra) for r in range(tp)]


def logical_blocks(workers: List[Worker], blocks: List[int]) -> List[bytes]:
    """Each block as one unsharded instance would hold it: per layer, the
    ranks' shares of the heads in rank order."""
    tp = len(workers)
    share = BLOCK_BYTES // tp
    dumps = [w.dump(blocks) for w in workers]
    return [
        b"".join(dumps[r][i][layer * share : (layer + 1) * share] for layer in range(LAYERS) for r in range(tp))
        for i in range(len(blocks))
    ]


@pytest.fixture(scope="module", params=[(2, 1), (1, 2)], ids=["prefill-tp2-decode-tp1", "prefill-tp1-decode-tp2"])
def pd_tp(request, model_dir: str):
    p_tp, d_tp = request.param
    p, pws = instance(model_dir, p_tp, {"decode_tp_size": d_tp})
    d, dws = instance(model_dir, d_tp)
    yield p, pws, d, dws
    for w in pws + dws:
        w.close()


def test_decode_ranks_hold_the_prefill_ranks_heads_byte_for_byte_and_both_end_empty(pd_tp):
    p, pws, d, dws = pd_tp
    prompts = {f"h{n}": [(11 * n + i) % 500 + 3 for i in range(20 + 15 * n)] for n in range(5)}
    params = prefill_all(p, pws, prompts)
    assert set(p.requests) == set(prompts)
    decode_requests(d, params, prompts)
    local: Dict[str, List[int]] = {}
    compared: List[str] = []

    def on_recv(so, kv_out):
        for rid, spec in so.kv_connector_metadata.reqs_to_recv.items():
            local[rid] = spec.local_block_ids
        for rid in kv_out.finished_recving or ():
            prefill_id = rid[2:]
            remote = params[prefill_id]["remote_block_ids"]
            assert len(local[rid]) == len(remote) > 0
            got = logical_blocks(dws, local[rid])
            # What the prefill's forward wrote, whole: every head, every layer.
            want = [fill_pattern(prefill_id, i, BLOCK_BYTES) * LAYERS for i in range(len(remote))]
            assert got == want, f"{rid}: the decode's KV differs from the prefill's"
            assert logical_blocks(pws, remote) == want
            compared.append(rid)

    tokens = run_until_empty(p, pws, d, dws, on_recv)
    assert sorted(compared) == sorted(f"d-{r}" for r in prompts)
    assert all(len(tokens[f"d-{r}"]) == 3 for r in prompts), tokens
    assert_scheduler_empty(p)
    assert_scheduler_empty(d)
