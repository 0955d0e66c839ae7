"""kvpoll.connector.KvConnectorWorker driven as vLLM's scheduler drives a
KV connector's worker side: one get_finished per engine step."""

from __future__ import annotations

import contextlib
import time
from collections import Counter

import numpy as np
import pytest

from kvpoll import device_memory, draw_incarnation
from kvpoll.connector import KvConnectorWorker
from kvpoll_remote import BLOCKS, BS, REGIONS, pattern

N = 3000  # requests
FAIL_EVERY = 10  # every 10th read also has a handle to an unknown peer
UNKNOWN_PEER = 4242


def test_a_scheduler_loop_calling_get_finished_every_step_sees_each_request_exactly_once(make_producer):
    p = make_producer(seed=11, slots=4096)
    ids = [f"cmpl-{n:05d}-0" for n in range(N)]
    failing = {ids[n] for n in range(0, N, FAIL_EVERY)}
    # The producer lends one block per request it will be read from (not
    # the failing ones: a failed read notifies nobody) and runs its own
    # loop, get_finished every step, until every lend came back. Each
    # lend's incarnation is drawn here and handed to the reader first (as
    # vLLM's scheduler hands out block ids): reads may reach the producer
    # before its lends do.
    incs = {i: draw_incarnation() for i in ids}
    lent = [(n, i, incs[i]) for n, i in enumerate(ids) if i not in failing]
    p.start_producer_loop(lent, 256, 60.0, 90.0)

    w = KvConnectorWorker(block_size=BS, tls="tcp", idle="adaptive")
    try:
        w.register_kv_caches({f"layer.{r}": np.zeros((BLOCKS, BS), np.uint8) for r in range(REGIONS)})
        w.add_remote("prefill-0", p.metadata)
        recving, sending = Counter(), Counter()
        load_errors = set()
        expected_errors = set()
        next_n, steps, in_flight = 0, 0, set()
        end = time.monotonic() + 90
        while (next_n < N or in_flight) and time.monotonic() < end:
            batch = {}
            while next_n < N and len(in_flight) + len(batch) < 256 and len(batch) < 64:
                n, i = next_n, ids[next_n]
                local = n % BLOCKS
                handles = [("prefill-0", [local], [n % BLOCKS], incs[i])]
                if i in failing:
                    handles.append((UNKNOWN_PEER, [(local + 1) % BLOCKS], [0], draw_incarnation()))
                    expected_errors.update({local, (local + 1) % BLOCKS})
                batch[i] = handles
                next_n += 1
            w.start_load_kv(reqs_to_recv=batch)
            in_flight.update(batch)
            s, r = w.get_finished(set())
            steps += 1
            for i in r or ():
                recving[i] += 1
                in_flight.discard(i)
            for i in s or ():
                sending[i] += 1
            load_errors |= w.get_block_ids_with_load_errors()
            time.sleep(0.0002)
        for _ in range(50):  # later steps must not report anything again
            s, r = w.get_finished(set())
            recving.update(r or ())
            sending.update(s or ())
            load_errors |= w.get_block_ids_with_load_errors()
            time.sleep(0.002)
    finally:
        w.shutdown()
    assert not in_flight, f"{len(in_flight)} requests never reported after {steps} steps"
    assert set(recving) == set(ids)
    assert max(recving.values()) == 1, [i for i, c in recving.items() if c > 1][:5]
    assert not sending, "a consumer reported a send"
    assert load_errors == expected_errors
    assert w.pending == 0

    got = p.answer(timeout=120)
    assert got["pending"] == 0
    assert set(got["sending"]) == {i for _, i, _ in lent}
    assert max(got["sending"].values()) == 1
    assert not got["recving"]


def test_a_failed_load_is_in_recving_once_and_its_blocks_in_the_load_errors_once(make_producer):
    p = make_producer(seed=12)
    with KvConnectorWorker(block_size=BS, tls="tcp") as w:
        w.register_kv_caches({"l0": [np.zeros((BLOCKS, BS), np.uint8), np.zeros((BLOCKS, BS), np.uint8)]})
        w.add_remote("p", p.metadata)
        # Reads finish only once their lender confirmed the lend was live.
        ok = p.call("lend", "ok", [5, 6], readers=1)
        bad = p.call("lend", "bad", [7], readers=1)
        w.start_load_kv(
            reqs_to_recv={
                "ok": [("p", [1, 2], [5, 6], ok)],
                "bad": [("p", [3], [7], bad), (999, [4], [8], draw_incarnation())],
            }
        )
        seen = Counter()
        errors = []
        reasons = {}
        end = time.monotonic() + 30

        def step():
            _, r = w.get_finished(())
            seen.update(r or ())
            assert w.failed == set(w.failure_reasons) <= set(r or ())
            reasons.update(w.failure_reasons)
            errors.append(w.get_block_ids_with_load_errors())

        while len(seen) < 2 and time.monotonic() < end:
            step()
            time.sleep(0.001)
        for _ in range(20):
            step()
        assert seen == Counter({"ok": 1, "bad": 1})
        # The failed one with the engine's cause (its second handle names
        # a peer that does not exist).
        assert list(reasons) == ["bad"] and reasons["bad"][0] == "setup", reasons
        assert [e for e in errors if e] == [{3, 4}]
        assert w.engine.read_block(0, 1) == pattern(12, 0, 5)
        assert w.engine.read_block(1, 2) == pattern(12, 1, 6)


