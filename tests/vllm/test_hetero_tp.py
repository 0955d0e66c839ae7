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
    """A scheduler of ``tp`` ranks and one worker process per rank (started,
    not waited for)."""
    port = free_port()
    sched = scheduler(vllm_config(model, port, tp=tp, extra=extra))
    return sched, [Worker(model, port, rank=r, tp=tp, extra=extra, wait=False) for r in range(tp)]


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
    for w in pws + dws:
        w.ready()
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


def test_tp_reads_map_each_decode_rank_to_its_prefill_ranks_and_head_ranges():
    from kvpoll.vllm.worker import tp_reads

    # The same size: whole blocks of the same rank.
    assert tp_reads(1, 2, 2, 100, 100) == [(1, None, None)]
    # A larger prefill: gather each prefill rank's blocks into its share.
    assert tp_reads(0, 1, 2, 200, 100) == [(0, (0, 100), (0, 100)), (1, (100, 200), (0, 100))]
    assert tp_reads(1, 2, 4, 200, 100) == [(2, (0, 100), (0, 100)), (3, (100, 200), (0, 100))]
    # A smaller prefill: read this rank's share of each block.
    assert tp_reads(0, 2, 1, 100, 200) == [(0, (0, 100), (0, 100))]
    assert tp_reads(1, 2, 1, 100, 200) == [(0, (0, 100), (100, 200))]
    assert tp_reads(3, 4, 2, 100, 200) == [(1, (0, 100), (100, 200))]


@pytest.mark.parametrize(
    "tp, heads, block_bytes, remote, says",
    [
        (1, 2, 200, dict(tp_size=1, block_bytes=100, block_heads=2), "not the same model layout"),
        (2, 1, 100, dict(tp_size=3, block_bytes=100, block_heads=1), "one must divide the other"),
        (1, 0, 200, dict(tp_size=2, block_bytes=100, block_heads=1), "outermost on both sides"),
        (1, 2, 200, dict(tp_size=2, block_bytes=100, block_heads=0), "outermost on both sides"),
        # Four ranks of a two-head model each hold a replica of one head.
        (1, 2, 200, dict(tp_size=4, block_bytes=100, block_heads=1), "replicated"),
        (1, 2, 200, dict(tp_size=2, block_bytes=50, block_heads=1), "bytes per block"),
    ],
    ids=["same-tp-other-size", "indivisible", "local-not-head-major", "remote-not-head-major", "replicated", "head-size"],
)
def test_layouts_that_cannot_be_read_across_tp_sizes_are_refused_with_why(tp, heads, block_bytes, remote, says):
    from kvpoll.vllm.side_channel import Handshake
    from kvpoll.vllm.worker import tp_mismatch

    hs = Handshake("e", "00", 0, remote["tp_size"], remote["block_bytes"], 2, 64, b"m", remote["block_heads"])
    why = tp_mismatch(tp, heads, block_bytes, hs)
    assert why is not None and says in why, why
    ok = Handshake("e", "00", 0, 2, 100, 2, 64, b"m", 1)
    assert tp_mismatch(1, 2, 200, ok) is None


def test_a_decode_with_more_ranks_than_the_prefill_lent_to_fails_the_load_with_why():
    """A prefill that lends each rank's blocks to one reader would free
    them after the first of two decode ranks read: the decode refuses the
    load instead of racing the free."""
    from kvpoll.vllm.config import KvpollConfig
    from kvpoll.vllm.metadata import INCARNATION_KEY, READERS_KEY
    from kvpoll.vllm.scheduler import KvpollScheduler

    params = {
        "remote_engine_id": "p",
        "remote_request_id": "r",
        "remote_block_ids": [1, 2],
        "remote_host": "127.0.0.1",
        "remote_port": 5700,
        "tp_size": 1,
        INCARNATION_KEY: "ab",
    }
    decode = KvpollScheduler("d", 2, KvpollConfig())
    spec = decode._load_spec(dict(params), [5, 6])
    assert spec.error is not None and "decode_tp_size" in spec.error, spec.error
    assert decode._load_spec({**params, READERS_KEY: 2}, [5, 6]).error is None
    # The prefill's side: decode_tp_size makes its lends wait for both.
    assert KvpollConfig(decode_tp_size=2).readers_per_lend(1) == 2
    assert KvpollConfig(decode_tp_size=1).readers_per_lend(2) == 1
    assert KvpollConfig().readers_per_lend(2) == 1
    with pytest.raises(ValueError, match="decode_tp_size"):
        KvpollConfig.from_extra({"decode_tp_size": 0})
