//! One request id living twice, over real UCX: every note names the lend
//! incarnation it is about, so a late answer about an earlier lend of the
//! same id never completes a later one; leases start when the poller takes
//! the lend; a read may reach its lender before the lend does; removing a
//! writer that a receive still waits for never drops the fence.

mod common;

use std::time::{Duration, Instant};

use kvpoll::engine::{Engine, Outcomes};
use kvpoll::ledger::{BlockId, Cause, Incarnation, RequestId};

use common::{one, reported};

const BS: u64 = 4096;
const BLOCKS: u64 = 16;
const GUARD: Duration = Duration::from_secs(10);

fn engine_over(tls: &str, grace: Duration) -> Engine {
    common::engine_with_grace(tls, grace, BS, BLOCKS)
}

fn engine() -> Engine {
    engine_over("tcp", Duration::from_secs(5))
}

/// A lender, a reader, and the reader's peer id for the lender.
fn lender_and_reader() -> (Engine, Engine, kvpoll::PeerId) {
    let p = engine();
    let mut d = engine();
    let peer = d.add_peer(&p.local_metadata().unwrap()).unwrap();
    (p, d, peer)
}

use common::{fill_block as fill, holds_block as holds};

fn wait(
    e: &mut Engine,
    out: &mut Outcomes,
    within: Duration,
    done: impl Fn(&Outcomes) -> bool,
) -> bool {
    common::try_wait(e, out, within, done)
}

#[cfg(feature = "fault-injection")]
/// A read of the first lend of request 10, held up on the reader (before
/// it is posted) while the lend expires, the lender reuses its block for request 11 and lends
/// request 10 again (other blocks): the late question names the first
/// incarnation, which is over, so the read fails — it never finishes with
/// request 11's bytes although a lend named 10 is live.
#[test]
fn a_late_read_of_an_earlier_lend_of_the_same_id_fails_instead_of_finishing_with_reused_bytes() {
    let (mut p, mut d, peer) = lender_and_reader();
    // Wire the endpoint up.
    fill(&p, 1, 0);
    let warm = p.lend(RequestId(1), &[BlockId(0)], 1, GUARD).unwrap();
    d.read(RequestId(1), &one(peer, &[BlockId(0)], &[BlockId(0)], warm))
        .unwrap();
    let mut out = Outcomes::default();
    assert!(wait(&mut d, &mut out, GUARD, |o| reported(o, RequestId(1))));
    assert_eq!(out.finished_recving, vec![RequestId(1)], "{out:?}");

    let id = RequestId(10);
    fill(&p, 10, 4);
    let short = Duration::from_millis(200);
    let first = p.lend(id, &[BlockId(4)], 1, short).unwrap();
    // The reader's poller is held up before it posts the read: its get
    // reads the block after the lender reused it.
    d.stall(Duration::from_millis(1_000)).unwrap();
    d.read(id, &one(peer, &[BlockId(6)], &[BlockId(4)], first))
        .unwrap();
    let mut pout = Outcomes::default();
    assert!(
        wait(&mut p, &mut pout, GUARD, |o| o.expired.contains(&id)),
        "the first lend never expired: {pout:?}"
    );
    // Block 4 now holds request 11; request 10 is lent again, elsewhere.
    fill(&p, 11, 4);
    p.lend(RequestId(11), &[BlockId(4)], 1, GUARD).unwrap();
    fill(&p, 10, 5);
    let second = p.lend(id, &[BlockId(5)], 1, GUARD).unwrap();
    assert_ne!(first, second);
    let mut out = Outcomes::default();
    assert!(
        wait(&mut d, &mut out, GUARD, |o| reported(o, id)),
        "{out:?}"
    );
    assert!(
        out.finished_recving.is_empty(),
        "the read of the first lend finished (block 6 holds request {}'s bytes)",
        if holds(&d, 6, 11, 4) { 11 } else { 10 }
    );
    assert_eq!(out.failed_recving[0].reason.cause, Cause::LeaseLost);
    assert_eq!(out.blocks_of(&out.failed_recving[0]), &[BlockId(6)]);
    // The second lend is untouched by the first one's late traffic.
    std::thread::sleep(Duration::from_millis(100));
    let mut pout = Outcomes::default();
    p.poll(&mut pout);
    assert!(
        !reported(&pout, id),
        "a stale note ended the second lend: {pout:?}"
    );
    assert_eq!(p.in_flight(), 2, "request 11 and the second lend of 10");
}

