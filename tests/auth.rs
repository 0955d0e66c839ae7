//! Authenticated peers, over real UCX through the public API: engines that
//! share a key read, confirm and push as ever; an engine with a key
//! refuses, at `add_peer`, a peer without it or with another (and an
//! engine without a key refuses a keyed peer), and drops — counting each —
//! a notification message without a tag of its key and a copy of one it
//! received before. An older peer's metadata is a typed error.

mod common;

use std::time::{Duration, Instant};

use kvpoll::auth::{AuthError, AuthKey};
use kvpoll::engine::{Engine, Outcomes};
use kvpoll::ledger::{BlockId, Incarnation, PeerId, RequestId};
use kvpoll::metadata::{MetadataError, PeerMetadata};
use kvpoll::notification::{NoteKind, Notification, Sealer};
use kvpoll::transport::ucx::{ContextOptions, Endpoint, UcxTransport, Worker, NOTIFY_AM_ID};
use kvpoll::transport::{Transport, TransportEvent};
use kvpoll::wire::{fnv1a64, FrameError};
use kvpoll::{PeerError, PollerStats};

use common::{fill_block as fill, holds_block as holds, one, reported, try_wait as wait};

const BS: u64 = 4096;
const BLOCKS: u64 = 16;
const GUARD: Duration = Duration::from_secs(10);
const TCP: &str = "tcp";
const SHM: &str = "posix,sysv,cma";
const SEED: u64 = 11;

fn key() -> AuthKey {
    AuthKey::from_secret(b"the deployment's shared secret").unwrap()
}

fn other_key() -> AuthKey {
    AuthKey::from_secret(b"another deployment's secret").unwrap()
}

fn engine(tls: &str, key: Option<AuthKey>) -> Engine {
    let mut e = Engine::builder()
        .block_size(BS)
        .ucx(ContextOptions::with_transports(tls))
        .lend_grace(Duration::from_millis(300))
        .auth_key(key)
        .build()
        .expect("engine");
    e.register(BLOCKS).unwrap();
    e
}

fn blocks(ids: &[u32]) -> Vec<BlockId> {
    ids.iter().copied().map(BlockId).collect()
}

/// Whether `what` of `e`'s poller stats reaches `n` within the guard
/// (the poller publishes its counters as it goes idle).
fn counted(e: &Engine, n: u64, what: impl Fn(&PollerStats) -> u64) -> bool {
    let t = Instant::now();
    while what(&e.poller_stats()) < n && t.elapsed() < GUARD {
        std::thread::sleep(Duration::from_millis(5));
    }
    what(&e.poller_stats()) == n
}

/// A lend of blocks 2 and 3 read by a peer with the same key: the read
/// finishes (confirmed by the lender: over tcp by its answer, over shared
/// memory by its lend word) with the lender's bytes, and the lend is
/// released by the reader's word.
fn keyed_engines_lend_and_read(tls: &str) {
    let mut p = engine(tls, Some(key()));
    for b in 0..BLOCKS as u32 {
        fill(&p, SEED, b);
    }
    let mut d = engine(tls, Some(key()));
    let peer = d.add_peer(&p.local_metadata().unwrap()).unwrap();
    p.add_peer(&d.local_metadata().unwrap()).unwrap();
    let id = RequestId(1);
    let lend = p
        .lend(id, &blocks(&[2, 3]), 1, Duration::from_secs(60))
        .unwrap();
    let (local, remote) = (blocks(&[7, 8]), blocks(&[2, 3]));
    d.read(id, &one(peer, &local, &remote, lend)).unwrap();
    let mut out = Outcomes::default();
    assert!(
        wait(&mut d, &mut out, GUARD, |o| reported(o, id)),
        "{out:?}"
    );
    assert_eq!(out.finished_recving, vec![id], "{out:?}");
    assert!(holds(&d, 7, SEED, 2) && holds(&d, 8, SEED, 3));
    let mut lent = Outcomes::default();
    assert!(
        wait(&mut p, &mut lent, GUARD, |o| reported(o, id)),
        "{lent:?}"
    );
    assert_eq!(lent.finished_sending, vec![id], "{lent:?}");
    for e in [&p, &d] {
        let s = e.poller_stats();
        assert_eq!(
            (s.unauthenticated_notifications, s.replayed_notifications),
            (0, 0),
            "{s:?}"
        );
    }
}

#[test]
fn keyed_engines_lend_read_and_confirm_over_tcp() {
    keyed_engines_lend_and_read(TCP);
}

#[test]
fn keyed_engines_lend_read_and_confirm_over_shared_memory() {
    keyed_engines_lend_and_read(SHM);
}

