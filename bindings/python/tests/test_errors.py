"""Bad input raises TypeError / ValueError, engine refusals raise the
KvpollError subclass of their kind with the engine's message, and nothing
is submitted by a call that raised."""

from __future__ import annotations

import sys
import threading
import time

import kvpoll
import numpy as np
import pytest

from kvpoll_remote import BS, Reports, poll_until


@pytest.mark.parametrize(
    "call, exc, words",
    [
        pytest.param(lambda e: e.read(1.5, []), TypeError, "str or an int", id="float-id"),
        pytest.param(lambda e: e.read(True, []), TypeError, "not bool", id="bool-id"),
        pytest.param(lambda e: e.read(-1, []), ValueError, "0..2**63", id="negative-id"),
        pytest.param(lambda e: e.read(2**63, []), ValueError, "0..2**63", id="id-too-large"),
        pytest.param(lambda e: e.read("r", 5), TypeError, "handles", id="handles-not-iterable"),
        pytest.param(lambda e: e.read("r", "abc"), TypeError, "handles", id="handles-a-str"),
        pytest.param(lambda e: e.read("r", [(0, [1])]), ValueError, "(peer, local_blocks, remote_blocks)", id="handle-of-two-items"),
        pytest.param(lambda e: e.read("r", [object()]), TypeError, "a handle is", id="handle-of-wrong-type"),
        pytest.param(lambda e: e.read("r", [(0, [1], ["x"])]), TypeError, "must be an int", id="block-id-a-str"),
        pytest.param(lambda e: e.read("r", [(0, [-1], [1])]), ValueError, "out of range", id="negative-block-id"),
        pytest.param(lambda e: e.read("r", [(0, [2**32], [1])]), ValueError, "out of range", id="block-id-over-u32"),
        pytest.param(lambda e: e.read("r", [(-3, [1], [1])]), ValueError, "out of range", id="negative-peer"),
        pytest.param(lambda e: e.read("r", [(0, "ab", [1, 2])]), TypeError, "sequence of ints", id="blocks-a-str"),
        pytest.param(lambda e: e.lend("r", [1]), TypeError, "readers", id="lend-to-nobody"),
        pytest.param(lambda e: e.lend("r", [1], readers=1, writers=1), TypeError, "writers", id="lend-to-writers"),
        pytest.param(lambda e: e.receive("r", [1], readers=1), TypeError, "readers", id="receive-from-readers"),
        pytest.param(lambda e: e.lend("r", [1], readers=1, lease_s=-1.0), ValueError, "seconds", id="negative-lease"),
        pytest.param(lambda e: e.lend("r", [1], readers=1, lease_s=float("nan")), ValueError, "seconds", id="nan-lease"),
        pytest.param(lambda e: e.write("r", [(0, [1], [1])], expected_acks=-1), ValueError, "out of range", id="negative-acks"),
        pytest.param(lambda e: e.heartbeat("r", 1.0), TypeError, "sequence of request ids", id="heartbeat-of-one-str"),
        pytest.param(lambda e: e.read("r", [(0, [1], [1], 7, (0, 8))]), ValueError, "got 5 items", id="handle-of-five-items"),
        pytest.param(lambda e: e.read("r", [(0, [1], [1], 7, (0, 8), None)]), ValueError, "both local_bytes", id="part-one-range"),
        pytest.param(lambda e: e.read("r", [(0, [1], [1], 7, (0, 8), [0, 8])]), TypeError, "(start, end) tuple", id="part-a-list"),
        pytest.param(lambda e: e.read("r", [(0, [1], [1], 7, (8, 0), (0, 8))]), ValueError, "ends before it starts", id="part-backwards"),
        pytest.param(lambda e: kvpoll.Transfer(0, [1], [1], 7, local_bytes=(0, 8)), ValueError, "both local_bytes", id="transfer-one-range"),
        pytest.param(lambda e: e.add_peer("text"), TypeError, "bytes", id="metadata-a-str"),
        pytest.param(lambda e: e.add_peer(12), TypeError, "bytes-like", id="metadata-an-int"),
        pytest.param(lambda e: e.write_block(0, 1, "text"), TypeError, "bytes", id="block-data-a-str"),
        pytest.param(lambda e: e.register(-4), ValueError, "out of range", id="negative-region-size"),
        pytest.param(lambda e: e.register_buffer(object()), TypeError, "buffer", id="register-a-non-buffer"),
        pytest.param(lambda e: e.register_buffer(b"\0" * BS), ValueError, "read-only", id="register-read-only-bytes"),
        pytest.param(lambda e: e.register_buffer(np.zeros((4, 2 * BS), np.uint8)[:, :BS]), ValueError, "contiguous", id="register-non-contiguous-array"),
        pytest.param(lambda e: e.register_buffer((0, BS)), ValueError, "non-null", id="register-null-pointer"),
        pytest.param(lambda e: e.register_buffer((1, 2, 3)), ValueError, "(ptr, nbytes)", id="register-a-3-tuple"),
    ],
)
def test_bad_arguments_raise_type_or_value_errors_and_submit_nothing(call, exc, words):
    with kvpoll.Engine(block_size=BS, tls="tcp") as e:
        e.register(8)
        with pytest.raises(exc) as info:
            call(e)
        assert words in str(info.value)
        assert e.in_flight == 0


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        pytest.param(dict(block_size=-1), ValueError, "out of range", id="negative-block-size"),
        pytest.param(dict(block_size="16k"), TypeError, "block_size", id="block-size-a-str"),
        pytest.param(dict(idle="lazy"), ValueError, "adaptive", id="unknown-idle-policy"),
        pytest.param(dict(read_deadline_s=-2.0), ValueError, "read_deadline_s", id="negative-deadline"),
        pytest.param(dict(lend_grace_s=float("nan")), ValueError, "lend_grace_s", id="nan-lend-grace"),
        pytest.param(dict(block_size=0), kvpoll.ConfigError, "block size 0", id="zero-block-size"),
    ],
)
def test_bad_engine_settings_raise(kwargs, exc, words):
    with pytest.raises(exc) as info:
        kvpoll.Engine(**kwargs)
    assert words in str(info.value)


