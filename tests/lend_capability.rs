//! What a lend's incarnation lets a reader do, over real UCX through the
//! public API: it confirms a read of the blocks that lend lent (all of
//! them, a run of them, part of each) and nothing else. A read of another
//! live lend's blocks, or of blocks not lent at all, under a live
//! incarnation fails `NotLent` and is never reported finished — whether
//! the reader asks its lender (tcp) or reads the lender's lend word
//! (shared memory). An incarnation the lender can tell was never lent is
//! refused on the lender's first answer, not at the read's deadline; a
//! refused read, and a note naming an incarnation nobody lent, are counted
//! where an operator sees them.

mod common;

use std::time::{Duration, Instant};

use kvpoll::engine::{Engine, Outcomes};
use kvpoll::ledger::{BlockId, Cause, Incarnation, RequestId};
use kvpoll::PeerId;

use common::{fill_block as fill, holds_block as holds, one, reported, try_wait as wait};

const BS: u64 = 4096;
const BLOCKS: u64 = 16;
const GUARD: Duration = Duration::from_secs(10);
const TCP: &str = "tcp";
const SHM: &str = "posix,sysv,cma";
/// A lender's pattern seed.
const SEED: u64 = 3;

fn engine_over(tls: &str, grace: Duration) -> Engine {
    common::engine_with_grace(tls, grace, BS, BLOCKS)
}

/// A lender whose every block holds its pattern, a reader, and the
/// reader's peer id for the lender.
fn lender_and_reader(tls: &str) -> (Engine, Engine, PeerId) {
    let p = engine_over(tls, Duration::from_secs(5));
    for b in 0..BLOCKS as u32 {
        fill(&p, SEED, b);
    }
    let mut d = engine_over(tls, Duration::from_secs(5));
    let peer = d.add_peer(&p.local_metadata().unwrap()).unwrap();
    (p, d, peer)
}

fn blocks(ids: &[u32]) -> Vec<BlockId> {
    ids.iter().copied().map(BlockId).collect()
}

/// Reads `remote` of the lender into `local` as request `id` under `lend`
/// and waits for the report: its cause if it failed, `None` if it
/// finished.
fn read_once(
    d: &mut Engine,
    peer: PeerId,
    id: RequestId,
    local: &[u32],
    remote: &[u32],
    lend: Incarnation,
) -> Option<Cause> {
    let (local, remote) = (blocks(local), blocks(remote));
    d.read(id, &one(peer, &local, &remote, lend)).unwrap();
    let mut out = Outcomes::default();
    assert!(
        wait(d, &mut out, GUARD, |o| reported(o, id)),
        "read {id:?} never reported: {out:?}"
    );
    if out.finished_recving.contains(&id) {
        return None;
    }
    Some(out.failed_recving[0].reason.cause)
}

/// Lends 4 (blocks 0 and 1) and 5 (blocks 2 and 3), a reader each, an
/// hour's lease; their incarnations.
fn two_lends(p: &mut Engine) -> (Incarnation, Incarnation) {
    let hour = Duration::from_secs(3600);
    let four = p.lend(RequestId(4), &blocks(&[0, 1]), 1, hour).unwrap();
    let five = p.lend(RequestId(5), &blocks(&[2, 3]), 1, hour).unwrap();
    (four, five)
}

fn another_lends_blocks_are_not_confirmed(tls: &str) {
    let (mut p, mut d, peer) = lender_and_reader(tls);
    let (four, _five) = two_lends(&mut p);
    // Request 4 under lend 4's live incarnation, but lend 5's blocks.
    let cause = read_once(&mut d, peer, RequestId(4), &[8, 9], &[2, 3], four);
    assert_eq!(
        cause,
        Some(Cause::NotLent),
        "a read of lend 5's blocks under lend 4's incarnation"
    );
    let mut out = Outcomes::default();
    p.poll(&mut out);
    assert!(
        !reported(&out, RequestId(5)),
        "lend 5 was touched by a read of lend 4: {out:?}"
    );
    // Counted on both sides, where an operator sees them.
    assert!(counted(&d, |s| s.reads_not_lent), "{:?}", d.poller_stats());
    assert!(counted(&p, |s| s.refused_reads), "{:?}", p.poller_stats());
    assert!(p.poller_stats().rejected_notifications >= 1);
    assert_eq!(p.metrics().rejected.not_lent_reads, 1);
    assert_eq!(d.metrics().requests.failed_recving, 1);
}

/// Whether `e`'s poller counted `what` (its counters are published as it
/// goes idle).
fn counted(e: &Engine, what: impl Fn(&kvpoll::PollerStats) -> u64) -> bool {
    let t = Instant::now();
    while what(&e.poller_stats()) != 1 && t.elapsed() < GUARD {
        std::thread::sleep(Duration::from_millis(5));
    }
    what(&e.poller_stats()) == 1
}