def test_a_push_through_the_connector_is_sent_once_released_by_the_scheduler_and_received_once(make_producer):
    # This process is the prefill side here: it pushes into the remote's
    # blocks, lent to one writer.
    d = make_producer(seed=13)
    with KvConnectorWorker(block_size=BS, tls="tcp") as w:
        for r in range(REGIONS):
            w.engine.register(BLOCKS)
            w.engine.write_block(r, 9, pattern(14, r, 9))
        to_d = w.add_remote("decode-0", d.metadata)
        d.call("add_peer", w.metadata())
        dest = d.call("receive", "push-9", [50], writers=1)
        w.save_kv("push-9", [("decode-0", [9], [50], dest)])
        w.wait_for_save()
        sent_before_release = []
        end = time.monotonic() + 30
        while time.monotonic() < end:
            s, _ = w.get_finished(())
            if s:
                sent_before_release.append(s)
            if w.engine.in_flight == 0:
                break
            time.sleep(0.001)
        # Done on the wire, but vLLM has not finished the request: held.
        assert w.engine.in_flight == 0 and sent_before_release == []
        s, _ = w.get_finished({"push-9"})
        assert s == {"push-9"}
        assert w.get_finished({"push-9"}) == (None, None)
        assert to_d == 0
    seen = d.wait("finished_recving", "push-9")
    assert seen["finished_recving"] == ["push-9"]
    assert d.call("read_block", 0, 50) == pattern(14, 0, 9)


def test_register_kv_caches_names_the_layer_it_refuses():
    with KvConnectorWorker(block_size=BS, tls="tcp") as w:
        with pytest.raises(ValueError, match="'layer.1'"):
            w.register_kv_caches({"layer.0": np.zeros((8, BS), np.uint8), "layer.1": np.zeros((8, BS), np.uint8)[::-1]})


@contextlib.contextmanager
def lender(make_producer, seed, **engine_kwargs):
    """A worker that lends (its regions registered) and a remote reader
    that knows it: (worker, remote, the worker's peer id there)."""
    d = make_producer(seed=seed)
    with KvConnectorWorker(block_size=BS, tls="tcp", idle="adaptive", **engine_kwargs) as w:
        for _ in range(REGIONS):
            w.engine.register(BLOCKS)
        yield w, d, d.call("add_peer", w.metadata())


def _drain_sends(w, remote, ids, first_release=(), timeout=30.0):
    """Steps the worker (get_finished every step, the first step releasing
    ``first_release``) while ``remote`` reads each of ``ids``; returns how
    often each id was reported in ``sending``."""
    sent = Counter()
    release = set(first_release)
    end = time.monotonic() + timeout
    while set(sent) != set(ids) and time.monotonic() < end:
        s, _ = w.get_finished(release)
        release = set()
        sent.update(s or ())
        time.sleep(0.002)
    for _ in range(20):
        s, _ = w.get_finished(())
        sent.update(s or ())
    return sent


def test_lends_refused_as_busy_keep_the_schedulers_release_and_are_each_sent_once(make_producer):
    # Two slots, four lends in one step, released by the scheduler that same
    # step (vLLM passes finished_req_ids with the step that lends): the two
    # lends the engine refuses as busy wait in the backlog, and the release
    # must wait with them.
    with lender(make_producer, 15, slots=2) as (w, d, peer):
        ids = [f"busy-{n}" for n in range(4)]
        incs = {i: draw_incarnation() for i in ids}
        w.start_load_kv(reqs_to_send={i: ([n], 1, incs[i]) for n, i in enumerate(ids)})
        assert w.pending == 2
        for n, i in enumerate(ids):
            d.call("read", i, [(peer, [n], [n], incs[i])])
        sent = _drain_sends(w, d, ids, first_release=ids)
    assert sent == Counter({i: 1 for i in ids})


def test_a_release_that_arrives_before_its_lend_is_kept_for_the_lend(make_producer):
    with lender(make_producer, 16) as (w, d, peer):
        inc = draw_incarnation()
        assert w.get_finished({"early"}) == (None, None)
        w.start_load_kv(reqs_to_send={"early": ([3], 1, inc)})
        d.call("read", "early", [(peer, [3], [3], inc)])
        sent = _drain_sends(w, d, ["early"])
    assert sent == Counter({"early": 1})


