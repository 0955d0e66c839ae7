//! Lend confirmation and push fences over real UCX (tcp, one process): a read finishes only if its
//! lend was live for the whole read. The lender answers each reader's
//! question; a lend that expired (and whose blocks the lender's engine got
//! back and reused) is refused, and the read fails naming its blocks — it
//! never finishes with another request's bytes.

mod common;

use std::time::{Duration, Instant};

use kvpoll::engine::{Engine, Outcomes, Transfer};
use kvpoll::ledger::{BlockId, Cause, RequestId};
use kvpoll::transport::ucx::ContextOptions;

const BS: u64 = 4096;
const BLOCKS: u64 = 16;
const GUARD: Duration = Duration::from_secs(10);

fn engine() -> Engine {
    engine_over("tcp")
}

fn engine_over(tls: &str) -> Engine {
    let mut e = Engine::builder()
        .block_size(BS)
        .ucx(ContextOptions::with_transports(tls))
        .build()
        .expect("engine");
    e.register(BLOCKS).unwrap();
    e
}

use common::{fill_block as fill, holds_block as holds};

fn wait(e: &mut Engine, out: &mut Outcomes, what: &str, done: impl Fn(&Outcomes) -> bool) {
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

#[test]
fn a_read_of_a_live_lend_is_confirmed_and_finishes_with_the_lenders_bytes() {
    let mut p = engine();
    let mut d = engine();
    let peer = d.add_peer(&p.local_metadata().unwrap()).unwrap();
    fill(&p, 1, 3);
    let id = RequestId(1);
    let lend = p.lend(id, &[BlockId(3)], 1, GUARD).unwrap();
    d.read(
        id,
        &[Transfer {
            peer,
            local: &[BlockId(5)],
            remote: &[BlockId(3)],
            lend,
        }],
    )
    .unwrap();
    let mut out = Outcomes::default();
    wait(&mut d, &mut out, "the read", |o| {
        !o.finished_recving.is_empty()
    });
    assert_eq!(out.finished_recving, vec![id]);
    assert!(holds(&d, 5, 1, 3));
    let mut pout = Outcomes::default();
    wait(&mut p, &mut pout, "the release", |o| {
        !o.finished_sending.is_empty()
    });
    assert_eq!(pout.finished_sending, vec![id]);
}

/// A reader whose first connection to a lender only sent a note (nothing
/// to read), and which then removed the lender and added it again (a
/// client reconnecting to the same engine), reads from it over tcp as
/// before, confirmed, on that connection and on the next. The lender
/// answers a tcp read with sends on an endpoint of its own; UCX pairs a
/// new endpoint with the connection of the same rank, and one opened at
/// the first answer took the closed first connection's: every answer was
/// lost and every read ran to its deadline, after each fresh connection
/// alike.
#[test]
fn a_lender_removed_after_a_note_and_added_again_is_read_over_tcp_again() {
    let mut p = engine();
    let mut d = Engine::builder()
        .block_size(BS)
        .ucx(ContextOptions::with_transports("tcp"))
        .read_deadline(Duration::from_secs(3))
        .build()
        .expect("engine");
    d.register(BLOCKS).unwrap();
    let mut peer = d.add_peer(&p.local_metadata().unwrap()).unwrap();
    for b in 0..4 {
        fill(&p, 1, b);
    }
    let mut pout = Outcomes::default();
    let lent: Vec<BlockId> = (0..4).map(BlockId).collect();
    let first = RequestId(1);
    let lend = p.lend(first, &lent, 1, GUARD).unwrap();
    d.notify_only(first, &[(peer, lend)]).unwrap();
    wait(&mut p, &mut pout, "the noted lend's end", |o| {
        o.finished_sending.contains(&first)
    });
    for round in 0..2u32 {
        d.remove_peer(peer).unwrap();
        peer = d.add_peer(&p.local_metadata().unwrap()).unwrap();
        let id = RequestId(10 + u64::from(round));
        let lend = p.lend(id, &lent, 1, GUARD).unwrap();
        let local: Vec<BlockId> = (8..12).map(BlockId).collect();
        d.read(
            id,
            &[Transfer {
                peer,
                local: &local,
                remote: &lent,
                lend,
            }],
        )
        .unwrap();
        let mut out = Outcomes::default();
        wait(&mut d, &mut out, "the read", |o| {
            !o.finished_recving.is_empty() || !o.failed_recving.is_empty()
        });
        assert_eq!(out.finished_recving, vec![id], "round {round}: {out:?}");
        for (l, r) in local.iter().zip(&lent) {
            assert!(holds(&d, l.0, 1, r.0), "round {round}: block {}", l.0);
        }
    }
}

#[cfg(feature = "fault-injection")]
/// The reader's poller stalls right after posting its read (as a paused
/// decode process would); the lease runs out meanwhile, the lender's engine
/// gets its block back and fills it with another request's KV. When the
/// reader resumes, its get lands those new bytes; the lender refuses the
/// read, and it fails `LeaseLost`, naming its blocks. Checked on arrival and
/// again when the block is reused.
#[test]
fn a_read_that_outlives_its_lend_fails_and_never_finishes_with_reused_bytes() {
    let mut p = engine();
    let mut d = engine();
    let peer = d.add_peer(&p.local_metadata().unwrap()).unwrap();
    // Wire the endpoint up first (a read of a live lend).
    fill(&p, 1, 0);
    let lend = p.lend(RequestId(9), &[BlockId(0)], 1, GUARD).unwrap();
    d.read(
        RequestId(9),
        &[Transfer {
            peer,
            local: &[BlockId(0)],
            remote: &[BlockId(0)],
            lend,
        }],
    )
    .unwrap();
    let mut out = Outcomes::default();
    wait(&mut d, &mut out, "the warm-up read", |o| {
        !o.finished_recving.is_empty()
    });

    let id = RequestId(10);
    fill(&p, 10, 4);
    let lend = p
        .lend(id, &[BlockId(4)], 1, Duration::from_millis(200))
        .unwrap();
    d.read(
        id,
        &[Transfer {
            peer,
            local: &[BlockId(6)],
            remote: &[BlockId(4)],
            lend,
        }],
    )
    .unwrap();
    d.stall(Duration::from_millis(1_000)).unwrap();
    // The lend expires; the lender's engine reuses the block for request 11.
    let mut pout = Outcomes::default();
    wait(&mut p, &mut pout, "the lend's expiry", |o| {
        o.expired.contains(&id)
    });
    fill(&p, 11, 4);
    let mut out = Outcomes::default();
    wait(&mut d, &mut out, "the read's report", |o| {
        !o.finished_recving.is_empty() || !o.failed_recving.is_empty()
    });
    assert!(
        out.finished_recving.is_empty(),
        "a read finished although its lend expired before it was confirmed \
         (block 6 holds request {}'s bytes)",
        if holds(&d, 6, 11, 4) { 11 } else { 10 }
    );
    assert_eq!(out.failed_recving.len(), 1);
    assert_eq!(out.failed_recving[0].reason.cause, Cause::LeaseLost);
    assert_eq!(out.blocks_of(&out.failed_recving[0]), &[BlockId(6)]);
    // Reused by the lender, the block holds the new request's bytes.
    assert!(holds(&p, 4, 11, 4));
}

#[cfg(feature = "fault-injection")]
/// The lender's poller stops (a prefill process stopped) right after it
/// took 12 lends; over shared memory its reader reads them one after
/// another meanwhile, each confirmed from its lend word, and each read's
/// note waits at the lender in a message of its own. The lender wakes
/// past every lease: it takes in what arrived before it judges a lease,
/// so every lend read is released (`finished_sending`), and only the one
/// nobody read is reported expired.
#[test]
fn a_lender_woken_past_its_leases_counts_the_reads_that_arrived_while_it_slept() {
    use common::{one, reported};
    let tls = "posix,sysv,cma";
    let mut p = engine_over(tls);
    let mut d = engine_over(tls);
    let peer = d.add_peer(&p.local_metadata().unwrap()).unwrap();
    // Wire the endpoint up first (a read of a live lend, released).
    fill(&p, 1, 15);
    let warm = p.lend(RequestId(1), &[BlockId(15)], 1, GUARD).unwrap();
    d.read(
        RequestId(1),
        &one(peer, &[BlockId(15)], &[BlockId(15)], warm),
    )
    .unwrap();
    let mut out = Outcomes::default();
    wait(&mut d, &mut out, "the warm-up read", |o| {
        !o.finished_recving.is_empty()
    });
    let mut pout = Outcomes::default();
    wait(&mut p, &mut pout, "the warm-up release", |o| {
        !o.finished_sending.is_empty()
    });

    let (lease, stall) = (Duration::from_millis(300), Duration::from_millis(2_000));
    let ids: Vec<RequestId> = (100..112).map(RequestId).collect();
    let lends: Vec<_> = ids
        .iter()
        .zip(0u32..)
        .map(|(&id, b)| {
            fill(&p, id.0, b);
            p.lend(id, &[BlockId(b)], 1, lease).unwrap()
        })
        .collect();
    // One nobody reads: it still expires.
    let unread = RequestId(112);
    p.lend(unread, &[BlockId(12)], 1, lease).unwrap();
    // Taken after the lends, so their leases started before it.
    p.stall(stall).unwrap();
    let stalled_at = Instant::now();
    // The lends are in the lender's words once its poller took them.
    std::thread::sleep(Duration::from_millis(50));
    for ((&id, &lend), b) in ids.iter().zip(&lends).zip(0u32..) {
        d.read(id, &one(peer, &[BlockId(b)], &[BlockId(b)], lend))
            .unwrap();
        let mut out = Outcomes::default();
        wait(&mut d, &mut out, "a read of the stopped lender", |o| {
            reported(o, id)
        });
        assert_eq!(out.finished_recving, vec![id], "{out:?}");
        assert!(holds(&d, b, id.0, b));
    }
    assert!(
        stalled_at.elapsed() < stall - Duration::from_millis(200),
        "the reads outlasted the lender's stop; make it longer"
    );
    let mut pout = Outcomes::default();
    wait(&mut p, &mut pout, "the lends' reports", |o| {
        ids.iter().chain([&unread]).all(|&id| reported(o, id))
    });
    assert!(
        pout.expired == [unread],
        "{} of {} lends reported expired although their reads finished and \
         their notes had arrived: {pout:?}",
        pout.expired.iter().filter(|&&id| id != unread).count(),
        ids.len()
    );
    let mut released = pout.finished_sending.clone();
    released.sort_by_key(|id| id.0);
    assert_eq!(released, ids, "{pout:?}");
}

/// A read that fails tells its lenders at once (once it stopped), so a
/// lender does not hold its blocks for the rest of a long lease.
#[test]
fn a_failed_read_releases_its_lenders_blocks_at_once() {
    let mut a = engine();
    let mut d = engine();
    let to_a = d.add_peer(&a.local_metadata().unwrap()).unwrap();
    let gone = d.add_peer(&engine().local_metadata().unwrap()).unwrap();
    d.remove_peer(gone).unwrap();
    let id = RequestId(20);
    let lend = a
        .lend(id, &[BlockId(1)], 1, Duration::from_secs(600))
        .unwrap();
    d.read(
        id,
        &[
            Transfer {
                peer: to_a,
                local: &[BlockId(1)],
                remote: &[BlockId(1)],
                lend,
            },
            Transfer {
                peer: gone,
                local: &[BlockId(2)],
                remote: &[BlockId(2)],
                lend,
            },
        ],
    )
    .unwrap();
    let mut out = Outcomes::default();
    wait(&mut d, &mut out, "the failure", |o| {
        !o.failed_recving.is_empty()
    });
    let mut aout = Outcomes::default();
    wait(&mut a, &mut aout, "the early release", |o| {
        !o.finished_sending.is_empty()
    });
    assert_eq!(aout.finished_sending, vec![id]);
}

#[cfg(feature = "fault-injection")]
/// Push: the writer's poller stops right after posting its puts (a paused
/// prefill process); the destination's lease runs out meanwhile, and so
/// does the writer's own. The destination reports nothing — its blocks stay
/// quarantined, not reused — until the writer resumes and says its push
/// ended (a write is never force-closed at its lease's end: its puts could
/// land after any word on a fresh endpoint). Then the blocks are reported
/// (named), and once reused, no late put overwrites them. Named writers
/// (`receive_from`) and unnamed ones (`receive`) alike.
fn push_destination_waits_for_its_stalled_writer(
    named: bool,
    seed: u64,
    tls: &str,
    stall_first: bool,
) {
    let mut w = engine_over(tls);
    let mut c = engine_over(tls);
    let to_c = w.add_peer(&c.local_metadata().unwrap()).unwrap();
    let to_w = c.add_peer(&w.local_metadata().unwrap()).unwrap();
    fill(&w, seed, 2);
    let id = RequestId(seed);
    let lease = Duration::from_millis(200);
    let lend = if named {
        c.receive_from(id, &[BlockId(7)], &[to_w], lease).unwrap()
    } else {
        c.receive(id, &[BlockId(7)], 1, lease).unwrap()
    };
    let stall = Duration::from_millis(1_200);
    if stall_first {
        w.stall(stall).unwrap();
    }
    w.write(
        id,
        &[Transfer {
            peer: to_c,
            local: &[BlockId(2)],
            remote: &[BlockId(7)],
            lend,
        }],
        1,
        Duration::from_millis(300),
    )
    .unwrap();
    if !stall_first {
        w.stall(stall).unwrap();
    }
    let stalled_at = Instant::now();
    let mut out = Outcomes::default();
    let mut wout = Outcomes::default();
    loop {
        c.poll(&mut out);
        w.poll(&mut wout);
        if !out.is_empty() {
            break;
        }
        assert!(stalled_at.elapsed() < GUARD, "never released");
        std::thread::sleep(Duration::from_millis(2));
    }
    let released_after = stalled_at.elapsed();
    assert!(
        released_after >= Duration::from_millis(1_000),
        "the destination released its blocks after {released_after:?}, while its writer \
         was still stopped: {out:?}"
    );
    // The engine reuses the block for another request; nothing lands later.
    fill(&c, seed + 1, 7);
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(300) {
        c.poll(&mut out);
        w.poll(&mut wout);
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        holds(&c, 7, seed + 1, 7),
        "a late put overwrote a reused block"
    );
}

#[cfg(feature = "fault-injection")]
#[test]
fn a_push_destination_waits_for_its_stalled_named_writer_before_releasing_its_blocks() {
    push_destination_waits_for_its_stalled_writer(true, 30, "tcp", false);
}

#[cfg(feature = "fault-injection")]
#[test]
fn a_push_destination_waits_for_its_stalled_unnamed_writer_before_releasing_its_blocks() {
    push_destination_waits_for_its_stalled_writer(false, 40, "tcp", false);
}

/// The same over shared memory (cma puts, posix/sysv active messages): the
/// writer's puts are copies it makes itself, so its own word after they
/// completed is the fence. A put there completes as it is posted, so a
/// writer's poller can finish the whole write (puts, flush, its word)
/// before a stall submitted after the write reaches it, and the
/// destination then rightly releases at once: the writer is stopped first
/// here, its write queued behind the stall. To the destination the two are
/// alike — a writer that has not said its push ended.
#[cfg(feature = "fault-injection")]
#[test]
fn over_shared_memory_a_push_destination_waits_for_its_stalled_writer() {
    push_destination_waits_for_its_stalled_writer(true, 60, "posix,sysv,cma", true);
}

/// A named writer that never writes (its control message was lost, it
/// refused the push) does not hold the destination's blocks forever: at
/// the lease's end the destination asks it, it answers that it will not
/// write, and the blocks are reported. A write of that request it submits
/// later is refused before anything is posted: the blocks keep whatever
/// the destination put there since.
#[test]
fn a_named_writer_that_never_wrote_is_asked_and_a_later_write_of_it_is_refused() {
    let mut w = engine();
    let mut c = engine();
    let to_c = w.add_peer(&c.local_metadata().unwrap()).unwrap();
    let to_w = c.add_peer(&w.local_metadata().unwrap()).unwrap();
    let id = RequestId(50);
    let lend = c
        .receive_from(id, &[BlockId(9)], &[to_w], Duration::from_millis(100))
        .unwrap();
    let mut out = Outcomes::default();
    let mut wout = Outcomes::default();
    let t = Instant::now();
    loop {
        c.poll(&mut out);
        w.poll(&mut wout);
        if !out.is_empty() {
            break;
        }
        assert!(
            t.elapsed() < GUARD,
            "the destination of a writer that never wrote was never released"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    let failed = out
        .failed_recving
        .iter()
        .find(|f| f.id == id)
        .unwrap_or_else(|| panic!("not reported failed: {out:?}"));
    assert_eq!(failed.reason.cause, Cause::LeaseExpired);
    assert_eq!(&out.invalid_blocks[failed.blocks.clone()], &[BlockId(9)]);
    // The destination reuses the block; the writer wakes up and writes.
    fill(&c, 51, 9);
    fill(&w, 50, 3);
    w.write(
        id,
        &[Transfer {
            peer: to_c,
            local: &[BlockId(3)],
            remote: &[BlockId(9)],
            lend,
        }],
        1,
        Duration::from_secs(1),
    )
    .unwrap();
    wout.clear();
    wait(&mut w, &mut wout, "the late write's report", |o| {
        !o.failed_sending.is_empty()
    });
    assert_eq!(wout.failed_sending[0].id, id);
    assert_eq!(wout.failed_sending[0].reason.cause, Cause::LeaseLost);
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(200) {
        c.poll(&mut out);
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(holds(&c, 9, 51, 9), "the refused write landed");
}
