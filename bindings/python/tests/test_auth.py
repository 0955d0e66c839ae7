"""Authenticated peers from Python: engines built with the same
``auth_key`` read and confirm as ever; a peer without it, or with another,
is refused at ``add_peer`` with ``PeerError`` and counted in
``poller_stats()``; a secret too short is a ``ValueError``."""

from __future__ import annotations

import os

import kvpoll
import pytest

from kvpoll_remote import BS, GUARD_S, Reports, pattern, poll_until

KEY = b"the deployment's shared secret"
OTHER = b"another deployment's secret"


def test_engines_with_the_same_key_read_a_lend_and_refuse_nothing(make_producer, make_consumer):
    p = make_producer(seed=3, auth_key=KEY)
    c = make_consumer(auth_key=KEY)
    peer = c.add_peer(p.metadata)
    lend = p.call("lend", "auth-1", [4, 5], readers=1)
    c.read("auth-1", [(peer, [0, 1], [4, 5], lend)])
    reports = Reports()
    assert poll_until(c, reports, "finished_recving", "auth-1", GUARD_S), reports.as_dict()
    assert c.read_block(0, 0) == pattern(3, 0, 4) and c.read_block(0, 1) == pattern(3, 0, 5)
    seen = p.wait("finished_sending", "auth-1")
    assert seen["finished_sending"] == ["auth-1"]
    stats = c.poller_stats()
    assert (stats["unauthenticated_peers"], stats["unauthenticated_notifications"]) == (0, 0), stats


@pytest.mark.parametrize("theirs", [None, OTHER], ids=["without a key", "with another key"])
def test_a_peer_without_the_key_or_with_another_is_refused_at_add_peer_and_counted(make_consumer, theirs):
    ours = make_consumer(auth_key=KEY)
    other = make_consumer(auth_key=theirs)
    with pytest.raises(kvpoll.PeerError, match="peer refused"):
        ours.add_peer(other.local_metadata())
    assert ours.poller_stats()["unauthenticated_peers"] == 1
    with pytest.raises(kvpoll.PeerError, match="peer refused"):
        other.add_peer(ours.local_metadata())
    assert other.poller_stats()["unauthenticated_peers"] == 1


def test_a_secret_too_short_is_refused():
    with pytest.raises(ValueError, match="at least 16"):
        kvpoll.Engine(block_size=BS, tls="tcp", auth_key=b"short")


def test_a_keyed_run_gives_every_engine_built_without_a_key_the_suites_key(make_consumer):
    # KVPOLL_TEST_AUTH_KEY (the library's test hook) runs a whole suite
    # keyed: an engine built without auth_key takes that secret.
    secret = os.environ.get("KVPOLL_TEST_AUTH_KEY", "").strip()
    plain = make_consumer()
    if not secret:
        keyed = make_consumer(auth_key=KEY)
        with pytest.raises(kvpoll.PeerError, match="peer refused"):
            plain.add_peer(keyed.local_metadata())
        return
    plain.add_peer(make_consumer(auth_key=secret.encode()).local_metadata())
    with pytest.raises(kvpoll.PeerError, match="peer refused"):
        plain.add_peer(make_consumer(auth_key=KEY).local_metadata())
