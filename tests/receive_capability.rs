//! What a receive's incarnation lets a writer do (push), over real UCX
//! through the public API: its word counts only for the blocks of that
//! receive. A writer that wrote another live receive's blocks, or blocks
//! no receive opened, under a live receive's incarnation is refused on the
//! destination's first answer: the write fails `NotLent`, the receive it
//! named fails `NotLent` and is never reported finished, a live receive
//! whose blocks it wrote is never reported finished either (they may hold
//! its bytes: that receive's own writer is refused too), and both sides
//! count each refusal where an operator sees it.

mod common;

use std::time::{Duration, Instant};

use kvpoll::engine::{Engine, Outcomes};
use kvpoll::ledger::{BlockId, Cause, Incarnation, RequestId};
use kvpoll::PeerId;

use common::{fill_block as fill, holds_block as holds, one, reported, try_wait as wait};

const BS: u64 = 4096;
const BLOCKS: u64 = 16;
/// Long enough that nothing here ends by its lease.
const HOUR: Duration = Duration::from_secs(3600);
const GUARD: Duration = Duration::from_secs(10);
const TCP: &str = "tcp";
const SHM: &str = "posix,sysv,cma";
/// The writer's pattern.
const SEED: u64 = 5;

fn engine_over(tls: &str) -> Engine {
    common::engine_with_grace(tls, Duration::from_secs(5), BS, BLOCKS)
}

fn blocks(ids: &[u32]) -> Vec<BlockId> {
    ids.iter().copied().map(BlockId).collect()
}

/// A destination with receives 4 (blocks 0 and 1) and 5 (blocks 2 and 3),
/// a writer whose every block holds its pattern, each the other's peer;
/// the writer's peer id for the destination and the two incarnations.
struct Pair {
    d: Engine,
    w: Engine,
    to_d: PeerId,
    four: Incarnation,
    five: Incarnation,
}

fn pair(tls: &str) -> Pair {
    let mut d = engine_over(tls);
    let mut w = engine_over(tls);
    for b in 0..BLOCKS as u32 {
        fill(&w, SEED, b);
    }
    let to_d = w.add_peer(&d.local_metadata().unwrap()).unwrap();
    // The destination acknowledges (and refuses) through its own endpoint.
    d.add_peer(&w.local_metadata().unwrap()).unwrap();
    let four = d.receive(RequestId(4), &blocks(&[0, 1]), 1, HOUR).unwrap();
    let five = d.receive(RequestId(5), &blocks(&[2, 3]), 1, HOUR).unwrap();
    Pair {
        d,
        w,
        to_d,
        four,
        five,
    }
}

