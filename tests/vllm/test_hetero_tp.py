"""Prefill and decode instances of different tensor-parallel sizes: vLLM's
Scheduler on each side, one connector worker process per rank holding
that rank's share of the KV heads (the CPU backend's layout, heads
outermost in a block), vLLM's KVOutputAggregator merging the ranks'
reports. Every decode rank's KV is checked byte for byte against what the
prefill ranks' forward wrote: the right heads in the right place."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pytest

from harness import (
    BLOCK_BYTES,
    LAYERS,
    assert_scheduler_empty,
    decode_requests,
    fill_pattern,
    logical_blocks,
    prefill_all,
    run_until_empty,
)


#: Each prefill kind's lease: long enough for a loaded machine to read in
#: time, short enough that an unread lend ends within a test.
LEASE_S = 10.0


def prefill_kind(tp: int, decode_tp: int, mode: str = "pull") -> Tuple[int, Dict[str, Any]]:
    return tp, {"decode_tp_size": decode_tp, "mode": mode, "lease_s": LEASE_S}


def decode_kind(tp: int) -> Tuple[int, Dict[str, Any]]:
    return tp, {}


@pytest.fixture(params=[(2, 1), (1, 2)], ids=["prefill-tp2-decode-tp1", "prefill-tp1-decode-tp2"])
def pd_tp(request, pool):
    p_tp, d_tp = request.param
    (p, pws), (d, dws) = pool.get(prefill_kind(p_tp, d_tp), decode_kind(d_tp))
    return p, pws, d, dws


def disaggregate_and_check(p, pws, d, dws, prompts: Dict[str, List[int]]) -> Tuple[Dict[str, Any], List[Any]]:
    """Prefills ``prompts``, decodes them with the prefill's params, checks
    each decode request's KV (across the decode's ranks) equals what the
    prefill's forward wrote (across its ranks), every head in its place,
    and that both schedulers end empty. Returns the params and each
    step's aggregated connector stats of the decode."""
    params = prefill_all(p, pws, prompts)
    assert set(p.requests) == set(prompts)
    decode_requests(d, params, prompts)
    local: Dict[str, List[int]] = {}
    compared: List[str] = []
    stats: List[Any] = []

    def on_recv(so, kv_out):
        if kv_out.kv_connector_stats is not None:
            stats.append(kv_out.kv_connector_stats)
        for rid, spec in so.kv_connector_metadata.reqs_to_recv.items():
            local[rid] = spec.local_block_ids
        for rid in kv_out.finished_recving or ():
            prefill_id = rid[2:]
            remote = params[prefill_id]["remote_block_ids"][0]
            assert len(local[rid]) == len(remote) > 0
            # What the prefill's forward wrote, whole: every head, every layer.
            want = [fill_pattern(prefill_id, i, BLOCK_BYTES) * LAYERS for i in range(len(remote))]
            assert logical_blocks(dws, local[rid]) == want, f"{rid}: the decode's KV differs from the prefill's"
            assert logical_blocks(pws, remote) == want
            compared.append(rid)

    tokens = run_until_empty(p, pws, d, dws, on_recv)
    assert sorted(compared) == sorted(f"d-{r}" for r in prompts)
    assert all(len(tokens[f"d-{r}"]) == 3 for r in prompts), tokens
    assert_scheduler_empty(p)
    assert_scheduler_empty(d)
    return params, stats


def test_decode_ranks_hold_the_prefill_ranks_heads_byte_for_byte_and_both_end_empty(pd_tp):
    p, pws, d, dws = pd_tp
    prompts = {f"h{n}": [(11 * n + i) % 500 + 3 for i in range(20 + 15 * n)] for n in range(5)}
    params, stats = disaggregate_and_check(p, pws, d, dws, prompts)
    # The ranks' stats, merged by vLLM's aggregator, through its Prometheus
    # logger: one load per decode rank and request, every byte of every
    # head of every layer once.
    blocks = sum(len(params[r]["remote_block_ids"][0]) for r in prompts)
    metrics = prometheus_after(d.vllm_config, stats)
    assert metrics["vllm:kvpoll_num_transfers_total"] == len(prompts) * len(dws)
    assert metrics["vllm:kvpoll_num_failed_transfers_total"] == 0
    assert metrics["vllm:kvpoll_bytes_transferred_total"] == blocks * BLOCK_BYTES * LAYERS
    assert metrics["vllm:kvpoll_xfer_time_seconds_count"] == len(prompts) * len(dws)


def prometheus_after(vllm_config: Any, stats: List[Any]) -> Dict[str, float]:
    """vLLM's Prometheus logger fed with each step's connector stats as the
    scheduler sends them: the kvpoll samples of its registry, by name."""
    from prometheus_client import REGISTRY
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.stats import SchedulerStats

    logger = PrometheusStatLogger(vllm_config, engine_indexes=[0])
    for st in stats:
        logger.record(scheduler_stats=SchedulerStats(kv_connector_stats=st.to_dict()), iteration_stats=None)
    return {
        sample.name: sample.value
        for metric in REGISTRY.collect()
        if metric.name.startswith("vllm:kvpoll")
        for sample in metric.samples
        if not sample.name.endswith("_created") and "le" not in sample.labels
    }


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


def test_decode_tp_size_sets_how_many_decode_ranks_each_lend_waits_for():
    from kvpoll.vllm.config import KvpollConfig

    assert KvpollConfig(decode_tp_size=2).readers_per_lend(1) == 2
    assert KvpollConfig(decode_tp_size=4).readers_per_lend(2) == 2
    assert KvpollConfig(decode_tp_size=1).readers_per_lend(2) == 1
    assert KvpollConfig().readers_per_lend(2) == 1
    for bad in (0, -1, True, "2"):
        with pytest.raises(ValueError, match="decode_tp_size"):
            KvpollConfig.from_extra({"decode_tp_size": bad})


@pytest.mark.parametrize("blocks", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("ranks", [2, 4])
def test_prefill_ranks_holding_the_same_kv_share_a_read_each_in_a_run_of_its_lend(blocks, ranks):
    # MLA, prefill TP = ranks x decode TP: each prefill rank lends every
    # block, and confirms a read of a run of them only (in the order
    # lent); the shares cover the read once.
    from kvpoll.vllm.worker import replicated_shares

    remote = [10 + 3 * i for i in range(blocks)]
    local = [100 + i for i in range(blocks)]
    shares = replicated_shares(local, remote, ranks)
    assert len(shares) == ranks
    assert [b for _, rb in shares for b in rb] == remote
    assert [b for lb, _ in shares for b in lb] == local
    for lb, rb in shares:
        assert len(lb) == len(rb)
        if rb:
            at = remote.index(rb[0])
            assert remote[at : at + len(rb)] == rb, (rb, remote)