/// A push between engines with the same key: the write lands and is
/// acknowledged, the receive finishes.
#[test]
fn keyed_engines_push_and_acknowledge() {
    let mut src = engine(TCP, Some(key()));
    for b in 0..BLOCKS as u32 {
        fill(&src, SEED, b);
    }
    let mut dst = engine(TCP, Some(key()));
    let to_dst = src.add_peer(&dst.local_metadata().unwrap()).unwrap();
    let to_src = dst.add_peer(&src.local_metadata().unwrap()).unwrap();
    let id = RequestId(2);
    let token = dst
        .receive_from(id, &blocks(&[5]), &[to_src], Duration::from_secs(60))
        .unwrap();
    let (local, remote) = (blocks(&[1]), blocks(&[5]));
    src.write(
        id,
        &one(to_dst, &local, &remote, token),
        1,
        Duration::from_secs(60),
    )
    .unwrap();
    let mut out = Outcomes::default();
    assert!(
        wait(&mut src, &mut out, GUARD, |o| reported(o, id)),
        "{out:?}"
    );
    assert_eq!(out.finished_sending, vec![id], "{out:?}");
    let mut got = Outcomes::default();
    assert!(
        wait(&mut dst, &mut got, GUARD, |o| reported(o, id)),
        "{got:?}"
    );
    assert_eq!(got.finished_recving, vec![id], "{got:?}");
    assert!(holds(&dst, 5, SEED, 1));
}

fn refused_as(r: Result<PeerId, PeerError>) -> AuthError {
    match r {
        Err(PeerError::Unauthenticated(e)) => e,
        other => panic!("expected an unauthenticated refusal, got {other:?}"),
    }
}

#[test]
fn a_peer_without_the_key_is_refused_at_add_peer_both_ways_and_counted() {
    let mut keyed = engine(TCP, Some(key()));
    let mut plain = engine(TCP, None);
    let r = keyed.add_peer(&plain.local_metadata().unwrap());
    assert_eq!(refused_as(r), AuthError::Missing);
    let r = keyed.add_peer_any_block_size(&plain.local_metadata().unwrap());
    assert_eq!(refused_as(r), AuthError::Missing);
    let r = plain.add_peer(&keyed.local_metadata().unwrap());
    assert_eq!(refused_as(r), AuthError::Unexpected);
    assert_eq!(keyed.poller_stats().unauthenticated_peers, 2);
    assert_eq!(plain.poller_stats().unauthenticated_peers, 1);
    assert_eq!(keyed.metrics().rejected.unauthenticated_peers, 2);
    let e = kvpoll::Error::from(PeerError::Unauthenticated(AuthError::Missing));
    assert_eq!(e.kind(), kvpoll::ErrorKind::Peer);
}

#[test]
fn a_peer_with_another_key_is_refused_at_add_peer_and_counted() {
    let mut ours = engine(TCP, Some(key()));
    let mut theirs = engine(TCP, Some(other_key()));
    let r = ours.add_peer(&theirs.local_metadata().unwrap());
    assert_eq!(refused_as(r), AuthError::BadTag);
    let r = theirs.add_peer(&ours.local_metadata().unwrap());
    assert_eq!(refused_as(r), AuthError::BadTag);
    assert_eq!(ours.poller_stats().unauthenticated_peers, 1);
    assert_eq!(theirs.poller_stats().unauthenticated_peers, 1);
}

/// Metadata of the previous frame version (3, untagged): a typed error.
#[test]
fn an_older_peers_metadata_is_a_typed_error() {
    let mut e = engine(TCP, None);
    let other = engine(TCP, None);
    let mut old = other.local_metadata().unwrap();
    old[5] = 3;
    let n = old.len() - 8;
    let sum = fnv1a64(&old[..n]);
    old[n..].copy_from_slice(&sum.to_le_bytes());
    match e.add_peer(&old) {
        Err(PeerError::Metadata(MetadataError::Frame(FrameError::WrongVersion { got: 3 }))) => {}
        other => panic!("{other:?}"),
    }
}

/// A raw UCX worker connected to `e`, outside any engine.
fn raw_sender(e: &Engine) -> (Worker, Endpoint) {
    let meta = PeerMetadata::decode(&e.local_metadata().unwrap()).unwrap();
    let ctx = kvpoll::transport::ucx::Context::new(&ContextOptions::with_transports(TCP)).unwrap();
    let w = Worker::new(&ctx).unwrap();
    let ep = Endpoint::connect(&w, &meta.worker, 1).unwrap();
    (w, ep)
}

/// Sends `message` to `ep` as engines send notifications, and waits for
/// the send to complete.
fn send(w: &Worker, ep: &Endpoint, message: &[u8], token: u64) {
    ep.send_active_message(NOTIFY_AM_ID, message, token)
        .unwrap();
    let mut done = Vec::new();
    let t = Instant::now();
    while !done
        .iter()
        .any(|c: &kvpoll::transport::ucx::Completion| c.token == token)
    {
        w.progress();
        w.take_completions(&mut done);
        assert!(t.elapsed() < GUARD, "the send never completed");
    }
}

fn give_up(sender: u64) -> [u8; kvpoll::notification::LEN] {
    Notification {
        kind: NoteKind::GaveUp,
        id: RequestId(40),
        incarnation: Incarnation(0x5eed),
        nonce: Incarnation(3),
        sender,
        blocks: kvpoll::notification::BlocksRead::NONE,
    }
    .encode()
}