def test_register_kv_caches_refuses_memory_that_is_not_mapped_host_memory():
    # An address no host mapping covers (a device pointer looks like this
    # to the host): refused at registration, before UCX sees it.
    with KvConnectorWorker(block_size=BS, tls="tcp") as w:
        with pytest.raises(ValueError, match="'layer.0'.*not host memory"):
            w.register_kv_caches({"layer.0": (0x7F0000001000 - BS * BLOCKS, BS * BLOCKS)})
        with pytest.raises(ValueError, match="'layer.0'.*not host memory"):
            w.register_kv_caches({"layer.0": (0, BS * BLOCKS)})


def test_register_kv_caches_refuses_a_tensor_on_a_device_and_says_why():
    class DeviceTensor:
        """What register_kv_caches sees of a torch tensor on a GPU: a data
        pointer, a size, and its device."""

        class device:
            type = "cuda"

            def __str__(self) -> str:
                return "cuda:0"

        device = device()

        def data_ptr(self) -> int:
            return 0x7F0000000000

        def element_size(self) -> int:
            return 1

        def numel(self) -> int:
            return BS * BLOCKS

        def is_contiguous(self) -> bool:
            return True

    refusal = device_memory()["refusal"]
    if refusal is None:
        pytest.skip("CUDA memory can be registered here: scripts/gpu-check.sh moves it")
    with KvConnectorWorker(block_size=BS, tls="tcp") as w:
        with pytest.raises(ValueError, match="'layer.0'.*cuda:0 cannot be registered") as err:
            w.register_kv_caches({"layer.0": DeviceTensor()})
        assert refusal in str(err.value)


def test_register_kv_caches_refuses_a_tensor_on_another_kind_of_device():
    class XpuTensor:
        class device:
            type = "xpu"

            def __str__(self) -> str:
                return "xpu:0"

        device = device()

    with KvConnectorWorker(block_size=BS, tls="tcp") as w:
        with pytest.raises(ValueError, match="'layer.0'.*xpu:0.*host and CUDA memory only"):
            w.register_kv_caches({"layer.0": XpuTensor()})


def test_a_read_submitted_before_its_lend_finishes_once_the_lend_arrives(make_producer):
    # vLLM's decode learns the block ids (and the lend's incarnation) from
    # the prefill's response, possibly before the prefill worker lent them:
    # the read is answered when the lend arrives.
    p = make_producer(seed=17)
    with KvConnectorWorker(block_size=BS, tls="tcp", idle="adaptive") as w:
        w.register_kv_caches({f"l{r}": np.zeros((BLOCKS, BS), np.uint8) for r in range(REGIONS)})
        w.add_remote("p", p.metadata)
        inc = draw_incarnation()
        w.start_load_kv(reqs_to_recv={"late-lend": [("p", [4], [9], inc)]})
        time.sleep(0.5)
        p.call("lend", "late-lend", [9], readers=1, incarnation=inc)
        seen = Counter()
        end = time.monotonic() + 30
        while not seen and time.monotonic() < end:
            _, r = w.get_finished(())
            seen.update(r or ())
            time.sleep(0.002)
        assert seen == Counter({"late-lend": 1})
        assert w.get_block_ids_with_load_errors() == set()
        assert w.engine.read_block(0, 4) == pattern(17, 0, 9)
        assert w.engine.read_block(1, 4) == pattern(17, 1, 9)


def test_a_backlogged_lend_refused_later_is_reported_not_raised_from_a_later_step(make_producer):
    # The engine refuses the third lend as busy first; when it is retried
    # the engine refuses it for good (a block beyond the regions). That
    # step must not raise: the request is reported in sending once (its
    # blocks were never lent), the others as usual.
    with lender(make_producer, 18, slots=2) as (w, d, peer):
        incs = {i: draw_incarnation() for i in ("ok-0", "ok-1", "bad")}
        w.start_load_kv(
            reqs_to_send={"ok-0": ([0], 1, incs["ok-0"]), "ok-1": ([1], 1, incs["ok-1"]), "bad": ([BLOCKS * 100], 1, incs["bad"])}
        )
        assert w.pending == 1
        for n in range(2):
            d.call("read", f"ok-{n}", [(peer, [n], [n], incs[f"ok-{n}"])])
        sent = _drain_sends(w, d, ["ok-0", "ok-1", "bad"], first_release=["ok-0", "ok-1", "bad"])
        assert w.pending == 0
    assert sent == Counter({"ok-0": 1, "ok-1": 1, "bad": 1})