#[test]
fn a_read_of_another_live_lends_blocks_fails_not_lent_when_the_reader_asks() {
    another_lends_blocks_are_not_confirmed(TCP);
}

#[test]
fn a_read_of_another_live_lends_blocks_fails_not_lent_when_the_lend_word_is_read() {
    another_lends_blocks_are_not_confirmed(SHM);
}

/// Over tcp the lender serves a read's bytes itself, so it checks the
/// blocks against the live lend the read names before any byte leaves:
/// the reader's blocks keep what they held.
#[test]
fn over_tcp_a_read_of_another_lends_blocks_is_refused_before_any_byte_leaves_the_lender() {
    let (mut p, mut d, peer) = lender_and_reader(TCP);
    const OWN: u64 = 99;
    for b in [8, 9] {
        fill(&d, OWN, b);
    }
    let (four, _five) = two_lends(&mut p);
    let cause = read_once(&mut d, peer, RequestId(4), &[8, 9], &[2, 3], four);
    assert_eq!(cause, Some(Cause::NotLent));
    for b in [8, 9] {
        assert!(
            holds(&d, b, OWN, b),
            "block {b}: bytes of lend 5's blocks left the lender"
        );
    }
    assert!(counted(&p, |s| s.refused_reads), "{:?}", p.poller_stats());
    assert!(counted(&d, |s| s.reads_not_lent), "{:?}", d.poller_stats());
    // Lend 5 is untouched: its own reader reads it whole.
    let five = {
        let mut out = Outcomes::default();
        p.poll(&mut out);
        assert!(!reported(&out, RequestId(5)), "{out:?}");
        _five
    };
    assert_eq!(
        read_once(&mut d, peer, RequestId(5), &[10, 11], &[2, 3], five),
        None
    );
    assert!(holds(&d, 10, SEED, 2) && holds(&d, 11, SEED, 3));
}

fn blocks_not_lent_are_not_confirmed(tls: &str) {
    let (mut p, mut d, peer) = lender_and_reader(tls);
    let (four, _five) = two_lends(&mut p);
    // Blocks 6 and 7 are free in the lender's pool; block 1 is lend 4's
    // but block 7 is not.
    let free = read_once(&mut d, peer, RequestId(4), &[8, 9], &[6, 7], four);
    assert_eq!(free, Some(Cause::NotLent), "a read of free blocks");
    // The failed read gave lend 4 up; lend its blocks again.
    let mut out = Outcomes::default();
    assert!(wait(&mut p, &mut out, GUARD, |o| reported(o, RequestId(4))));
    let again = p.lend(RequestId(4), &blocks(&[0, 1]), 1, GUARD).unwrap();
    let part = read_once(&mut d, peer, RequestId(4), &[8, 9], &[1, 7], again);
    assert_eq!(part, Some(Cause::NotLent), "a read of one lent, one free");
}

#[test]
fn a_read_of_blocks_not_lent_fails_not_lent_when_the_reader_asks() {
    blocks_not_lent_are_not_confirmed(TCP);
}

#[test]
fn a_read_of_blocks_not_lent_fails_not_lent_when_the_lend_word_is_read() {
    blocks_not_lent_are_not_confirmed(SHM);
}

fn a_run_of_the_lend_or_part_of_each_block_finishes(tls: &str) {
    let (mut p, mut d, peer) = lender_and_reader(tls);
    let hour = Duration::from_secs(3600);
    // Lent in this order: a reader with a local prefix reads the last two.
    let lent = [5, 1, 9, 3];
    let inc = p.lend(RequestId(20), &blocks(&lent), 2, hour).unwrap();
    let suffix = read_once(&mut d, peer, RequestId(20), &[10, 11], &[9, 3], inc);
    assert_eq!(suffix, None, "a read of the lend's last two blocks");
    assert!(holds(&d, 10, SEED, 9) && holds(&d, 11, SEED, 3));
    // A second reader engine reads the first half of every block.
    let mut e = engine_over(tls, Duration::from_secs(5));
    let peer_e = e.add_peer(&p.local_metadata().unwrap()).unwrap();
    let (local, remote) = (blocks(&[0, 1, 2, 3]), blocks(&lent));
    let half = kvpoll::Transfer {
        peer: peer_e,
        local: &local,
        remote: &remote,
        lend: inc,
    }
    .part(0..BS / 2, 0..BS / 2);
    e.read_parts(RequestId(20), &[half], None).unwrap();
    let mut out = Outcomes::default();
    assert!(wait(&mut e, &mut out, GUARD, |o| reported(
        o,
        RequestId(20)
    )));
    assert_eq!(out.finished_recving, [RequestId(20)], "{out:?}");
    let mut pout = Outcomes::default();
    assert!(wait(&mut p, &mut pout, GUARD, |o| reported(
        o,
        RequestId(20)
    )));
    assert_eq!(
        pout.finished_sending,
        [RequestId(20)],
        "both readers counted"
    );
}

