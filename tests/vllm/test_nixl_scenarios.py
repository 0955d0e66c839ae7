"""The scenarios of vLLM's NIXL connector unit tests
(tests/v1/kv_connector/unit/test_nixl_connector.py), ported to
KvpollConnector: real schedulers, a real prefill worker in its own
process, the decode worker in this one, real UCX. Each test names the
scenario it ports."""

from __future__ import annotations

import time
from typing import Any, Dict, Set, Tuple

import pytest

from harness import (
    BLOCK,
    BLOCK_BYTES,
    NUM_BLOCKS,
    Worker,
    assert_scheduler_empty,
    fill_pattern,
    free_port,
    request,
    scheduler,
    step,
    vllm_config,
    worker_connector,
)

from kvpoll import draw_incarnation
from kvpoll.vllm import INCARNATION_KEY, KvpollConnector, KvpollStats
from kvpoll.vllm.metadata import READERS_KEY, KvpollConnectorMetadata, LoadSpec, RemotePrefill

GUARD_S = 60.0


@pytest.fixture(scope="module")
def prefill(model_dir: str):
    """A prefill worker in its own process, and its port."""
    port = free_port()
    w = Worker(model_dir, port)
    yield w, port
    w.close()


@pytest.fixture(scope="module")
def decode(model_dir: str):
    conn, caches = worker_connector(model_dir, free_port())
    yield conn, caches
    conn.shutdown()


def lend(prefill_worker: Worker, req_id: str, blocks, fill: bool = True) -> int:
    """Has the prefill worker lend ``blocks`` of ``req_id`` (written first
    with the request's pattern), as the step after its request_finished."""
    inc = draw_incarnation()
    meta = KvpollConnectorMetadata(reqs_to_send={req_id: (list(blocks), inc)})
    prefill_worker.step(meta, {req_id}, {req_id: list(enumerate(blocks))} if fill else {})
    return inc


def load_spec(port: int, req_id: str, local, remote, inc: int, tp_size: int = 1) -> LoadSpec:
    return LoadSpec(
        list(local),
        RemotePrefill(f"engine-{port}", req_id, "127.0.0.1", port, tp_size, tuple(remote), inc),
    )


def run_decode(conn: KvpollConnector, meta: KvpollConnectorMetadata, want: Set[str]) -> Tuple[Set[str], Set[int]]:
    """Binds ``meta`` for one step, then steps with empty metadata until
    every id in ``want`` was reported; returns (recving, load errors)."""
    seen: Set[str] = set()
    twice: Set[str] = set()
    errors: Set[int] = set()
    conn.bind_connector_metadata(meta)
    start = time.monotonic()
    conn.start_load_kv(None)
    # start_load_kv must not wait for the transfers (NIXL's async-load test).
    assert time.monotonic() - start < 10
    end = time.monotonic() + GUARD_S
    while not want <= seen and time.monotonic() < end:
        _, recving = conn.get_finished(set())
        twice |= seen & (recving or set())
        seen |= recving or set()
        errors |= conn.get_block_ids_with_load_errors()
        conn.bind_connector_metadata(KvpollConnectorMetadata())
        conn.start_load_kv(None)
        time.sleep(0.005)
    assert not twice, f"reported twice: {twice}"
    return seen, errors


# ------------------------------------------------------------ scheduler only


def remote_params(req_id: str, blocks, tp_size: int = 1, inc: str = "1f"):
    """The kv_transfer_params of a prefill's response, as a proxy passes them."""
    return {
        "do_remote_prefill": True,
        "remote_engine_id": "e",
        "remote_request_id": req_id,
        "remote_block_ids": list(blocks),
        "remote_host": "127.0.0.1",
        "remote_port": 1234,
        "tp_size": tp_size,
        INCARNATION_KEY: inc,
    }


def test_basic_interface_a_remote_prefill_loads_into_the_blocks_the_scheduler_allocated(model_dir):
    s = scheduler(vllm_config(model_dir, free_port()))
    r = request("id-1", list(range(3, 3 + int(BLOCK * 2.5))), 4, remote_params("p-1", [0, 1, 2]))
    s.add_request(r)
    so = s.schedule()
    meta = so.kv_connector_metadata
    assert isinstance(meta, KvpollConnectorMetadata)
    assert list(meta.reqs_to_recv) == ["id-1"]
    spec = meta.reqs_to_recv["id-1"]
    assert spec.error is None and spec.remote.incarnation == 0x1F
    held = s.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks["id-1"]
    assert spec.local_block_ids == [b.block_id for b in held]
    assert not so.scheduled_new_reqs  # waits for the load


