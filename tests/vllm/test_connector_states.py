"""The worker half's per-request states, driven directly in one process:
two ``KvpollWorker`` objects (a prefill and a decode) over real UCX (tcp
on 127.0.0.1), each with its side channel, handed the metadata vLLM's
scheduler half would hand them. What vLLM would see is what
``get_finished`` returns; nothing on its step path may wait on the
network."""

from __future__ import annotations

import gc
import socket
import threading
import time
import weakref
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import pytest

from harness import free_port

BLOCK_TOKENS = 16
HEADS = 1
HEAD = 8
BOUND_S = 60.0


def make_worker(port: int, num_blocks: int, head: int = HEAD, **extra: Any) -> Tuple[Any, Any]:
    """A worker (rank 0 of 1) with a CPU KV cache of ``num_blocks`` blocks
    in two layers (heads of ``head`` elements), registered; returns it
    and its caches."""
    import torch

    from kvpoll.vllm.config import KvpollConfig
    from kvpoll.vllm.worker import KvpollWorker

    config = KvpollConfig(
        side_channel_port=port, ucx_tls="tcp", handshake_timeout_s=2.0, **{"lease_s": 60.0, **extra}
    )
    w = KvpollWorker(f"engine-{port}", 0, 1, num_blocks, config, HEADS)
    caches = {f"layer{i}": torch.zeros(num_blocks, HEADS, BLOCK_TOKENS, 2 * head) for i in range(2)}
    w.register_kv_caches(caches)
    return w, caches


def remote(prefill: Any, req_id: str, blocks: List[int], inc: int, port: Optional[int] = None) -> Any:
    from kvpoll.vllm.metadata import RemotePrefill

    return RemotePrefill(
        engine_id=prefill.engine_id,
        request_id=req_id,
        host="127.0.0.1",
        port=port or prefill.config.side_channel_port,
        tp_size=1,
        block_ids=tuple(blocks),
        incarnation=inc,
        mode=prefill.config.mode,
    )


def meta(recv: Optional[Dict[str, Any]] = None, send: Optional[Dict[str, Any]] = None) -> Any:
    from kvpoll.vllm.metadata import KvpollConnectorMetadata

    return KvpollConnectorMetadata(reqs_to_recv=recv or {}, reqs_to_send=send or {})


def steps(*workers: Any, finished: Set[str] = frozenset()) -> Iterator[List[Tuple[Optional[set], Optional[set]]]]:
    """Each worker's ``get_finished`` once a step, as vLLM calls it, until
    the caller stops (bounded)."""
    end = time.monotonic() + BOUND_S
    while time.monotonic() < end:
        yield [w.get_finished(set(finished)) for w in workers]
        time.sleep(0.01)
    raise AssertionError(f"nothing happened within {BOUND_S} s")


@pytest.fixture
def made():
    workers: List[Any] = []
    yield workers
    for w in workers:
        w.shutdown()


def pair(made: List[Any], num_blocks: int = 32, **extra: Any) -> Tuple[Any, Any, Any, Any]:
    p, pc = make_worker(free_port(), num_blocks, **extra)
    made.append(p)
    d, dc = make_worker(free_port(), num_blocks, **extra)
    made.append(d)
    return p, pc, d, dc


def lend(p: Any, pc: Any, req_id: str, blocks: List[int]) -> int:
    """Fills ``blocks`` with a pattern of ``req_id`` and lends them."""
    from kvpoll import draw_incarnation

    for i, b in enumerate(blocks):
        for layer, t in enumerate(pc.values()):
            t[b].fill_(float(hash((req_id, i, layer)) % 1000))
    inc = draw_incarnation()
    p.start_load_kv(meta(send={req_id: (blocks, inc)}))
    return inc


def test_a_prompt_of_more_blocks_than_the_old_ledger_default_loads_whole(made):
    # 600 blocks (9 600 tokens at 16 a block): any prompt the KV cache
    # holds is one request; nothing caps it below the cache.
    from kvpoll.vllm.metadata import LoadSpec

    p, pc, d, dc = pair(made, num_blocks=640)
    blocks = list(range(20, 620))
    inc = lend(p, pc, "long", blocks)
    local = list(range(5, 605))
    d.start_load_kv(meta(recv={"d-long": LoadSpec(local, remote(p, "long", blocks, inc))}))
    for (_, recving), _ in steps(d, p, finished={"long"}):
        if recving:
            break
    assert recving == {"d-long"}
    assert not d.get_block_ids_with_load_errors(), "the load failed"
    for name in dc:
        assert bool((dc[name][local] == pc[name][blocks]).all()), f"{name}: decode KV differs"


