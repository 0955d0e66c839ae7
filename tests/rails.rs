//! Rails over real UCX, in one process: a lender and a reader of two rails
//! each (tcp, both bound to the loopback device), reads striped across
//! both or sent whole to one, each request reported once, after every
//! rail's part of it, and a rail whose part failed left out and then used
//! again.

mod common;

use std::time::{Duration, Instant};

use common::pattern;
use kvpoll::ledger::{BlockId, RequestId};
use kvpoll::rails::{Rails, RailsBuilder, RailsError};
use kvpoll::transport::ucx::ContextOptions;
use kvpoll::{EngineBuilder, Outcomes, Transfer};

const BLOCK: u64 = 64 * 1024;
const BLOCKS: u64 = 64;
const SEED: u64 = 0x5eed_0046;

fn rail_engine() -> EngineBuilder {
    kvpoll::Engine::builder()
        .block_size(BLOCK)
        .ucx(ContextOptions::with_transports("tcp"))
}

fn two_rails(builder: RailsBuilder, first: EngineBuilder) -> Rails {
    let mut rails = builder
        .rail(Some("lo"), first)
        .rail(Some("lo"), rail_engine())
        .build()
        .expect("rails");
    rails.register(BLOCKS).expect("memory");
    rails
}

/// A lender of two rails with every block filled.
fn lender() -> Rails {
    let lender = two_rails(Rails::builder(), rail_engine());
    let mut buf = vec![0u8; BLOCK as usize];
    for b in 0..BLOCKS as u32 {
        pattern::fill(SEED, u64::from(b), &mut buf);
        lender.write_block(0, BlockId(b), &buf).unwrap();
    }
    lender
}

/// A lender with every block filled, and a reader that added it.
fn pair(
    reader: RailsBuilder,
    reader_rail0: EngineBuilder,
) -> (Rails, Rails, kvpoll::ledger::PeerId) {
    let lender = lender();
    let mut reader = two_rails(reader, reader_rail0);
    let peer = reader
        .add_peer(&lender.local_metadata().unwrap())
        .expect("the lender's rails");
    (lender, reader, peer)
}

/// Reads `lent` of the lend `inc` of `peer` into `local`, through `reader`.
fn read(
    reader: &mut Rails,
    peer: kvpoll::ledger::PeerId,
    id: RequestId,
    local: &[BlockId],
    lent: &[BlockId],
    inc: kvpoll::ledger::Incarnation,
) -> Result<(), RailsError> {
    reader.read(
        id,
        &[Transfer {
            peer,
            local,
            remote: lent,
            lend: inc,
        }],
    )
}

fn blocks(range: std::ops::Range<u32>) -> Vec<BlockId> {
    range.map(BlockId).collect()
}