def test_refusals_name_the_callers_values():
    with kvpoll.Engine(block_size=BS, tls="tcp") as e:
        e.register(8)
        with pytest.raises(kvpoll.RegionError) as info:
            e.register_buffer(np.zeros(100))  # 800 bytes: not whole blocks
        assert "800 bytes" in str(info.value) and f"{BS}-byte" in str(info.value)
        with pytest.raises(kvpoll.RequestError) as info:
            e.write_block(0, 0, b"x" * 5000)
        assert "5000 bytes" in str(info.value) and f"{BS} bytes" in str(info.value)
        with pytest.raises(kvpoll.RegionError) as info:
            e.read_block(7, 0)
        assert "region 7" in str(info.value) and "1 region" in str(info.value)
        e.lend("req-B", [0], readers=1)
        with pytest.raises(kvpoll.RequestError) as info:
            e.lend("req-B", [1], readers=1)
        assert "'req-B'" in str(info.value) and "0x" not in str(info.value)
        with pytest.raises(kvpoll.RequestError, match="request 'never' is not in flight"):
            e.abort("never")
        assert e.in_flight == 1


def test_refusals_name_the_region_and_its_block_count():
    with kvpoll.Engine(block_size=BS, tls="tcp") as e:
        e.register(8)
        e.register(8)
        with pytest.raises(kvpoll.RequestError) as info:
            e.write_block(1, 8, b"x")
        assert "block 8 " in str(info.value) and "region 1 holds 8 blocks" in str(info.value)
        with pytest.raises(kvpoll.RegionError) as info:
            e.register(9)
        assert "9 blocks" in str(info.value) and "first, 8" in str(info.value)
        with pytest.raises(kvpoll.RequestError) as info:
            e.lend("r", [9], readers=1)
        assert "block 9 " in str(info.value) and "8 blocks" in str(info.value)
        # Refusals that once fell to the base class have their kind.
        with pytest.raises(kvpoll.RequestError, match="1000 remote engines"):
            e.lend("r", [0], readers=1000)
        assert e.in_flight == 0


def test_a_transport_list_ucx_cannot_use_names_what_ucx_offers():
    with pytest.raises(kvpoll.TransportError) as info:
        kvpoll.Engine(block_size=BS, tls="nonsense_tl")
    assert "nonsense_tl" in str(info.value) and "tcp" in str(info.value)


def test_a_poller_cpu_the_machine_does_not_have_is_refused():
    with pytest.raises(kvpoll.ConfigError, match="CPU 999999 does not exist") as info:
        kvpoll.Engine(block_size=BS, core=999999)
    cpus = open("/sys/devices/system/cpu/possible").read().strip()
    count = sum(
        int(r.split("-")[1]) - int(r.split("-")[0]) + 1 if "-" in r else 1
        for r in cpus.split(",")
    )
    assert f"it has {count} CPUs" in str(info.value)


