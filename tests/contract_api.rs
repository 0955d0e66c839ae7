//! API that closed contract breaks of an earlier poller, pinned over real UCX.
//!
//! This file names what does not exist before the fix —
//! `Engine::read_with_deadline`, `Engine::notify_only`,
//! `Outcomes::failed_sending`, `Cause::PeerStalled`, `Cause::Shutdown`,
//! `SubmitError::RequestTooLarge` and `RegionError::Frozen` — so on
//! the old code it does not compile; that is expected. The behaviours
//! themselves are in `tests/contract.rs`, which compiles on both.

mod common;

use std::time::{Duration, Instant};

use kvpoll::engine::{Engine, Outcomes, RegionError, SubmitError, Transfer};
#[cfg(feature = "fault-injection")]
use kvpoll::ledger::Cause;
use kvpoll::ledger::{BlockId, Incarnation, PeerId, RequestId};
use kvpoll::transport::ucx::ContextOptions;

use common::{pattern, reported};

const BS: u64 = 4096;
const BLOCKS: u64 = 64;
const REGIONS: usize = 2;
const GUARD: Duration = Duration::from_secs(10);

fn engine() -> Engine {
    let mut e = Engine::builder()
        .block_size(BS)
        .ucx(ContextOptions::with_transports("tcp"))
        // These tests read memory that no lend guards; lend confirmation
        // has its own tests (tests/fencing.rs, tests/core_sim.rs).
        .confirm_reads(false)
        .build()
        .expect("engine");
    for _ in 0..REGIONS {
        e.register(BLOCKS).unwrap();
    }
    e
}

#[cfg(feature = "fault-injection")]
fn fill(e: &Engine, rank: u64) {
    let mut buf = vec![0u8; BS as usize];
    for r in 0..REGIONS {
        for b in 0..BLOCKS {
            pattern::fill(rank * 100 + r as u64, b, &mut buf);
            e.write_block(r, BlockId(b as u32), &buf).unwrap();
        }
    }
}

#[cfg(feature = "fault-injection")]
fn holds(e: &Engine, local: u32, rank: u64, remote: u32) -> bool {
    let mut buf = vec![0u8; BS as usize];
    (0..REGIONS).all(|r| {
        e.read_block(r, BlockId(local), &mut buf).unwrap();
        pattern::check(rank * 100 + r as u64, u64::from(remote), &buf)
    })
}

fn ids(v: &[u32]) -> Vec<BlockId> {
    v.iter().map(|&b| BlockId(b)).collect()
}

fn connect(from: &mut Engine, to: &Engine) -> PeerId {
    from.add_peer(&to.local_metadata().unwrap()).unwrap()
}

/// One handle of an unconfirmed read (memory no lend guards).
fn one<'a>(peer: PeerId, local: &'a [BlockId], remote: &'a [BlockId]) -> [Transfer<'a>; 1] {
    common::one(peer, local, remote, Incarnation::NONE)
}

