"""Transfers between a producer process and a consumer (this process), each
with its own kvpoll engine, over real UCX: every report checked for being
made exactly once, every block byte for byte."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from typing import Any, Iterable, List

import kvpoll
import numpy as np

from kvpoll_remote import BLOCKS, BS, GUARD_S, REGIONS, Reports, pattern, poll_for, poll_until


def wait(e: Any, reports: Reports, field: str, req_id: Any, timeout: float = GUARD_S) -> None:
    assert poll_until(e, reports, field, req_id, timeout), (
        f"{req_id!r} never reported in {field}: {reports.as_dict()}"
    )


def holds(e: Any, local: Iterable[int], seed: int, remote: Iterable[int]) -> bool:
    return all(
        e.read_block(r, l) == pattern(seed, r, b)
        for r in range(REGIONS)
        for l, b in zip(local, remote)
    )


def once(ids: List[Any]) -> bool:
    return all(n == 1 for n in Counter(ids).values())


def test_pull_with_two_handles_from_two_producer_processes_lands_every_byte_once(
    make_producer, make_consumer
):
    p1, p2 = make_producer(seed=1), make_producer(seed=2)
    c = make_consumer()
    a, b = c.add_peer(p1.metadata), c.add_peer(p2.metadata)
    l1 = p1.call("lend", "pull-1", [10, 11, 12, 13], readers=1)
    l2 = p2.call("lend", "pull-1", [20, 21, 22, 23], readers=1)
    c.read("pull-1", [(a, [0, 1, 2, 3], [10, 11, 12, 13], l1), kvpoll.Transfer(b, [4, 5, 6, 7], [20, 21, 22, 23], l2)])
    reports = Reports()
    wait(c, reports, "finished_recving", "pull-1")
    assert holds(c, [0, 1, 2, 3], 1, [10, 11, 12, 13])
    assert holds(c, [4, 5, 6, 7], 2, [20, 21, 22, 23])
    # Each producer was notified by the read, which released its lend.
    for p in (p1, p2):
        seen = p.wait("finished_sending", "pull-1")
        assert seen["finished_sending"] == ["pull-1"] and seen["expired"] == []
    poll_for(c, reports, 0.2)
    assert reports.finished_recving == ["pull-1"] and reports.failed_recving == []
    assert c.in_flight == 0


def test_a_handle_failure_is_deferred_until_its_stopped_sibling_ends_and_reported_once_with_its_blocks(
    make_producer, make_consumer
):
    p1, p2 = make_producer(seed=1), make_producer(seed=2)
    c = make_consumer()
    a, b = c.add_peer(p1.metadata), c.add_peer(p2.metadata)
    l1 = p1.call("lend", "deferred", [10, 11], readers=1)
    l2 = p2.call("lend", "deferred", [20, 21], readers=1, lease_s=1.0)
    c.remove_peer(b)  # handle 1's peer is gone: a setup failure, at once
    os.kill(p1.pid, signal.SIGSTOP)  # handle 0's gets stay in flight (tcp needs p1's progress)
    try:
        c.read("deferred", [(a, [0, 1], [10, 11], l1), (b, [2, 3], [20, 21], l2)])
        reports = Reports()
        wait(c, reports, "handle_failures", "deferred")
        assert reports.handle_failures[0][:3] == ("deferred", 1, "setup")
        poll_for(c, reports, 1.0)
        assert reports.failed_recving == [], "reported while a sibling was in flight"
        assert reports.finished_recving == []
    finally:
        os.kill(p1.pid, signal.SIGCONT)
    wait(c, reports, "failed_recving", "deferred")
    req, blocks, (cause, _status) = reports.failed_recving[0]
    assert req == "deferred" and cause == "setup"
    assert sorted(blocks) == [0, 1, 2, 3]
    poll_for(c, reports, 0.3)
    assert len(reports.failed_recving) == 1 and reports.finished_recving == []
    # A failed read notifies nobody: the second producer's lend expires.
    seen = p2.wait("expired", "deferred")
    assert seen["expired"] == ["deferred"] and seen["finished_sending"] == []


def test_push_is_done_only_after_the_consumer_acknowledged_and_the_bytes_are_there(
    make_producer, make_consumer
):
    p = make_producer(seed=3)
    c = make_consumer()
    c.add_peer(p.metadata)  # the consumer acknowledges through its own endpoint
    to_c = p.call("add_peer", c.local_metadata())
    dest = c.receive("push-1", [30, 31, 32], writers=1)
    p.call("write", "push-1", [(to_c, [1, 2, 3], [30, 31, 32], dest)], expected_acks=1)
    seen = p.wait("finished_sending", "push-1")
    assert seen["finished_sending"] == ["push-1"] and seen["expired"] == []
    reports = Reports()
    wait(c, reports, "finished_recving", "push-1")
    assert holds(c, [30, 31, 32], 3, [1, 2, 3])
    poll_for(c, reports, 0.2)
    assert reports.finished_recving == ["push-1"]


def test_a_lend_nobody_reads_expires_once_at_its_lease(make_producer):
    p = make_producer(seed=4)
    t = time.monotonic()
    p.call("lend", "lease-1", [5], readers=1, lease_s=0.3)
    seen = p.wait("expired", "lease-1")
    assert time.monotonic() - t >= 0.3
    assert seen["finished_sending"] == []
    seen = p.poll_for(0.3)
    assert seen["expired"] == ["lease-1"]


def test_a_heartbeat_keeps_a_lend_alive_past_its_twins_lease_and_a_reader_still_releases_it(
    make_producer, make_consumer
):
    p = make_producer(seed=5)
    kept = p.call("lend", "kept", [1], readers=1, lease_s=0.5)
    p.call("lend", "dropped", [2], readers=1, lease_s=0.5)
    p.call("heartbeat", ["kept", "never-lent"], 60.0)
    seen = p.wait("expired", "dropped")
    seen = p.poll_for(0.3)
    assert seen["expired"] == ["dropped"]
    c = make_consumer()
    peer = c.add_peer(p.metadata)
    c.read("kept", [(peer, [0], [1], kept)])
    reports = Reports()
    wait(c, reports, "finished_recving", "kept")
    seen = p.wait("finished_sending", "kept")
    assert seen["finished_sending"] == ["kept"] and seen["expired"] == ["dropped"]


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (``T`` in /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def test_abort_fails_a_stuck_read_once_with_cause_aborted(make_producer, make_consumer):
    p = make_producer(seed=6)
    # An abort touches only its own request: the posted read stays until its
    # producer answers or its deadline judges the producer stalled.
    c = make_consumer(read_deadline_s=2.0)
    peer = c.add_peer(p.metadata)
    os.kill(p.pid, signal.SIGSTOP)
    end = time.monotonic() + 10
    while not stopped(p.pid):
        assert time.monotonic() < end, "the producer did not stop"
        time.sleep(0.001)
    try:
        c.read("abort-1", [(peer, [0, 1], [0, 1], kvpoll.draw_incarnation())])  # nothing lent: aborted first
        reports = Reports()
        poll_for(c, reports, 0.2)
        assert reports.failed_recving == [] and reports.finished_recving == []
        c.abort("abort-1")
        wait(c, reports, "failed_recving", "abort-1")
    finally:
        os.kill(p.pid, signal.SIGCONT)
    req, blocks, (cause, _) = reports.failed_recving[0]
    assert (req, sorted(blocks), cause) == ("abort-1", [0, 1], "aborted")
    poll_for(c, reports, 0.2)
    assert len(reports.failed_recving) == 1
    try:
        c.abort("abort-1")
    except kvpoll.RequestError as e:
        assert "not in flight" in str(e)
    else:
        raise AssertionError("aborting a reported request did not raise")


def test_str_and_int_ids_round_trip_as_the_same_objects_and_name_one_request_in_both_processes(
    make_producer, make_consumer
):
    p = make_producer(seed=7)
    c = make_consumer()
    peer = c.add_peer(p.metadata)
    ids = ["cmpl-ünï-çødé-0", "", "7", 7, 0, 2**63 - 1, "x" * 1000]
    incs = [p.call("lend", i, [n], readers=1) for n, i in enumerate(ids)]
    for n, i in enumerate(ids):
        c.read(i, [(peer, [n], [n], incs[n])])
    reports = Reports()
    for i in ids:
        wait(c, reports, "finished_recving", i)
    # The very objects given, each once (7 and "7" are two requests).
    assert Counter(map(id, reports.finished_recving)) == Counter(map(id, ids))
    for n, _ in enumerate(ids):
        assert holds(c, [n], 7, [n])
    # The producer's lends of the same ids were released by these reads.
    for i in ids:
        seen = p.wait("finished_sending", i)
    assert sorted(map(repr, seen["finished_sending"])) == sorted(map(repr, ids))
    assert kvpoll.request_id(7) == 7 and kvpoll.request_id("7") >= 2**63


def test_a_killed_producer_fails_the_read_once(make_producer, make_consumer):
    p = make_producer(seed=8)
    c = make_consumer(read_deadline_s=20.0)
    peer = c.add_peer(p.metadata)
    inc = p.call("lend", "kill-1", [3, 4], readers=1)
    os.kill(p.pid, signal.SIGSTOP)  # the read stays in flight
    c.read("kill-1", [(peer, [8, 9], [3, 4], inc)])
    reports = Reports()
    poll_for(c, reports, 0.2)
    assert reports.failed_recving == [] and reports.finished_recving == []
    t = time.monotonic()
    os.kill(p.pid, signal.SIGKILL)
    p.proc.join(10)
    wait(c, reports, "failed_recving", "kill-1")
    req, blocks, (cause, _) = reports.failed_recving[0]
    assert req == "kill-1" and sorted(blocks) == [8, 9]
    # Seen as a lost peer or a failed transfer, well before the deadline.
    assert cause in ("peer_lost", "transfer"), cause
    assert time.monotonic() - t < 15
    poll_for(c, reports, 0.5)
    assert len(reports.failed_recving) == 1 and reports.finished_recving == []
    assert c.in_flight == 0


def test_reads_land_in_numpy_arrays_registered_as_regions(make_producer):
    p = make_producer(seed=9)
    c = kvpoll.Engine(block_size=BS, tls="tcp")
    try:
        layers = [np.zeros((BLOCKS, BS), dtype=np.uint8) for _ in range(REGIONS)]
        assert c.register_buffer(layers[0]) == 0
        assert c.register_buffer((layers[1].ctypes.data, layers[1].nbytes)) == 1
        peer = c.add_peer(p.metadata)
        # A read finishes only once its lender confirmed the lend was live.
        inc = p.call("lend", "np-1", [40, 41], readers=1)
        c.read("np-1", [(peer, [2, 3], [40, 41], inc)])
        reports = Reports()
        wait(c, reports, "finished_recving", "np-1")
        for r in range(REGIONS):
            assert layers[r][2].tobytes() == pattern(9, r, 40)
            assert layers[r][3].tobytes() == pattern(9, r, 41)
            assert not layers[r][4].any()
    finally:
        c.shutdown()


def test_a_write_to_a_block_beyond_the_consumer_fails_once_in_failed_sending_with_its_reason(
    make_producer, make_consumer
):
    p = make_producer(seed=15)
    c = make_consumer()
    to_p = c.add_peer(p.metadata)
    c.write("bad-push", [(to_p, [1], [10_000], kvpoll.draw_incarnation())], expected_acks=1, lease_s=0.3)
    reports = Reports()
    wait(c, reports, "failed_sending", "bad-push")
    assert reports.failed_sending == [("bad-push", ("setup", 0))]
    poll_for(c, reports, 0.5)
    assert reports.failed_sending == [("bad-push", ("setup", 0))]
    assert reports.expired == [] and reports.finished_sending == []


def test_notify_only_releases_the_producers_lend_and_reports_nothing_here(
    make_producer, make_consumer
):
    p = make_producer(seed=16)
    c = make_consumer()
    to_p = c.add_peer(p.metadata)
    inc = p.call("lend", "hit-1", [5], readers=1, lease_s=60.0)
    c.notify_only("hit-1", [(to_p, inc)])
    seen = p.wait("finished_sending", "hit-1")
    assert seen["finished_sending"] == ["hit-1"]
    reports = Reports()
    poll_for(c, reports, 0.2)
    assert reports.as_dict() == {f: [] for f in Reports.FIELDS}