#[test]
fn a_read_of_a_run_of_the_lend_or_part_of_each_block_finishes_when_the_reader_asks() {
    a_run_of_the_lend_or_part_of_each_block_finishes(TCP);
}

#[test]
fn a_read_of_a_run_of_the_lend_or_part_of_each_block_finishes_when_the_lend_word_is_read() {
    a_run_of_the_lend_or_part_of_each_block_finishes(SHM);
}

/// A read's deadline well within the grace period: a refusal must come
/// from the lender's first answer, not the deadline.
const DEADLINE: Duration = Duration::from_secs(3);
const PROMPT: Duration = Duration::from_secs(1);

/// Reads `id` with `lend` (its deadline [`DEADLINE`]); its cause and how
/// long the report took.
fn refused(
    d: &mut Engine,
    peer: PeerId,
    id: RequestId,
    remote: u32,
    lend: Incarnation,
) -> (Option<Cause>, Duration) {
    let (local, remote) = ([BlockId(12)], [BlockId(remote)]);
    let t = Instant::now();
    d.read_with_deadline(id, &one(peer, &local, &remote, lend), DEADLINE)
        .unwrap();
    let mut out = Outcomes::default();
    assert!(wait(d, &mut out, GUARD, |o| reported(o, id)), "{out:?}");
    let cause = out.failed_recving.first().map(|f| f.reason.cause);
    (cause, t.elapsed())
}

/// A forged incarnation for a request id the lender has lent under
/// another: no lend of that id can begin while this one lives, so the
/// question is refused at once. So is a live incarnation named with
/// another request id.
#[test]
fn a_forged_incarnation_is_refused_on_the_lenders_first_answer() {
    let (mut p, mut d, peer) = lender_and_reader(TCP);
    let six = p
        .lend(RequestId(6), &blocks(&[4]), 1, Duration::from_secs(3600))
        .unwrap();
    let (cause, took) = refused(&mut d, peer, RequestId(6), 4, Incarnation::draw());
    assert_eq!(cause, Some(Cause::NotLent), "a forged incarnation");
    assert!(took < PROMPT, "refused only after {took:?}");
    let (cause, took) = refused(&mut d, peer, RequestId(7), 4, six);
    assert_eq!(cause, Some(Cause::NotLent), "lend 6's incarnation for 7");
    assert!(took < PROMPT, "refused only after {took:?}");
    let mut out = Outcomes::default();
    p.poll(&mut out);
    assert!(!reported(&out, RequestId(6)), "lend 6 was touched: {out:?}");
}

/// An incarnation for an id the lender holds nothing of cannot be told
/// from a lend not submitted yet: the lender answers pending. A read
/// whose deadline passes while it is only waiting for that lend fails
/// `NotLent` (the lender answered: it is not stalled), not `Deadline`.
#[test]
fn a_read_waiting_for_a_lend_that_never_comes_fails_not_lent_at_its_deadline() {
    let (_p, mut d, peer) = lender_and_reader(TCP);
    let (cause, took) = refused(&mut d, peer, RequestId(8), 4, Incarnation::draw());
    assert_eq!(cause, Some(Cause::NotLent), "after {took:?}");
    assert!(took >= DEADLINE, "refused before the deadline: {took:?}");
}

/// A well-formed note naming an incarnation nobody lent (here a give-up,
/// which the lender holds for the grace period in case its lend comes) is
/// counted as rejected once it is dropped.
#[test]
fn a_note_for_an_incarnation_nobody_lent_is_counted_as_rejected() {
    let grace = Duration::from_millis(300);
    let p = engine_over(TCP, grace);
    let mut d = engine_over(TCP, grace);
    let peer = d.add_peer(&p.local_metadata().unwrap()).unwrap();
    let before = p.poller_stats().rejected_notifications;
    d.notify_only(RequestId(99), &[(peer, Incarnation::draw())])
        .unwrap();
    let t = Instant::now();
    while p.poller_stats().rejected_notifications == before && t.elapsed() < GUARD {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        p.poller_stats().rejected_notifications,
        before + 1,
        "the forged note was dropped uncounted after {:?}",
        t.elapsed()
    );
    assert!(t.elapsed() >= grace / 2, "counted before its grace");
    assert_eq!(p.metrics().rejected.notifications, 1);
}