fn wait_for(e: &mut Engine, out: &mut Outcomes, what: &str, done: impl Fn(&Outcomes) -> bool) {
    let t = Instant::now();
    loop {
        e.poll(out);
        if done(out) {
            return;
        }
        assert!(t.elapsed() < GUARD, "timed out waiting for {what}: {out:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[cfg(feature = "fault-injection")]
/// A first read from `peer`, so that the endpoint is wired up before a test
/// stalls anyone (an engine dropped while UCX's wire-up is still in flight
/// can make the peer's `ucp_worker_destroy` abort the process).
fn warm(d: &mut Engine, peer: PeerId, id: RequestId) {
    d.read(id, &one(peer, &ids(&[63]), &ids(&[63]))).unwrap();
    let mut out = Outcomes::default();
    wait_for(d, &mut out, "the warm-up read", |o| reported(o, id));
    assert_eq!(out.finished_recving, vec![id], "{out:?}");
}

/// A full prefix hit on the consumer: nothing to read, but the producer's
/// lend is released (`finished_sending`), and the consumer reports nothing.
#[test]
fn notify_only_releases_each_producers_lend_and_reports_nothing_on_the_consumer() {
    let (mut p0, mut p1) = (engine(), engine());
    let mut d = engine();
    let (a, b) = (connect(&mut d, &p0), connect(&mut d, &p1));
    let id = RequestId(1);
    let l0 = p0.lend(id, &ids(&[1, 2]), 1, GUARD).unwrap();
    let l1 = p1.lend(id, &ids(&[3]), 1, GUARD).unwrap();
    d.notify_only(id, &[(a, l0), (b, l1)]).unwrap();
    for p in [&mut p0, &mut p1] {
        let mut o = Outcomes::default();
        wait_for(p, &mut o, "the release", |o| reported(o, id));
        assert_eq!(o.finished_sending, vec![id], "{o:?}");
    }
    let mut o = Outcomes::default();
    d.poll(&mut o);
    assert!(o.is_empty(), "notify-only reported on the consumer: {o:?}");
    assert_eq!(d.in_flight(), 0);
}

#[cfg(feature = "fault-injection")]
/// An aborted write keeps its reason, in `failed_sending`, not `expired`.
#[test]
fn an_aborted_write_is_reported_in_failed_sending_with_its_reason() {
    let mut p = engine();
    let mut c = engine();
    let to_c = connect(&mut p, &c);
    let id = RequestId(2);
    let dst = ids(&[30, 31]);
    warm(&mut p, to_c, RequestId(100));
    let lend = c.receive(id, &dst, 1, GUARD).unwrap();
    // No ack can come while the consumer is stalled.
    c.stall(Duration::from_millis(1500)).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    p.write(id, &common::one(to_c, &ids(&[1, 2]), &dst, lend), 1, GUARD)
        .unwrap();
    p.abort(id).unwrap();
    let mut out = Outcomes::default();
    wait_for(&mut p, &mut out, "the aborted write", |o| reported(o, id));
    assert_eq!(out.failed_sending.len(), 1, "{out:?}");
    assert_eq!(out.failed_sending[0].id, id);
    assert_eq!(out.failed_sending[0].reason.cause, Cause::Aborted);
    assert!(
        out.expired.is_empty() && out.finished_sending.is_empty(),
        "{out:?}"
    );
}

#[cfg(feature = "fault-injection")]
/// One read hits its own (short) deadline: `Deadline`. Its sibling on the
/// same stalled producer, whose deadline is long, fails because the
/// endpoint was force-closed: `PeerStalled`. A new read after the producer
/// resumes finishes.
#[test]
fn per_request_deadlines_fail_the_sibling_as_peer_stalled() {
    let mut p = engine();
    fill(&p, 3);
    let mut d = engine();
    let peer = connect(&mut d, &p);
    warm(&mut d, peer, RequestId(100));
    let stall = Duration::from_millis(2000);
    p.stall(stall).unwrap();
    let stalled_at = Instant::now();
    std::thread::sleep(Duration::from_millis(50));
    let (short, long) = (RequestId(3), RequestId(4));
    d.read_with_deadline(
        short,
        &one(peer, &ids(&[0]), &ids(&[0])),
        Duration::from_millis(500),
    )
    .unwrap();
    d.read_with_deadline(
        long,
        &one(peer, &ids(&[1]), &ids(&[1])),
        Duration::from_secs(30),
    )
    .unwrap();
    let mut out = Outcomes::default();
    wait_for(&mut d, &mut out, "both reads", |o| {
        reported(o, short) && reported(o, long)
    });
    let cause = |id| {
        out.failed_recving
            .iter()
            .find(|f| f.id == id)
            .map(|f| f.reason.cause)
    };
    assert_eq!(cause(short), Some(Cause::Deadline), "{out:?}");
    assert_eq!(cause(long), Some(Cause::PeerStalled), "{out:?}");

    while stalled_at.elapsed() < stall + Duration::from_millis(200) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let again = RequestId(5);
    d.read_with_deadline(again, &one(peer, &ids(&[2]), &ids(&[12])), GUARD)
        .unwrap();
    let mut out = Outcomes::default();
    wait_for(&mut d, &mut out, "the read after the stall", |o| {
        reported(o, again)
    });
    assert_eq!(out.finished_recving, vec![again], "{out:?}");
    assert!(holds(&d, 2, 3, 12));
}

#[cfg(feature = "fault-injection")]
/// A read in flight when the engine shuts down fails with `Shutdown`.
#[test]
fn requests_cancelled_by_shutdown_fail_with_cause_shutdown() {
    let mut p = engine();
    let mut d = engine();
    let peer = connect(&mut d, &p);
    warm(&mut d, peer, RequestId(100));
    p.stall(Duration::from_millis(1500)).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let id = RequestId(6);
    d.read(id, &one(peer, &ids(&[0]), &ids(&[0]))).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    d.shutdown();
    let mut out = Outcomes::default();
    d.poll(&mut out);
    assert_eq!(out.failed_recving.len(), 1, "{out:?}");
    assert_eq!(out.failed_recving[0].id, id);
    assert_eq!(out.failed_recving[0].reason.cause, Cause::Shutdown);
    assert_eq!(d.in_flight(), 0);
}

/// More entries than the command ring holds: `RequestTooLarge`, not
/// `RingFull` (which means "retry").
#[test]
fn a_request_larger_than_the_command_ring_is_request_too_large() {
    let mut d = Engine::builder()
        .confirm_reads(false)
        .block_size(BS)
        .ucx(ContextOptions::with_transports("tcp"))
        .command_ring(64)
        .build()
        .unwrap();
    d.register(128).unwrap();
    let mut p = Engine::builder()
        .block_size(BS)
        .ucx(ContextOptions::with_transports("tcp"))
        .build()
        .unwrap();
    p.register(128).unwrap();
    let peer = connect(&mut d, &p);
    let blocks: Vec<BlockId> = (0..100).map(BlockId).collect();
    let r = d.read(RequestId(7), &one(peer, &blocks, &blocks));
    assert!(
        matches!(r, Err(SubmitError::RequestTooLarge { .. })),
        "{r:?}"
    );
    assert_eq!(d.in_flight(), 0);
}

/// Registering after a peer was added would leave that peer's view of our
/// regions (and ours of its) stale: `RegionError::Frozen`, and nothing changes.
#[test]
fn register_after_add_peer_is_regions_frozen() {
    let mut p = Engine::builder()
        .block_size(BS)
        .ucx(ContextOptions::with_transports("tcp"))
        .build()
        .unwrap();
    p.register(BLOCKS).unwrap();
    fill_one(&p);
    let mut d = Engine::builder()
        .confirm_reads(false)
        .block_size(BS)
        .ucx(ContextOptions::with_transports("tcp"))
        .build()
        .unwrap();
    d.register(BLOCKS).unwrap();
    let peer = connect(&mut d, &p);
    let r = d.register(BLOCKS);
    assert!(matches!(r, Err(RegionError::Frozen)), "{r:?}");
    // Nothing changed: a read from the peer still works.
    let id = RequestId(8);
    d.read(id, &one(peer, &ids(&[4]), &ids(&[14]))).unwrap();
    let mut out = Outcomes::default();
    wait_for(&mut d, &mut out, "the read", |o| reported(o, id));
    assert_eq!(out.finished_recving, vec![id], "{out:?}");
    let mut buf = vec![0u8; BS as usize];
    d.read_block(0, BlockId(4), &mut buf).unwrap();
    assert!(pattern::check(900, 14, &buf));
}

fn fill_one(e: &Engine) {
    let mut buf = vec![0u8; BS as usize];
    for b in 0..BLOCKS {
        pattern::fill(900, b, &mut buf);
        e.write_block(0, BlockId(b as u32), &buf).unwrap();
    }
}

#[cfg(feature = "fault-injection")]
/// A poller that dies (here: a panic injected at
/// its second post) is visible. Its requests in flight are reported failed
/// with `Cause::PollerDied`, exactly once, and every later call says
/// `Stopped::PollerDied` instead of returning `Ok` into the void.
#[test]
fn a_dead_poller_reports_its_requests_failed_and_refuses_further_calls() {
    let p = engine();
    fill(&p, 3);
    let mut d = Engine::builder()
        .confirm_reads(false)
        .block_size(BS)
        .ucx(ContextOptions::with_transports("tcp"))
        .faults(kvpoll::engine::Faults {
            panic_at_post: 2,
            ..Default::default()
        })
        .build()
        .expect("engine");
    for _ in 0..REGIONS {
        d.register(BLOCKS).unwrap();
    }
    let peer = connect(&mut d, &p);
    let (l, r) = (ids(&[1]), ids(&[2]));
    d.read(RequestId(1), &one(peer, &l, &r)).unwrap();
    let mut out = Outcomes::default();
    wait_for(&mut d, &mut out, "the first read", |o| {
        o.finished_recving.contains(&RequestId(1))
    });
    // The second post panics the poller.
    let (l2, r2) = (ids(&[3]), ids(&[4]));
    d.read(RequestId(2), &one(peer, &l2, &r2)).unwrap();
    let mut out = Outcomes::default();
    wait_for(&mut d, &mut out, "the orphaned read's failure", |o| {
        !o.failed_recving.is_empty()
    });
    assert_eq!(out.failed_recving.len(), 1, "{out:?}");
    assert_eq!(out.failed_recving[0].id, RequestId(2));
    assert_eq!(out.failed_recving[0].reason.cause, Cause::PollerDied);
    assert_eq!(d.in_flight(), 0);
    let again = d.read(RequestId(3), &one(peer, &l, &r));
    assert!(
        matches!(
            again,
            Err(SubmitError::Stopped(kvpoll::Stopped::PollerDied))
        ),
        "{again:?}"
    );
    assert!(matches!(
        d.local_metadata(),
        Err(kvpoll::PeerError::Stopped(kvpoll::Stopped::PollerDied))
    ));
    d.poll(&mut out);
    assert_eq!(out.failed_recving.len(), 1, "reported twice: {out:?}");
}