/// An untagged message, and one tagged with another key for this very
/// engine, never reach its ledger: each is counted as unauthenticated.
#[test]
fn a_note_without_the_key_or_with_another_is_dropped_and_counted() {
    let p = engine(TCP, Some(key()));
    let instance = PeerMetadata::decode(&p.local_metadata().unwrap())
        .unwrap()
        .instance;
    let (w, ep) = raw_sender(&p);
    let note = give_up(77);
    send(&w, &ep, &note, 1);
    assert!(
        counted(&p, 1, |s| s.unauthenticated_notifications),
        "{:?}",
        p.poller_stats()
    );
    let mut forger = Sealer::new(other_key());
    let forged = [&note[..], &forger.seal(instance, &note)].concat();
    send(&w, &ep, &forged, 2);
    assert!(
        counted(&p, 2, |s| s.unauthenticated_notifications),
        "{:?}",
        p.poller_stats()
    );
    // Held past the grace period, a note that reached the ledger would
    // have been counted as rejected by now.
    std::thread::sleep(Duration::from_millis(600));
    let s = p.poller_stats();
    assert_eq!(
        (s.rejected_notifications, s.malformed_notifications),
        (0, 0),
        "{s:?}"
    );
    assert_eq!(p.metrics().rejected.unauthenticated_notifications, 2);
}

/// A copy of a genuine message: a keyed engine sends a note to what it
/// takes for `p` (a raw transport announcing `p`'s instance, with the
/// key), which captures it and delivers it to `p` twice. The first copy
/// is accepted (it reaches the ledger), the second dropped as replayed.
#[test]
fn a_replayed_note_is_dropped_and_counted() {
    let p = engine(TCP, Some(key()));
    let p_instance = PeerMetadata::decode(&p.local_metadata().unwrap())
        .unwrap()
        .instance;
    let mut d = engine(TCP, Some(key()));
    let mut tap = UcxTransport::new(&ContextOptions::with_transports(TCP), BS).unwrap();
    // SAFETY: no caller memory: UCX allocates the region.
    unsafe { tap.register(BLOCKS, (BLOCKS * BS) as usize, None).unwrap() };
    let mut posing = PeerMetadata::decode(&tap.metadata(7).unwrap()).unwrap();
    posing.instance = p_instance;
    let peer = d.add_peer(&posing.encode_keyed(Some(&key()))).unwrap();
    d.notify_only(RequestId(99), &[(peer, Incarnation(0xabc))])
        .unwrap();
    let mut captured = None;
    let t = Instant::now();
    while captured.is_none() {
        tap.progress();
        tap.drain(&mut |ev| {
            if let TransportEvent::Message { payload, .. } = ev {
                captured = Some(payload.to_vec());
            }
        });
        assert!(t.elapsed() < GUARD, "the note never arrived");
    }
    let message = captured.unwrap();
    let (w, ep) = raw_sender(&p);
    send(&w, &ep, &message, 1);
    // The genuine copy reaches the ledger: held for the grace period, then
    // rejected (no lend of that incarnation).
    assert!(
        counted(&p, 1, |s| s.rejected_notifications),
        "{:?}",
        p.poller_stats()
    );
    assert_eq!(p.poller_stats().replayed_notifications, 0);
    send(&w, &ep, &message, 2);
    assert!(
        counted(&p, 1, |s| s.replayed_notifications),
        "{:?}",
        p.poller_stats()
    );
    std::thread::sleep(Duration::from_millis(600));
    let s = p.poller_stats();
    assert_eq!(
        (s.rejected_notifications, s.unauthenticated_notifications),
        (1, 0),
        "the copy reached the ledger: {s:?}"
    );
    assert_eq!(p.metrics().rejected.replayed_notifications, 1);
}

/// The suites run keyed by setting `KVPOLL_TEST_AUTH_KEY` (a test hook):
/// every engine whose builder was given no key takes that one, and one
/// given a key (or none, explicitly) keeps it.
#[test]
fn a_keyed_run_gives_every_engine_built_without_a_key_the_suites_key_and_no_other() {
    let keyed_run = std::env::var_os(kvpoll::engine::TEST_AUTH_ENV).is_some_and(|s| !s.is_empty());
    let mut plain = Engine::builder()
        .block_size(BS)
        .ucx(ContextOptions::with_transports(TCP))
        .build()
        .unwrap();
    plain.register(BLOCKS).unwrap();
    let keyless = engine(TCP, None);
    let mut keyed = engine(TCP, Some(key()));
    let with_none = plain.add_peer(&keyless.local_metadata().unwrap());
    assert_eq!(
        with_none.is_err(),
        keyed_run,
        "an engine built without a key, beside one explicitly without: {with_none:?}"
    );
    // The explicitly keyed engine kept its own key, not the suite's.
    let own = keyed.add_peer(&plain.local_metadata().unwrap());
    assert!(own.is_err(), "{own:?}");
}