#[cfg(feature = "fault-injection")]
/// A lend submitted while the lender's poller is held up (a long batch, a
/// descheduled thread) gets its whole lease from when the poller takes it:
/// a 900 ms stall, then a 500 ms lease, then a read — confirmed.
#[test]
fn a_lend_taken_after_a_long_poller_stall_gets_its_whole_lease() {
    let (mut p, mut d, peer) = lender_and_reader();
    fill(&p, 3, 2);
    let id = RequestId(30);
    p.stall(Duration::from_millis(900)).unwrap();
    let lend = p
        .lend(id, &[BlockId(2)], 1, Duration::from_millis(500))
        .unwrap();
    d.read(id, &one(peer, &[BlockId(3)], &[BlockId(2)], lend))
        .unwrap();
    let mut out = Outcomes::default();
    assert!(
        wait(&mut d, &mut out, GUARD, |o| reported(o, id)),
        "{out:?}"
    );
    assert_eq!(
        out.finished_recving,
        vec![id],
        "the lend's lease was charged for the stall before it: {out:?}"
    );
    assert!(holds(&d, 3, 3, 2));
}

/// A serving engine hands out the block ids and the incarnation before its
/// worker lends them (vLLM's scheduler answers the prefill request first):
/// the read reaches the lender first, is told the lend is pending, asks
/// again, and finishes once the lend arrives — with the lender's bytes.
#[test]
fn a_read_that_reaches_its_lender_before_the_lend_finishes_once_the_lend_arrives() {
    let (mut p, mut d, peer) = lender_and_reader();
    fill(&p, 7, 9);
    let id = RequestId(40);
    let inc = Incarnation::draw();
    d.read(id, &one(peer, &[BlockId(1)], &[BlockId(9)], inc))
        .unwrap();
    std::thread::sleep(Duration::from_millis(150));
    let mut out = Outcomes::default();
    d.poll(&mut out);
    assert!(
        !reported(&out, id),
        "the read ended before its lend existed: {out:?}"
    );
    p.lend_with(id, &[BlockId(9)], 1, GUARD, inc).unwrap();
    assert!(
        wait(&mut d, &mut out, GUARD, |o| reported(o, id)),
        "{out:?}"
    );
    assert_eq!(out.finished_recving, vec![id], "{out:?}");
    assert!(holds(&d, 1, 7, 9));
    let mut pout = Outcomes::default();
    assert!(wait(&mut p, &mut pout, GUARD, |o| reported(o, id)));
    assert_eq!(
        pout.finished_sending,
        vec![id],
        "the reader was not counted"
    );
}

/// A read whose lend never comes fails once the grace period ran out (not
/// at once, not never), naming its blocks: `NotLent`, the lender never
/// knew the lend.
#[test]
fn a_read_whose_lend_never_arrives_fails_after_the_grace_period() {
    let p = engine();
    let grace = Duration::from_millis(300);
    let mut d = engine_over("tcp", grace);
    let peer = d.add_peer(&p.local_metadata().unwrap()).unwrap();
    let id = RequestId(41);
    let t = Instant::now();
    d.read(
        id,
        &one(peer, &[BlockId(2)], &[BlockId(2)], Incarnation::draw()),
    )
    .unwrap();
    let mut out = Outcomes::default();
    assert!(
        wait(&mut d, &mut out, GUARD, |o| reported(o, id)),
        "{out:?}"
    );
    assert!(
        t.elapsed() >= grace,
        "refused before the grace period ended"
    );
    assert_eq!(out.failed_recving[0].reason.cause, Cause::NotLent);
    assert_eq!(out.blocks_of(&out.failed_recving[0]), &[BlockId(2)]);
}