class Gate:
    """A relay in front of a side channel that holds every connection
    until ``open()``: a prefill whose side channel hangs (stopped)."""

    def __init__(self, port: int) -> None:
        self.opened = threading.Event()
        self.connections = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._serve, args=(port,), daemon=True).start()

    def _serve(self, port: int) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._relay, args=(conn, port), daemon=True).start()

    def _relay(self, conn: socket.socket, port: int) -> None:
        self.opened.wait()
        with conn, socket.create_connection(("127.0.0.1", port)) as up:
            threading.Thread(target=self._copy, args=(conn, up), daemon=True).start()
            self._copy(up, conn)
            # Wakes the other copy's recv and tells the client the answer ended.
            conn.shutdown(socket.SHUT_RDWR)

    @staticmethod
    def _copy(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                chunk = src.recv(65536)
                if not chunk:
                    break
                dst.sendall(chunk)
        except OSError:
            pass

    def open(self) -> None:
        self.opened.set()

    def close(self) -> None:
        self.opened.set()
        self._sock.close()


def test_a_load_whose_prefill_has_not_answered_its_handshake_waits_across_steps_without_blocking_them(made):
    # The prefill's side channel answers only after the decode's step
    # returned: a step that fetched the handshake itself would have run
    # into the handshake timeout and failed the load.
    from kvpoll.vllm.worker import LoadState
    from kvpoll.vllm.metadata import LoadSpec

    p, pc, d, dc = pair(made)
    gate = Gate(p.config.side_channel_port)
    try:
        inc = lend(p, pc, "r0", [3, 4, 5])
        d.start_load_kv(meta(recv={"d-r0": LoadSpec([7, 8, 9], remote(p, "r0", [3, 4, 5], inc, gate.port))}))
        assert d.loads == {"d-r0": LoadState.HANDSHAKING}
        assert d.get_finished(set()) == (None, None)
        gate.open()
        for (_, recving), _ in steps(d, p, finished={"r0"}):
            if recving:
                break
        assert recving == {"d-r0"}
        assert not d.get_block_ids_with_load_errors(), "the load failed"
    finally:
        gate.close()


def test_a_failed_handshake_fails_the_next_loads_naming_that_prefill_at_once_without_asking_again(made):
    from kvpoll import draw_incarnation
    from kvpoll.vllm.metadata import LoadSpec

    p, pc, d, dc = pair(made)
    gone = free_port()  # nothing listens there
    dead = remote(p, "x0", [1, 2], draw_incarnation(), gone)
    d.start_load_kv(meta(recv={"d-x0": LoadSpec([1, 2], dead)}))
    for ((_, recving),) in steps(d):
        if recving:
            break
    assert recving == {"d-x0"} and d.get_block_ids_with_load_errors() == {1, 2}
    asked = d._handshakes.fetches
    # The next loads naming it fail in the step that takes them.
    later = {f"d-x{i}": LoadSpec([i + 3], remote(p, f"x{i}", [i + 3], draw_incarnation(), gone)) for i in (1, 2)}
    d.start_load_kv(meta(recv=later))
    assert d.get_finished(set())[1] == set(later)
    assert d._handshakes.fetches == asked


def test_a_release_whose_prefill_cannot_be_reached_is_never_reported_to_vllm(made):
    # vLLM has freed and forgotten a request aborted before it was
    # scheduled: a report of it would kill its EngineCore (the scheduler
    # asserts every reported id is one it tracks).
    from kvpoll import draw_incarnation
    from kvpoll.vllm.metadata import LoadSpec

    p, pc, d, dc = pair(made)
    gone = free_port()
    releases = {
        "d-gone": LoadSpec([], remote(p, "gone", [1], draw_incarnation(), gone)),
        "d-bad": LoadSpec([], None, "kv_transfer_params['remote_port'] missing or not int: None"),
    }
    d.start_load_kv(meta(recv=releases))
    end = time.monotonic() + 3 * d.config.handshake_timeout_s
    while time.monotonic() < end:
        sending, recving = d.get_finished(set())
        assert not recving and not sending, (sending, recving)
        time.sleep(0.05)
    assert not d.get_block_ids_with_load_errors()


def test_a_pull_release_frees_the_lend_of_a_prefill_whose_blocks_this_decode_could_not_read(made):
    # A request refused at the match because its blocks cannot be loaded
    # here (another layout, TP sizes that do not map) still tells its
    # prefill to release them: a release moves no block, so only a load
    # needs the layouts to fit. Otherwise the lend waits out its lease.
    from kvpoll.vllm.metadata import LoadSpec

    p, pc = make_worker(free_port(), 32)
    made.append(p)
    d, _ = make_worker(free_port(), 32, head=2 * HEAD)  # blocks twice as large
    made.append(d)
    inc = lend(p, pc, "other", [4, 5])
    d.start_load_kv(meta(recv={"d-other": LoadSpec([], remote(p, "other", [4, 5], inc))}))
    end = time.monotonic() + 10.0  # the lease is 60 s
    sending = None
    while time.monotonic() < end and not sending:
        assert d.get_finished(set()) == (None, None)
        sending, _ = p.get_finished({"other"})
        time.sleep(0.02)
    assert sending == {"other"}


def test_release_ranks_tell_each_prefill_rank_its_readers_once():
    from kvpoll.vllm.worker import release_ranks, tp_reads

    for p_tp in range(1, 9):
        for d_tp in range(1, 9):
            told = [q for r in range(d_tp) for q in release_ranks(r, d_tp, p_tp)]
            if max(p_tp, d_tp) % min(p_tp, d_tp) == 0:
                # Where the sizes map: the ranks each decode rank reads.
                assert told == [q for r in range(d_tp) for q, _, _ in tp_reads(r, d_tp, p_tp, 1, 1)]
                assert sorted(told) == sorted(list(range(p_tp)) * max(1, d_tp // p_tp))
            else:
                # Where they do not: every prefill rank once.
                assert sorted(told) == list(range(p_tp)), (p_tp, d_tp, told)


def test_a_push_release_frees_the_prefill_blocks_before_its_lease_ends(made):
    # A push-mode decode request aborted before it was scheduled: the
    # prefill holds its blocks for writers that will never ask, unless
    # the decode tells it; the lease (60 s here) is not the way back.
    from kvpoll import draw_incarnation
    from kvpoll.vllm.metadata import LoadSpec

    p, pc, d, dc = pair(made, mode="push")
    p.start_load_kv(meta(send={"pushed": ([4, 5, 6], draw_incarnation())}))
    assert p.get_finished({"pushed"}) == (None, None)  # held for its decode
    d.start_load_kv(meta(recv={"d-pushed": LoadSpec([], remote(p, "pushed", [4, 5, 6], draw_incarnation()))}))
    end = time.monotonic() + 10.0
    sending = None
    while time.monotonic() < end and not sending:
        assert d.get_finished(set()) == (None, None)
        sending, _ = p.get_finished(set())
        time.sleep(0.02)
    assert sending == {"pushed"}


def test_a_registered_host_tensor_lives_as_long_as_the_engine():
    # Registered by its address, a tensor the caller drops would be freed
    # and its memory reused while UCX still exposes it to peers.
    import torch

    from kvpoll.connector import KvConnectorWorker

    t = torch.zeros(16, 1024)
    alive = weakref.ref(t)
    w = KvConnectorWorker(block_size=4096)
    try:
        w.register_kv_caches({"layer": t})
        del t
        gc.collect()
        assert alive() is not None, "the registered tensor was freed"
    finally:
        w.shutdown()


def test_a_pull_pair_without_remote_writes_loads_as_usual_and_refuses_a_push_destination(made):
    # remote_write off: nothing a pull needs is lost (the decode writes
    # its own memory), and a push load, which needs peers' writes, fails
    # at once with why instead of opening the cache to them.
    from kvpoll import draw_incarnation
    from kvpoll.vllm.metadata import LoadSpec

    p, pc, d, dc = pair(made, remote_write=False)
    inc = lend(p, pc, "rw", [6, 7])
    d.start_load_kv(meta(recv={"d-rw": LoadSpec([1, 2], remote(p, "rw", [6, 7], inc))}))
    for (_, recving), _ in steps(d, p, finished={"rw"}):
        if recving:
            break
    assert recving == {"d-rw"} and not d.get_block_ids_with_load_errors()
    for name in dc:
        assert bool((dc[name][[1, 2]] == pc[name][[6, 7]]).all())
    pushed = remote(p, "pu", [8], draw_incarnation())
    pushed = type(pushed)(**{**pushed.__dict__, "mode": "push"})
    d.start_load_kv(meta(recv={"d-pu": LoadSpec([3], pushed)}))
    for ((_, recving),) in steps(d):
        if recving:
            break
    assert recving == {"d-pu"} and d.get_block_ids_with_load_errors() == {3}