def test_engine_refusals_are_kvpoll_errors_of_their_kind_with_the_engine_message():
    with kvpoll.Engine(block_size=BS, tls="tcp", slots=2) as e, kvpoll.Engine(
        block_size=2 * BS, tls="tcp"
    ) as other:
        with pytest.raises(kvpoll.RegionError, match="no region is registered") as info:
            e.lend("a", [0], readers=1)
        assert isinstance(info.value, kvpoll.KvpollError) and isinstance(info.value, ValueError)
        e.register(8)
        with pytest.raises(kvpoll.RegionError, match="same number of blocks"):
            e.register(9)
        with pytest.raises(kvpoll.PeerError, match="peer metadata"):
            e.add_peer(b"not metadata at all")
        with pytest.raises(kvpoll.PeerError):
            e.add_peer(other.local_metadata())  # another block size
        # Unless asked for: then only parts of blocks reach it, inside both.
        wide = e.add_peer(other.local_metadata(), any_block_size=True)
        with pytest.raises(kvpoll.RequestError, match="whole blocks of different sizes"):
            e.read("a", [(wide, [1], [1], 7)])
        with pytest.raises(kvpoll.RequestError, match="past the peer's block size"):
            e.read("a", [kvpoll.Transfer(wide, [1], [1], 7, local_bytes=(0, BS), remote_bytes=(BS + 1, 2 * BS + 1))])
        with pytest.raises(kvpoll.RequestError, match="differ in length"):
            e.read("a", [(wide, [1], [1], 7, (0, BS), (0, BS - 1))])
        with pytest.raises(kvpoll.RequestError, match="empty"):
            e.read("a", [(wide, [1], [1], 7, (4, 4), (4, 4))])
        with pytest.raises(kvpoll.RequestError, match="paired with"):
            e.read("a", [(0, [1, 2], [1])])
        with pytest.raises(kvpoll.RequestError, match="out of range"):
            e.read("a", [(0, [8], [1])])
        with pytest.raises(kvpoll.RequestError, match="must await at least one"):
            e.receive("z", [3], writers=0)
        e.lend("a", [0], readers=1)
        with pytest.raises(kvpoll.RequestError, match="already in flight"):
            e.lend("a", [1], readers=1)
        e.lend(5, [1], readers=1)
        with pytest.raises(kvpoll.BusyError, match="all 2 request slots"):
            e.lend("c", [2], readers=1)
        with pytest.raises(kvpoll.RequestError, match="not in flight"):
            e.abort("never")
        assert e.in_flight == 2
        # Give the poller time to take both lends from the command ring:
        # today's engine drops commands still in the ring at shutdown.
        time.sleep(0.2)
        e.shutdown()
        assert e.is_shut_down
        with pytest.raises(kvpoll.ShutdownError, match="shut down"):
            e.read("d", [])
        # What was in flight is still reported once, by the next poll.
        r = e.poll()
        assert r.expired | set(r.failed_recving) == {"a", 5}


def test_calls_that_wait_for_the_poller_release_the_gil():
    """Another Python thread runs while the engine is built, registers,
    gives its metadata, adds a peer and shuts down; it does not while a
    call that holds the GIL runs (the control, so the test can fail).

    The switch interval is raised to 10 s, so the other thread can only
    get the GIL when this one lets it go."""
    stamps = []
    stop = threading.Event()

    def tick():
        while not stop.is_set():
            stamps.append(time.perf_counter())
            time.sleep(0.0001)

    def held(seconds):  # keeps the GIL: a busy loop in C (no bytecode)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            sum(range(10_000))

    windows = {name: [] for name in ("Engine", "register", "local_metadata", "add_peer", "shutdown", "held")}

    def timed(name, f, *args):
        # Hold the GIL for a while first, so that the other thread has woken
        # from its sleep and waits for the GIL when the call starts.
        held(0.001)
        t0 = time.perf_counter()
        out = f(*args)
        windows[name].append((t0, time.perf_counter()))
        return out

    old = sys.getswitchinterval()
    sys.setswitchinterval(10.0)
    t = threading.Thread(target=tick)
    t.start()
    try:
        time.sleep(0.01)
        with kvpoll.Engine(block_size=BS, tls="tcp") as peer:
            peer.register(64)
            meta = peer.local_metadata()
            for _ in range(10):
                e = timed("Engine", kvpoll.Engine, BS)
                timed("register", e.register, 1024)
                timed("local_metadata", e.local_metadata)
                timed("add_peer", e.add_peer, meta)
                timed("shutdown", e.shutdown)
                timed("held", held, 0.005)
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)

    def inside(name):
        return sum(1 for t0, t1 in windows[name] for s in stamps if t0 < s < t1)

    assert inside("held") == 0, "the control let the other thread run: the test proves nothing"
    for name in ("Engine", "register", "local_metadata", "add_peer", "shutdown"):
        assert inside(name) >= 1, f"{name}: no other thread ran during 10 calls"


def test_a_prefix_hit_with_no_handles_is_finished_at_once_and_the_id_is_forgotten():
    with kvpoll.Engine(block_size=BS, tls="tcp") as e:
        e.register(8)
        rid = "prefix-hit"
        e.read(rid, [])
        reports = Reports()
        assert poll_until(e, reports, "finished_recving", rid, 10)
        assert reports.finished_recving[0] is rid
        # Reported and forgotten: the id can be used again.
        e.read(rid, [])
        end = time.monotonic() + 10
        while len(reports.finished_recving) < 2 and time.monotonic() < end:
            reports.add(e.poll())
            time.sleep(0.001)
        assert reports.finished_recving == [rid, rid]
        assert reports.finished_recving[1] is rid