#[cfg(feature = "fault-injection")]
/// Over shared memory a writer copies its puts itself: removing it as a
/// peer cannot cut them. A receive that named it keeps its fence
/// — nothing is reported, the blocks are not reused — until the writer
/// spoke; only then is the peer forgotten. Nothing lands after the report.
#[test]
fn removing_a_writer_its_destination_waits_for_keeps_the_fence_until_it_spoke() {
    let tls = "posix,sysv,cma";
    let mut w = engine_over(tls, Duration::from_secs(5));
    let mut c = engine_over(tls, Duration::from_secs(5));
    let to_c = w.add_peer(&c.local_metadata().unwrap()).unwrap();
    let to_w = c.add_peer(&w.local_metadata().unwrap()).unwrap();
    fill(&w, 60, 2);
    let id = RequestId(60);
    let dest = c
        .receive_from(id, &[BlockId(7)], &[to_w], Duration::from_millis(200))
        .unwrap();
    // The writer's poller stops before it takes the write: its puts are
    // posted (and copied, by the writer) once it resumes.
    w.stall(Duration::from_millis(800)).unwrap();
    w.write(id, &one(to_c, &[BlockId(2)], &[BlockId(7)], dest), 1, GUARD)
        .unwrap();
    c.remove_peer(to_w).unwrap();
    let mut out = Outcomes::default();
    assert!(
        !wait(&mut c, &mut out, Duration::from_millis(500), |o| reported(
            o, id
        )),
        "the destination reported while its writer could still write: {out:?}"
    );
    assert!(
        wait(&mut c, &mut out, GUARD, |o| reported(o, id)),
        "{out:?}"
    );
    // Reused once reported: nothing of the writer lands any more.
    fill(&c, 61, 7);
    let mut wout = Outcomes::default();
    wait(&mut w, &mut wout, Duration::from_millis(300), |o| {
        reported(o, id)
    });
    assert!(
        holds(&c, 7, 61, 7),
        "a put landed after the destination was reported"
    );
}

/// Lends in flight together hold lend words of their own: the engine
/// draws each lend's incarnation so that its word is not one its other
/// live lends hold (its readers then confirm one-sidedly, without a
/// question). Drawn at random, 4 096 lends over the 131 072 words of a
/// UCX transport would find ~64 of their words taken. One more lend under
/// a caller's incarnation that repeats the first lend's meets its word
/// held: the counter counts exactly that one.
#[test]
fn lends_in_flight_together_hold_distinct_lend_words() {
    const LENDS: u64 = 4096;
    let mut p = kvpoll::Engine::builder()
        .block_size(BS)
        .ucx(kvpoll::transport::ucx::ContextOptions::with_transports(
            "tcp",
        ))
        .ledger(LENDS as u32 + 64, 8)
        .command_ring(4 * LENDS as usize)
        .build()
        .expect("engine");
    p.register(BLOCKS).unwrap();
    let lease = Duration::from_secs(3600);
    let mut first = None;
    for id in 0..LENDS {
        let block = [BlockId((id % BLOCKS) as u32)];
        let token = p.lend(RequestId(id), &block, 1, lease).unwrap();
        first.get_or_insert(token);
    }
    p.lend_with(RequestId(LENDS), &[BlockId(0)], 1, lease, first.unwrap())
        .unwrap();
    // Shutdown begins every lend still in the command ring, then cancels
    // it, and publishes the poller's counters last.
    p.shutdown();
    let mut out = Outcomes::default();
    p.poll(&mut out);
    assert_eq!(
        out.expired.len() as u64,
        LENDS + 1,
        "every lend was begun, then cancelled and reported"
    );
    let s = p.poller_stats();
    assert_eq!(
        s.lend_word_collisions, 1,
        "only the lend that repeated an incarnation met its word held: {s:?}"
    );
}