/// Writes the writer's blocks 8.. into `remote` of the destination as
/// request `id` under `token`; the write's cause if it failed, `None` if
/// it finished. Panics if it is not reported within the guard (a write
/// the destination refused must not wait out its lease).
fn write_once(p: &mut Pair, id: RequestId, remote: &[u32], token: Incarnation) -> Option<Cause> {
    let local: Vec<u32> = (8..8 + remote.len() as u32).collect();
    let (local, remote) = (blocks(&local), blocks(remote));
    p.w.write(id, &one(p.to_d, &local, &remote, token), 1, HOUR)
        .unwrap();
    let mut out = Outcomes::default();
    let t = Instant::now();
    while !reported(&out, id) && t.elapsed() < GUARD {
        // The destination's poller answers on its own; polling it here
        // also collects nothing the assertions below need.
        p.w.poll(&mut out);
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(reported(&out, id), "write {id:?} never reported: {out:?}");
    if out.finished_sending.contains(&id) {
        return None;
    }
    assert!(out.expired.is_empty(), "{out:?}");
    Some(out.failed_sending[0].reason.cause)
}

/// Whether `what` of `e`'s poller stats reaches `n` (its counters are
/// published as it goes idle).
fn counted(e: &Engine, n: u64, what: impl Fn(&kvpoll::PollerStats) -> u64) -> bool {
    let t = Instant::now();
    while what(&e.poller_stats()) != n && t.elapsed() < GUARD {
        std::thread::sleep(Duration::from_millis(5));
    }
    what(&e.poller_stats()) == n
}

/// The destination's reports (of whatever it reports within a short
/// wait).
fn settle(d: &mut Engine, until: impl Fn(&Outcomes) -> bool) -> Outcomes {
    let mut out = Outcomes::default();
    wait(d, &mut out, GUARD, until);
    out
}

fn another_receives_blocks_are_not_accepted(tls: &str) {
    let mut p = pair(tls);
    // Request 4 under receive 4's live incarnation, but receive 5's blocks.
    let four = p.four;
    let cause = write_once(&mut p, RequestId(4), &[2, 3], four);
    assert_eq!(
        cause,
        Some(Cause::NotLent),
        "a write into receive 5's blocks under receive 4's incarnation"
    );
    let out = settle(&mut p.d, |o| reported(o, RequestId(4)));
    assert_eq!(out.finished_recving, vec![], "{out:?}");
    assert_eq!(out.failed_recving.len(), 1, "{out:?}");
    assert_eq!(out.failed_recving[0].id, RequestId(4));
    assert_eq!(out.failed_recving[0].reason.cause, Cause::NotLent);
    // Receive 5's blocks hold the writer's bytes now; its own writer's
    // word must not make them look like its data.
    assert!(holds(&p.d, 2, SEED, 8), "the mistaken write did land");
    // Its writer is told at once that its word was not taken.
    let five = p.five;
    assert_eq!(
        write_once(&mut p, RequestId(5), &[2, 3], five),
        Some(Cause::NotLent)
    );
    let out = settle(&mut p.d, |o| reported(o, RequestId(5)));
    assert!(
        !out.finished_recving.contains(&RequestId(5)),
        "receive 5 was reported finished after another request's write landed in its blocks: {out:?}"
    );
    assert_eq!(out.failed_recving.len(), 1, "{out:?}");
    assert_eq!(out.failed_recving[0].reason.cause, Cause::NotLent);
    // Counted on both sides.
    assert!(
        counted(&p.w, 2, |s| s.writes_not_lent),
        "{:?}",
        p.w.poller_stats()
    );
    assert!(
        counted(&p.d, 2, |s| s.refused_writes),
        "{:?}",
        p.d.poller_stats()
    );
    assert!(p.d.poller_stats().rejected_notifications >= 1);
    assert_eq!(p.d.metrics().rejected.not_lent_writes, 2);
}

#[test]
fn a_write_into_another_live_receives_blocks_fails_not_lent_over_tcp() {
    another_receives_blocks_are_not_accepted(TCP);
}

#[test]
fn a_write_into_another_live_receives_blocks_fails_not_lent_over_shared_memory() {
    another_receives_blocks_are_not_accepted(SHM);
}

fn blocks_not_received_are_not_accepted(tls: &str) {
    let mut p = pair(tls);
    // Blocks 6 and 7 belong to no receive; block 1 is receive 4's, 7 not.
    let four = p.four;
    assert_eq!(
        write_once(&mut p, RequestId(4), &[1, 7], four),
        Some(Cause::NotLent),
        "a write of one received block and one free"
    );
    let out = settle(&mut p.d, |o| reported(o, RequestId(4)));
    assert_eq!(out.failed_recving.len(), 1, "{out:?}");
    assert_eq!(out.failed_recving[0].reason.cause, Cause::NotLent);
    // Receive 5 is untouched: its own write lands and finishes.
    let five = p.five;
    assert_eq!(write_once(&mut p, RequestId(5), &[2, 3], five), None);
    let out = settle(&mut p.d, |o| reported(o, RequestId(5)));
    assert_eq!(out.finished_recving, vec![RequestId(5)], "{out:?}");
    assert!(holds(&p.d, 3, SEED, 9));
}

#[test]
fn a_write_into_blocks_no_receive_opened_fails_not_lent_over_tcp() {
    blocks_not_received_are_not_accepted(TCP);
}

#[test]
fn a_write_into_blocks_no_receive_opened_fails_not_lent_over_shared_memory() {
    blocks_not_received_are_not_accepted(SHM);
}

#[test]
fn a_write_into_a_run_of_its_receives_blocks_finishes() {
    // A writer that writes part of the receive (its suffix, as one of
    // several writers may) is the receive's.
    let mut p = pair(TCP);
    let token =
        p.d.receive(RequestId(1), &blocks(&[4, 5, 6]), 1, HOUR)
            .unwrap();
    assert_eq!(write_once(&mut p, RequestId(1), &[5, 6], token), None);
    let out = settle(&mut p.d, |o| reported(o, RequestId(1)));
    assert_eq!(out.finished_recving, vec![RequestId(1)], "{out:?}");
}