def test_prompt_less_than_block_size_is_still_loaded_asynchronously(model_dir):
    s = scheduler(vllm_config(model_dir, free_port()))
    s.add_request(request("id-2", list(range(3, 3 + BLOCK // 2)), 4, remote_params("p-2", [5])))
    so = s.schedule()
    assert list(so.kv_connector_metadata.reqs_to_recv) == ["id-2"]
    assert len(so.kv_connector_metadata.reqs_to_recv["id-2"].local_block_ids) == 1
    assert not so.scheduled_new_reqs


def test_aborted_prefill_lends_nothing_and_frees_its_blocks_at_once(model_dir, prefill):
    pw, port = prefill
    p = scheduler(vllm_config(model_dir, port))
    p.add_request(request("ab-1", list(range(3, 40)), 1, {"do_remote_decode": True}))
    so = p.schedule()
    from vllm.v1.request import RequestStatus

    p.finish_requests("ab-1", RequestStatus.FINISHED_ABORTED)
    so = p.schedule()
    assert not so.kv_connector_metadata.reqs_to_send
    pw.step(so.kv_connector_metadata, so.finished_req_ids, {})
    assert_scheduler_empty(p)


def test_a_lend_the_engine_refuses_frees_its_blocks_in_the_same_step(prefill):
    # Blocks beyond the cache: the engine refuses the lend; vLLM must
    # still hear the request in finished_sending, or its blocks leak.
    pw, _ = prefill
    bad = KvpollConnectorMetadata(reqs_to_send={"unlendable": ([NUM_BLOCKS + 5], draw_incarnation())})
    out = pw.step(bad, {"unlendable"}, {})
    assert out.finished_sending == {"unlendable"}
    assert pw.step(KvpollConnectorMetadata(), set(), {}).finished_sending is None


def test_abort_timeout_on_prefiller_frees_blocks_when_the_lease_ends(model_dir):
    # The prefill's response never reaches a decode: its lent blocks are
    # freed by the lease (2 s here), never before.
    port = free_port()
    p = scheduler(vllm_config(model_dir, port, lease_s=2.0))
    pw = Worker(model_dir, port, lease_s=2.0)
    try:
        p.add_request(request("orphan", list(range(3, 60)), 1, {"do_remote_decode": True}))
        freed_at = None
        start = time.monotonic()
        end = start + GUARD_S
        while p.requests and time.monotonic() < end:
            _, kv_out, _ = step(p, pw, fill=True)
            if kv_out.finished_sending:
                freed_at = time.monotonic()
            time.sleep(0.02)
        step(p, pw)
        assert freed_at is not None and freed_at - start >= 2.0
        assert_scheduler_empty(p)
    finally:
        pw.close()


# ------------------------------------------------------------ worker


def test_async_load_kv_homogeneous_tp(prefill, decode):
    pw, port = prefill
    conn, caches = decode
    inc = lend(pw, "al-1", [4, 5, 6])
    seen, errors = run_decode(conn, KvpollConnectorMetadata(reqs_to_recv={"d-al-1": load_spec(port, "al-1", [1, 2, 3], [4, 5, 6], inc)}), {"d-al-1"})
    assert seen == {"d-al-1"} and not errors
    for i, b in enumerate([1, 2, 3]):
        for t in caches.values():
            assert t[b].numpy().tobytes() == fill_pattern("al-1", i, BLOCK_BYTES)


@pytest.mark.parametrize("decode_tp, prefill_tp", [(2, 1), (4, 2), (1, 2)])
def test_async_load_kv_heterogeneous_tp_is_scheduled_when_the_prefill_lends_to_every_reading_rank(
    model_dir, decode_tp, prefill_tp
):
    # The transfers themselves: test_hetero_tp.py. Here the scheduler
    # accepts a load from a prefill of another TP size that lent each
    # rank's blocks to as many decode ranks as read them, and refuses one
    # that lent to fewer at the match, never a read racing a free: no
    # tokens claimed (the prompt is computed here), and the prefill told
    # to release its blocks.
    readers = max(1, decode_tp // prefill_tp)
    cfg = vllm_config(model_dir, free_port(), tp=decode_tp)
    s = scheduler(cfg)
    ok = {**remote_params("p-h", [0, 1], prefill_tp), READERS_KEY: readers}
    s.add_request(request("id-h", list(range(3, 3 + BLOCK * 2)), 4, ok))
    assert s.schedule().kv_connector_metadata.reqs_to_recv["id-h"].error is None
    if readers > 1:
        fewer = request("id-h2", list(range(5, 5 + BLOCK * 2)), 4, remote_params("p-h2", [2, 3], prefill_tp))
        assert s.connector.get_num_new_matched_tokens(fewer, 0) == (0, False)
        s.add_request(fewer)
        out = s.schedule()
        spec = out.kv_connector_metadata.reqs_to_recv["id-h2"]
        assert spec.local_block_ids == [] and spec.error is None and spec.remote.request_id == "p-h2", spec
        assert out.num_scheduled_tokens["id-h2"] > 0  # computed here


def test_concurrent_load_kv_five_requests_in_one_step(prefill, decode):
    pw, port = prefill
    conn, _ = decode
    specs = {}
    for i in range(5):
        inc = lend(pw, f"cc-{i}", [10 + 3 * i, 11 + 3 * i, 12 + 3 * i])
        specs[f"d-cc-{i}"] = load_spec(port, f"cc-{i}", [30 + 3 * i, 31 + 3 * i, 32 + 3 * i], [10 + 3 * i, 11 + 3 * i, 12 + 3 * i], inc)
    seen, errors = run_decode(conn, KvpollConnectorMetadata(reqs_to_recv=specs), set(specs))
    assert seen == set(specs) and not errors


def test_multi_xfer_one_engine_a_second_load_of_a_request_in_flight(prefill, decode):
    # NIXL's test loads one request id again while its load is in flight
    # and expects one report. Here the second load is dropped: the first
    # one's report (exactly once) covers the request.
    pw, port = prefill
    conn, _ = decode
    inc = lend(pw, "mx", [45, 46])
    first = KvpollConnectorMetadata(reqs_to_recv={"d-mx": load_spec(port, "mx", [45, 46], [45, 46], inc)})
    again = KvpollConnectorMetadata(reqs_to_recv={"d-mx": load_spec(port, "mx", [47, 48], [45, 46], inc)})
    conn.bind_connector_metadata(first)
    conn.start_load_kv(None)
    seen, errors = run_decode(conn, again, {"d-mx"})
    assert seen == {"d-mx"}


def test_handshake_fails_on_kv_cache_layout_mismatch(model_dir, decode):
    # A prefill with another block size: refused at the handshake with an
    # error that names both layouts; a failed load, not a wrong read.
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from harness import kv_cache_config, layer_name

    port = free_port()
    other = KvpollConnector(vllm_config(model_dir, port), KVConnectorRole.WORKER, kv_cache_config())
    other.register_kv_caches({layer_name(i): torch.zeros(NUM_BLOCKS, 1, BLOCK, 128) for i in range(2)})
    try:
        conn, _ = decode
        spec = load_spec(port, "lm", [1], [1], draw_incarnation())
        seen, errors = run_decode(conn, KvpollConnectorMetadata(reqs_to_recv={"d-lm": spec}), {"d-lm"})
        assert seen == {"d-lm"} and errors == {1}
    finally:
        other.shutdown()


def test_handshake_failure_returns_finished_with_its_blocks_invalid(decode):
    conn, _ = decode
    dead = free_port()  # nobody answers there
    spec = load_spec(dead, "hf", [1, 2, 3], [4, 5, 6], draw_incarnation())
    seen, errors = run_decode(conn, KvpollConnectorMetadata(reqs_to_recv={"d-hf": spec}), {"d-hf"})
    assert seen == {"d-hf"} and errors == {1, 2, 3}


def test_transfer_setup_failure_returns_finished_with_its_blocks_invalid(prefill, decode):
    # Remote blocks beyond the prefill's cache: a setup failure.
    pw, port = prefill
    conn, _ = decode
    spec = load_spec(port, "sf", [7, 8, 9], [NUM_BLOCKS + 10, NUM_BLOCKS + 11, NUM_BLOCKS + 12], draw_incarnation())
    seen, errors = run_decode(conn, KvpollConnectorMetadata(reqs_to_recv={"d-sf": spec}), {"d-sf"})
    assert seen == {"d-sf"} and errors == {7, 8, 9}


def test_kv_connector_stats_count_a_transfer_then_reset(prefill, decode):
    pw, port = prefill
    conn, _ = decode
    conn.get_kv_connector_stats()  # what earlier tests left
    assert conn.get_kv_connector_stats() is None
    inc = lend(pw, "st", [50, 51, 52])
    seen, _ = run_decode(conn, KvpollConnectorMetadata(reqs_to_recv={"d-st": load_spec(port, "st", [50, 51, 52], [50, 51, 52], inc)}), {"d-st"})
    stats = conn.get_kv_connector_stats()
    assert isinstance(stats, KvpollStats) and not stats.is_empty()
    assert stats.data["num_transfers"] == 1 and stats.data["bytes"] == 3 * BLOCK_BYTES * 2
    assert conn.get_kv_connector_stats() is None


def test_kv_connector_stats_aggregation_over_workers():
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    per_worker = [(2, 0.5), (1, 1.0), (3, 2.0)]
    outs = []
    for i, (n, secs) in enumerate(per_worker):
        stats = KvpollConnector.build_kv_connector_stats(
            {"num_transfers": n, "num_failed": 0, "bytes": 10 * n, "durations_s": [secs] * n}
        )
        outs.append(
            ModelRunnerOutput(
                req_ids=[f"r{i}"],
                req_id_to_index={f"r{i}": 0},
                sampled_token_ids=[[1]],
                kv_connector_output=KVConnectorOutput(kv_connector_stats=stats),
            )
        )
    agg = KVOutputAggregator(expected_finished_count=3).aggregate(outs, output_rank=0)
    stats = agg.kv_connector_output.kv_connector_stats
    assert isinstance(stats, KvpollStats)
    assert stats.data["num_transfers"] == 6 and stats.data["bytes"] == 60
    assert stats.reduce()["Avg xfer time (ms)"] == pytest.approx(1000 * (1 + 1 + 6) / 6)


def test_multi_connector_stats_keep_kvpoll_totals_apart_from_another_connectors():
    from dataclasses import dataclass

    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiKVConnectorStats
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    @dataclass
    class OtherStats(KVConnectorStats):
        def reset(self):
            self.data = {"n": 0}

        def is_empty(self) -> bool:
            return self.data.get("n", 0) == 0

        def aggregate(self, other: "OtherStats") -> "OtherStats":
            self.data["n"] = self.data.get("n", 0) + other.data.get("n", 0)
            return self

        def reduce(self):
            return {"n": self.data.get("n", 0)}

    # (kvpoll transfers, the other connector's) per worker, as vLLM's
    # MultiConnector reports them: a connector with none is left out.
    per_worker = [(2, 1), (3, 0), (0, 5)]
    outs = []
    for i, (mine, theirs) in enumerate(per_worker):
        data = {}
        if mine:
            data["KvpollConnector"] = KvpollConnector.build_kv_connector_stats(
                {"num_transfers": mine, "num_failed": 0, "bytes": 10 * mine, "durations_s": [0.5] * mine}
            )
        if theirs:
            data["OtherConnector"] = OtherStats(data={"n": theirs})
        outs.append(
            ModelRunnerOutput(
                req_ids=[f"r{i}"],
                req_id_to_index={f"r{i}": 0},
                sampled_token_ids=[[1]],
                kv_connector_output=KVConnectorOutput(kv_connector_stats=MultiKVConnectorStats(data=data)),
            )
        )
    agg = KVOutputAggregator(expected_finished_count=3).aggregate(outs, output_rank=0)
    stats = agg.kv_connector_output.kv_connector_stats
    assert isinstance(stats, MultiKVConnectorStats)
    assert isinstance(stats["KvpollConnector"], KvpollStats)
    assert stats["KvpollConnector"].data["num_transfers"] == 5 and stats["KvpollConnector"].data["bytes"] == 50
    assert stats["OtherConnector"].data["n"] == 6
    assert stats.reduce()["KvpollConnector"]["Avg xfer time (ms)"] == pytest.approx(500.0)


def test_shutdown_is_idempotent(model_dir):
    conn, _ = worker_connector(model_dir, free_port())
    conn.shutdown()
    conn.shutdown()
    conn.shutdown()


def test_register_kv_caches_cuts_a_split_k_v_layout_into_regions(model_dir):
    # FlashAttention's layout (2, num_blocks, block, heads, head): K and V
    # are a region each, the block is everything after the block dimension.
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from harness import kv_cache_config

    conn = KvpollConnector(vllm_config(model_dir, free_port()), KVConnectorRole.WORKER, kv_cache_config())
    try:
        t0 = torch.zeros(2, NUM_BLOCKS, BLOCK, 2, 64, dtype=torch.float16)
        t1 = torch.zeros(2, NUM_BLOCKS, BLOCK, 2, 64, dtype=torch.float16)
        conn.register_kv_caches({"layer0": t0, "layer1": t1})
        w = conn.connector_worker
        assert w.num_regions == 4 and w.block_bytes == BLOCK * 2 * 64 * 2
    finally:
        conn.shutdown()


def test_register_kv_caches_refuses_a_tensor_that_is_not_in_host_memory(model_dir):
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from harness import kv_cache_config, layer_name

    conn = KvpollConnector(vllm_config(model_dir, free_port()), KVConnectorRole.WORKER, kv_cache_config())
    with pytest.raises(ValueError, match="meta.*host memory"):
        conn.register_kv_caches({layer_name(0): torch.empty(NUM_BLOCKS, 2, BLOCK, 128, device="meta")})
    conn.shutdown()


def test_the_factory_creates_the_connector_from_the_module_path(model_dir):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from harness import kv_cache_config

    c = KVConnectorFactory.create_connector(
        config=vllm_config(model_dir, free_port()), role=KVConnectorRole.SCHEDULER, kv_cache_config=kv_cache_config()
    )
    assert isinstance(c, KvpollConnector)