/// Polls both sides until `done`, or `guard` passed.
fn settle(
    a: &mut Rails,
    ao: &mut Outcomes,
    b: &mut Rails,
    bo: &mut Outcomes,
    guard: Duration,
    done: impl Fn(&Outcomes, &Outcomes) -> bool,
) -> bool {
    let t = Instant::now();
    loop {
        a.poll(ao);
        b.poll(bo);
        if done(ao, bo) {
            return true;
        }
        if t.elapsed() > guard {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Polls both sides a little longer: reports that would come twice come
/// within a few more polls.
fn linger(a: &mut Rails, ao: &mut Outcomes, b: &mut Rails, bo: &mut Outcomes) {
    settle(a, ao, b, bo, Duration::from_millis(200), |_, _| false);
}

/// Polls until the reader reported a read finished and the lender a lend.
fn both_reported(
    reader: &mut Rails,
    ro: &mut Outcomes,
    lender: &mut Rails,
    lo: &mut Outcomes,
    guard: Duration,
) {
    assert!(
        settle(reader, ro, lender, lo, guard, |r, l| {
            !r.finished_recving.is_empty() && !l.finished_sending.is_empty()
        }),
        "reader {ro:?}, lender {lo:?}"
    );
}

fn holds(reader: &Rails, local: &[BlockId], remote: &[BlockId]) -> bool {
    let mut buf = vec![0u8; BLOCK as usize];
    local.iter().zip(remote).all(|(l, r)| {
        reader.read_block(0, *l, &mut buf).unwrap();
        pattern::check(SEED, u64::from(r.0), &buf)
    })
}

fn count(list: &[RequestId], id: RequestId) -> usize {
    list.iter().filter(|&&i| i == id).count()
}

#[test]
fn a_striped_read_moves_bytes_on_both_rails_lands_every_byte_and_each_side_reports_once() {
    let (mut lender, mut reader, peer) =
        pair(Rails::builder().stripe_above(1 << 20), rail_engine());
    let (lo, ro) = (&mut Outcomes::default(), &mut Outcomes::default());
    let id = RequestId(1);
    let lent = blocks(8..40);
    let local = blocks(0..32);
    let inc = lender.lend(id, &lent, 1, Duration::from_secs(60)).unwrap();
    read(&mut reader, peer, id, &local, &lent, inc).unwrap();
    both_reported(&mut reader, ro, &mut lender, lo, Duration::from_secs(30));
    // Reports that would come twice come within a few more polls.
    linger(&mut reader, ro, &mut lender, lo);
    assert_eq!(count(&ro.finished_recving, id), 1, "{ro:?}");
    assert!(ro.failed_recving.is_empty(), "{ro:?}");
    assert_eq!(count(&lo.finished_sending, id), 1, "{lo:?}");
    assert!(lo.expired.is_empty(), "{lo:?}");
    assert!(
        holds(&reader, &local, &lent),
        "the blocks read are the lender's"
    );
    let stats = reader.stats();
    for (r, s) in stats.iter().enumerate() {
        assert_eq!(s.parts_finished, 1, "rail {r}: {s:?}");
        // Half of every block on each rail.
        assert!(
            s.poller.bytes_moved >= 32 * BLOCK / 2,
            "rail {r} moved {} bytes",
            s.poller.bytes_moved
        );
    }
    assert_eq!(reader.in_flight(), 0);
    assert_eq!(lender.in_flight(), 0);
    // The metrics: each rail a poller, the whole requests counted once.
    let (rm, lm) = (reader.metrics(), lender.metrics());
    assert_eq!(rm.pollers.len(), 2);
    assert!(
        rm.pollers.iter().all(|p| p.bytes >= 32 * BLOCK / 2),
        "{rm:?}"
    );
    assert_eq!(rm.requests.finished_recving, 1);
    assert_eq!(lm.requests.finished_sending, 1);
    assert_eq!(rm.rings.iter().filter(|r| r.poller == 1).count(), 2);
    let text = kvpoll::metrics::render(&rm).unwrap();
    assert!(text.contains("poller=\"1\""), "{text}");
}

#[test]
fn small_reads_go_whole_to_both_rails_in_turn_and_free_the_lends_on_the_other_rail_at_once() {
    let (mut lender, mut reader, peer) = pair(Rails::builder(), rail_engine());
    let (lo, ro) = (&mut Outcomes::default(), &mut Outcomes::default());
    const N: u32 = 8;
    let mut lends = Vec::new();
    for i in 0..N {
        let id = RequestId(100 + u64::from(i));
        let lent = blocks(2 * i..2 * i + 2);
        // A lease far past the test's guard: a lend freed in time was
        // freed by a note, not by its lease.
        let inc = lender.lend(id, &lent, 1, Duration::from_secs(600)).unwrap();
        lends.push((id, lent, inc));
    }
    let locals: Vec<_> = (0..N).map(|i| blocks(32 + 2 * i..32 + 2 * i + 2)).collect();
    for ((id, lent, inc), local) in lends.iter().zip(&locals) {
        read(&mut reader, peer, *id, local, lent, *inc).unwrap();
    }
    assert!(
        settle(
            &mut reader,
            ro,
            &mut lender,
            lo,
            Duration::from_secs(30),
            |r, l| {
                r.finished_recving.len() == N as usize && l.finished_sending.len() == N as usize
            }
        ),
        "reader {ro:?}, lender {lo:?}"
    );
    linger(&mut reader, ro, &mut lender, lo);
    for ((id, lent, _), local) in lends.iter().zip(&locals) {
        assert_eq!(count(&ro.finished_recving, *id), 1, "{ro:?}");
        assert_eq!(count(&lo.finished_sending, *id), 1, "{lo:?}");
        assert!(holds(&reader, local, lent));
    }
    assert!(lo.expired.is_empty() && ro.failed_recving.is_empty());
    let stats = reader.stats();
    assert_eq!(
        stats.iter().map(|s| s.parts_finished).sum::<u64>(),
        u64::from(N)
    );
    for (r, s) in stats.iter().enumerate() {
        assert!(s.parts_finished > 0, "rail {r} carried no read: {stats:?}");
    }
}

#[test]
fn metadata_that_no_rail_takes_and_malformed_reads_are_refused_and_change_nothing() {
    let mut reader = two_rails(Rails::builder(), rail_engine());
    for bad in [&b"KR"[..], b"KR\x01\x00", b"KR\x01\x01\x09\x00\x00\x00abc"] {
        assert!(
            matches!(reader.add_peer(bad), Err(RailsError::BadFrame(_))),
            "{bad:?}"
        );
    }
    // Not a rails frame: one engine's metadata for rail 0, which refuses it.
    for bad in [&b""[..], b"not metadata at all"] {
        assert!(
            matches!(reader.add_peer(bad), Err(RailsError::Unreachable(e)) if e.len() == 1 && e[0].0 == 0),
            "{bad:?}"
        );
    }
    // A whole frame whose rails carry no engine metadata.
    let frame = [b'K', b'R', 1, 1, 3, 0, 0, 0, b'a', b'b', b'c'];
    assert!(matches!(
        reader.add_peer(&frame),
        Err(RailsError::Unreachable(e)) if e.len() == 1
    ));
    let local = blocks(0..1);
    let unknown = kvpoll::ledger::PeerId(0);
    assert!(matches!(
        reader.read(
            RequestId(1),
            &[Transfer {
                peer: unknown,
                local: &local,
                remote: &local,
                lend: kvpoll::ledger::Incarnation::draw(),
            }],
        ),
        Err(RailsError::UnknownPeer { handle: 0, .. })
    ));
    let two = blocks(0..2);
    assert!(matches!(
        reader.read(
            RequestId(2),
            &[Transfer {
                peer: unknown,
                local: &two,
                remote: &local,
                lend: kvpoll::ledger::Incarnation::draw(),
            }],
        ),
        Err(RailsError::Handle(kvpoll::SubmitError::BadPairing {
            handle: 0,
            local: 2,
            remote: 1
        }))
    ));
    assert_eq!(reader.in_flight(), 0);
    // Memory once a peer is added: refused before any rail is asked.
    let lender = lender();
    reader.add_peer(&lender.local_metadata().unwrap()).unwrap();
    assert!(matches!(
        reader.register(4),
        Err(RailsError::Region {
            error: kvpoll::RegionError::Frozen,
            ..
        })
    ));
}

/// Rail 0 of the reader fails every handle it carries (a transfer error):
/// the striped read fails once, after rail 1's part ended; the reads after
/// it go to rail 1 and finish; once the link's time out is over, rail 0 is
/// used again.
#[cfg(feature = "fault-injection")]
#[test]
fn a_rail_that_fails_fails_only_its_part_is_left_out_and_is_used_again_after_its_time_out() {
    let faulty = rail_engine().faults(kvpoll::engine::Faults {
        handle_error_every: 1,
        ..Default::default()
    });
    // Long enough that the reads made while rail 0 is left out end within
    // it on a loaded machine.
    let relink = Duration::from_secs(3);
    let (mut lender, mut reader, peer) = pair(
        Rails::builder().stripe_above(1 << 20).relink_after(relink),
        faulty,
    );
    let (lo, ro) = (&mut Outcomes::default(), &mut Outcomes::default());
    let lease = Duration::from_secs(600);
    // The striped read: rail 0's half fails, rail 1's lands.
    let striped = RequestId(1);
    let lent = blocks(0..32);
    let local = blocks(32..64);
    let inc = lender.lend(striped, &lent, 1, lease).unwrap();
    let failed_at = Instant::now();
    read(&mut reader, peer, striped, &local, &lent, inc).unwrap();
    assert!(
        settle(
            &mut reader,
            ro,
            &mut lender,
            lo,
            Duration::from_secs(30),
            |r, _| { !r.failed_recving.is_empty() }
        ),
        "{ro:?}"
    );
    // The link is left out from when its failure was taken: by now.
    let taken = Instant::now();
    let f = &ro.failed_recving[0];
    assert_eq!(f.id, striped);
    assert_eq!(f.reason.cause, kvpoll::ledger::Cause::Transfer);
    assert_eq!(
        ro.blocks_of(f),
        &local[..],
        "every block holds a failed half"
    );
    let stats = reader.stats();
    assert_eq!(
        (stats[0].parts_failed, stats[1].parts_finished),
        (1, 1),
        "{stats:?}"
    );
    assert!(!reader.link_up(peer, 0) && reader.link_up(peer, 1));

    // While rail 0 is left out, small reads go to rail 1 and finish.
    let mut ids = Vec::new();
    for i in 0..4u32 {
        let id = RequestId(10 + u64::from(i));
        let lent = blocks(i..i + 1);
        let local = blocks(40 + i..41 + i);
        let inc = lender.lend(id, &lent, 1, lease).unwrap();
        read(&mut reader, peer, id, &local, &lent, inc).unwrap();
        ids.push((id, local, lent));
    }
    assert!(settle(
        &mut reader,
        ro,
        &mut lender,
        lo,
        Duration::from_secs(30),
        |r, _| { r.finished_recving.len() == 4 }
    ));
    assert!(
        failed_at.elapsed() < relink,
        "the reads were not all within the time out (a slow machine): the test proves nothing"
    );
    for (id, local, lent) in &ids {
        assert_eq!(count(&ro.finished_recving, *id), 1);
        assert!(holds(&reader, local, lent));
    }
    assert_eq!(reader.stats()[1].parts_finished, 5);

    // Past the time out, rail 0 is used again (and fails again: its
    // faults stay on).
    std::thread::sleep(relink.saturating_sub(taken.elapsed()));
    reader.poll(ro);
    assert!(reader.link_up(peer, 0));
    let again = RequestId(20);
    let inc = lender.lend(again, &lent, 1, lease).unwrap();
    read(&mut reader, peer, again, &local, &lent, inc).unwrap();
    assert!(settle(
        &mut reader,
        ro,
        &mut lender,
        lo,
        Duration::from_secs(30),
        |r, _| { r.failed_recving.iter().any(|f| f.id == again) }
    ));
    assert_eq!(reader.stats()[0].parts_failed, 2);
    // Every lend is reported once, none at its lease.
    let all: Vec<RequestId> = [striped, again]
        .into_iter()
        .chain(ids.iter().map(|i| i.0))
        .collect();
    assert!(
        settle(
            &mut reader,
            ro,
            &mut lender,
            lo,
            Duration::from_secs(30),
            |_, l| {
                all.iter()
                    .all(|id| l.finished_sending.contains(id) || l.expired.contains(id))
            }
        ),
        "{lo:?}"
    );
    linger(&mut reader, ro, &mut lender, lo);
    for id in &all {
        assert_eq!(
            count(&lo.finished_sending, *id) + count(&lo.expired, *id),
            1,
            "{id:?}: {lo:?}"
        );
        assert_eq!(
            count(&ro.finished_recving, *id)
                + ro.failed_recving.iter().filter(|f| f.id == *id).count(),
            1,
            "{id:?}: {ro:?}"
        );
    }
}

/// A peer's only link fails (every handle on it does): it is left out,
/// but with no other link to the peer the next read still goes through
/// it — leaving out is a preference among links, not a refusal.
#[cfg(feature = "fault-injection")]
#[test]
fn a_peer_whose_every_link_is_left_out_is_still_read_through_them() {
    let faulty = || {
        rail_engine().faults(kvpoll::engine::Faults {
            handle_error_every: 1,
            ..Default::default()
        })
    };
    let mut lender = two_rails(Rails::builder(), rail_engine());
    let mut reader = Rails::builder()
        .relink_after(Duration::from_secs(600))
        .rail(Some("lo"), faulty())
        .rail(Some("lo"), faulty())
        .build()
        .unwrap();
    reader.register(BLOCKS).unwrap();
    let peer = reader.add_peer(&lender.local_metadata().unwrap()).unwrap();
    let (lo, ro) = (&mut Outcomes::default(), &mut Outcomes::default());
    let lent = blocks(0..1);
    let local = blocks(1..2);
    for (i, id) in [RequestId(1), RequestId(2), RequestId(3)]
        .into_iter()
        .enumerate()
    {
        let inc = lender.lend(id, &lent, 1, Duration::from_secs(600)).unwrap();
        read(&mut reader, peer, id, &local, &lent, inc)
            .unwrap_or_else(|e| panic!("read {i} refused: {e}"));
        assert!(settle(
            &mut reader,
            ro,
            &mut lender,
            lo,
            Duration::from_secs(30),
            |r, _| { r.failed_recving.iter().any(|f| f.id == id) }
        ));
    }
    // Both links were left out by now (the first two reads failed one on
    // each); the third went anyway.
    assert!(!reader.link_up(peer, 0) && !reader.link_up(peer, 1));
    assert_eq!(
        reader.stats().iter().map(|s| s.parts_failed).sum::<u64>(),
        3
    );
}

/// A lender of two rails and a reader of one: the reader reads and
/// reports through rail 0 only. The lend on the lender's rail 1 would
/// wait for its lease (600 s here); it is ended the sibling grace (5 s by
/// default) after rail 0's finished, and the lend is reported finished,
/// once.
#[test]
fn a_lend_a_reader_with_fewer_rails_read_is_freed_a_grace_after_its_rail_finished() {
    let mut lender = lender();
    let mut reader = Rails::builder()
        .rail(Some("lo"), rail_engine())
        .build()
        .unwrap();
    reader.register(BLOCKS).unwrap();
    let peer = reader.add_peer(&lender.local_metadata().unwrap()).unwrap();
    let (lo, ro) = (&mut Outcomes::default(), &mut Outcomes::default());
    let id = RequestId(7);
    let lent = blocks(0..4);
    let local = blocks(4..8);
    let inc = lender.lend(id, &lent, 1, Duration::from_secs(600)).unwrap();
    read(&mut reader, peer, id, &local, &lent, inc).unwrap();
    both_reported(&mut reader, ro, &mut lender, lo, Duration::from_secs(20));
    linger(&mut reader, ro, &mut lender, lo);
    assert_eq!(count(&lo.finished_sending, id), 1, "{lo:?}");
    assert!(lo.expired.is_empty(), "{lo:?}");
    assert!(holds(&reader, &local, &lent));
    assert_eq!(lender.in_flight(), 0);
}

/// A lender that is one engine (no rails) and a reader of two rails: the
/// engine's metadata links to the reader's rail 0, the read goes through
/// it, and both sides report once.
#[test]
fn a_reader_of_two_rails_reads_a_lender_of_one_engine_through_its_rail_0() {
    let mut lender = kvpoll::Engine::builder()
        .block_size(BLOCK)
        .ucx(ContextOptions::with_transports("tcp").option("NET_DEVICES", "lo"))
        .build()
        .unwrap();
    lender.register(BLOCKS).unwrap();
    let mut buf = vec![0u8; BLOCK as usize];
    for b in 0..8u32 {
        pattern::fill(SEED, u64::from(b), &mut buf);
        lender.write_block(0, BlockId(b), &buf).unwrap();
    }
    let mut reader = two_rails(Rails::builder().stripe_above(1), rail_engine());
    let peer = reader.add_peer(&lender.local_metadata().unwrap()).unwrap();
    assert!(reader.link_up(peer, 0) && !reader.link_up(peer, 1));
    let id = RequestId(3);
    let lent = blocks(0..8);
    let local = blocks(8..16);
    let inc = lender.lend(id, &lent, 1, Duration::from_secs(600)).unwrap();
    read(&mut reader, peer, id, &local, &lent, inc).unwrap();
    let (lo, ro) = (&mut Outcomes::default(), &mut Outcomes::default());
    let t = Instant::now();
    while ro.finished_recving.is_empty() || lo.finished_sending.is_empty() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "reader {ro:?}, lender {lo:?}"
        );
        reader.poll(ro);
        lender.poll(lo);
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(count(&ro.finished_recving, id), 1);
    assert_eq!(count(&lo.finished_sending, id), 1);
    assert!(holds(&reader, &local, &lent));
    assert_eq!(
        reader.stats()[1].parts_finished,
        0,
        "rail 1 reaches no rail of the lender"
    );
}

/// Rail 0 of the reader fails every handle. Past its time out it is not
/// given every read again: one read at a time goes to it as its probe,
/// the rest to rail 1, and a failed probe leaves it out again, longer.
#[cfg(feature = "fault-injection")]
#[test]
fn a_failed_link_past_its_time_out_carries_one_read_at_a_time_until_one_ends_well() {
    let faulty = rail_engine().faults(kvpoll::engine::Faults {
        handle_error_every: 1,
        ..Default::default()
    });
    let relink = Duration::from_millis(300);
    let (mut lender, mut reader, peer) = pair(Rails::builder().relink_after(relink), faulty);
    let (lo, ro) = (&mut Outcomes::default(), &mut Outcomes::default());
    let lease = Duration::from_secs(600);
    let mut next = 0u64;
    let mut read_wave = |reader: &mut Rails, lender: &mut Rails, n: u32| -> Vec<RequestId> {
        let mut ids = Vec::new();
        for i in 0..n {
            next += 1;
            let id = RequestId(next);
            let lent = blocks(i..i + 1);
            let local = blocks(32 + i..33 + i);
            let inc = lender.lend(id, &lent, 1, lease).unwrap();
            read(reader, peer, id, &local, &lent, inc).unwrap();
            ids.push(id);
        }
        ids
    };
    let wait_all = |reader: &mut Rails,
                    lender: &mut Rails,
                    ro: &mut Outcomes,
                    lo: &mut Outcomes,
                    ids: &[RequestId]| {
        assert!(settle(
            reader,
            ro,
            lender,
            lo,
            Duration::from_secs(30),
            |r, _| {
                ids.iter().all(|id| {
                    r.finished_recving.contains(id) || r.failed_recving.iter().any(|f| f.id == *id)
                })
            }
        ));
    };
    // Two reads: one per rail in turn; rail 0's fails and strikes it.
    let first = read_wave(&mut reader, &mut lender, 2);
    wait_all(&mut reader, &mut lender, ro, lo, &first);
    let s = reader.stats();
    assert_eq!((s[0].parts_failed, s[1].parts_finished), (1, 1), "{s:?}");
    assert!(!reader.link_up(peer, 0));
    // Past the time out: of four reads at once, one is rail 0's probe.
    std::thread::sleep(relink + Duration::from_millis(50));
    assert!(reader.link_up(peer, 0));
    let wave = read_wave(&mut reader, &mut lender, 4);
    wait_all(&mut reader, &mut lender, ro, lo, &wave);
    let s = reader.stats();
    assert_eq!((s[0].parts_failed, s[1].parts_finished), (2, 4), "{s:?}");
    // The failed probe left it out again, for twice as long.
    assert!(!reader.link_up(peer, 0));
    std::thread::sleep(relink + Duration::from_millis(50));
    assert!(
        !reader.link_up(peer, 0),
        "the second time out is twice the first"
    );
}

#[test]
fn a_peer_added_again_is_the_same_peer_and_once_removed_is_refused_and_notified_lends_end_on_every_rail(
) {
    let (mut lender, mut reader, peer) = pair(Rails::builder(), rail_engine());
    let (lo, ro) = (&mut Outcomes::default(), &mut Outcomes::default());
    // A client reconnecting gives the same metadata again: the same peer,
    // so removing an older id can never cut a newer one.
    let again = reader.add_peer(&lender.local_metadata().unwrap()).unwrap();
    assert_eq!(again, peer);
    // Nothing to read: the lender's lends on both rails end at once on the
    // reader's word (a lease far past the guard).
    let id = RequestId(7);
    let inc = lender
        .lend(id, &blocks(0..4), 1, Duration::from_secs(600))
        .unwrap();
    reader.notify_only(id, &[(peer, inc)]).unwrap();
    assert!(
        settle(
            &mut reader,
            ro,
            &mut lender,
            lo,
            Duration::from_secs(20),
            |_, l| { !l.finished_sending.is_empty() }
        ),
        "the lend was not ended by the reader's word: {lo:?}"
    );
    linger(&mut reader, ro, &mut lender, lo);
    assert_eq!(count(&lo.finished_sending, id), 1, "{lo:?}");
    // A waker from another thread ends a long wait early.
    let waker = reader.waker();
    let t = Instant::now();
    let wake = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        waker.wake();
    });
    let mut out = Outcomes::default();
    reader.wait(&mut out, Duration::from_secs(60));
    wake.join().unwrap();
    assert!(
        t.elapsed() < Duration::from_secs(30),
        "a wake did not end the wait ({:?})",
        t.elapsed()
    );
    assert!(!reader.is_deaf());
    // Removed: its id names nothing, and every rail's engine let it go.
    reader.remove_peer(peer).unwrap();
    reader.remove_peer(peer).unwrap();
    let inc = lender
        .lend(RequestId(8), &blocks(0..4), 1, Duration::from_secs(60))
        .unwrap();
    assert!(matches!(
        read(
            &mut reader,
            peer,
            RequestId(8),
            &blocks(0..4),
            &blocks(0..4),
            inc
        ),
        Err(RailsError::UnknownPeer { .. })
    ));
    assert!(matches!(
        reader.notify_only(RequestId(8), &[(peer, inc)]),
        Err(RailsError::UnknownPeer { .. })
    ));
    assert!(reader.stats().iter().all(|s| s.links_up == 0));
    assert_eq!(reader.in_flight(), 0);
    // Added again after its removal: a peer again, and read.
    let back = reader.add_peer(&lender.local_metadata().unwrap()).unwrap();
    read(
        &mut reader,
        back,
        RequestId(8),
        &blocks(8..12),
        &blocks(0..4),
        inc,
    )
    .unwrap();
    both_reported(&mut reader, ro, &mut lender, lo, Duration::from_secs(30));
    assert!(holds(&reader, &blocks(8..12), &blocks(0..4)));
}
