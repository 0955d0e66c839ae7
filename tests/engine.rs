//! The engine end to end over real UCX, in one process: several engines,
//! each with its own poller thread (adaptive idle policy, so a 2-core
//! machine is not starved), moving verified blocks.

mod common;

use std::time::{Duration, Instant};

use kvpoll::engine::{Engine, Outcomes, PeerError, RegionError, SubmitError, Transfer};
use kvpoll::ledger::{BlockId, Cause, Incarnation, PeerId, RequestId};
use kvpoll::transport::ucx::ContextOptions;

use common::pattern;

const BS: u64 = 4096;
const BLOCKS: u64 = 64;
const REGIONS: usize = 2;
const GUARD: Duration = Duration::from_secs(60);

fn engine(tls: &str, deadline: Duration) -> Engine {
    let mut e = Engine::builder()
        .block_size(BS)
        .ucx(ContextOptions::with_transports(tls))
        .read_deadline(deadline)
        .build()
        .expect("engine");
    for _ in 0..REGIONS {
        e.register(BLOCKS).unwrap();
    }
    e
}

fn seed(rank: u64, region: usize) -> u64 {
    rank * 100 + region as u64
}

fn fill(e: &Engine, rank: u64) {
    let mut buf = vec![0u8; BS as usize];
    for r in 0..REGIONS {
        for b in 0..BLOCKS {
            pattern::fill(seed(rank, r), b, &mut buf);
            e.write_block(r, BlockId(b as u32), &buf).unwrap();
        }
    }
}

fn holds(e: &Engine, local: u32, rank: u64, remote: u32) -> bool {
    let mut buf = vec![0u8; BS as usize];
    (0..REGIONS).all(|r| {
        e.read_block(r, BlockId(local), &mut buf).unwrap();
        pattern::check(seed(rank, r), u64::from(remote), &buf)
    })
}

#[cfg(feature = "fault-injection")]
fn snapshot(e: &Engine, blocks: &[BlockId]) -> Vec<u8> {
    let mut all = Vec::new();
    let mut buf = vec![0u8; BS as usize];
    for r in 0..REGIONS {
        for &b in blocks {
            e.read_block(r, b, &mut buf).unwrap();
            all.extend_from_slice(&buf);
        }
    }
    all
}

fn ids(v: &[u32]) -> Vec<BlockId> {
    v.iter().map(|&b| BlockId(b)).collect()
}

/// Polls `e` (appending to `out`) until `done(out)`, failing after GUARD.
fn wait_for(e: &mut Engine, out: &mut Outcomes, what: &str, done: impl Fn(&Outcomes) -> bool) {
    let t = Instant::now();
    while !done(out) {
        e.poll(out);
        assert!(t.elapsed() < GUARD, "timed out waiting for {what}: {out:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// `p` lends `remote` for `id` to one reader, and `d` reads it into `local`.
fn lend_and_read(
    p: &mut Engine,
    d: &mut Engine,
    peer: PeerId,
    id: RequestId,
    local: &[BlockId],
    remote: &[BlockId],
) {
    let lend = p.lend(id, remote, 1, GUARD).unwrap();
    d.read(
        id,
        &[Transfer {
            peer,
            local,
            remote,
            lend,
        }],
    )
    .unwrap();
}

fn connect(from: &mut Engine, to: &Engine) -> PeerId {
    from.add_peer(&to.local_metadata().unwrap()).unwrap()
}

#[test]
fn decode_at_tp2_reads_two_handles_from_two_prefill_ranks_and_every_block_matches() {
    let (mut p0, mut p1) = (engine("tcp", GUARD), engine("tcp", GUARD));
    fill(&p0, 0);
    fill(&p1, 1);
    let mut d = engine("tcp", GUARD);
    let (a, b) = (connect(&mut d, &p0), connect(&mut d, &p1));
    let id = RequestId(7);
    let (r0, r1) = (ids(&[10, 11, 12, 13]), ids(&[20, 21, 22, 23]));
    let lend0 = p0.lend(id, &r0, 1, GUARD).unwrap();
    let lend1 = p1.lend(id, &r1, 1, GUARD).unwrap();
    let (l0, l1) = (ids(&[0, 1, 2, 3]), ids(&[4, 5, 6, 7]));
    d.read(
        id,
        &[
            Transfer {
                peer: a,
                local: &l0,
                remote: &r0,
                lend: lend0,
            },
            Transfer {
                peer: b,
                local: &l1,
                remote: &r1,
                lend: lend1,
            },
        ],
    )
    .unwrap();
    let mut out = Outcomes::default();
    wait_for(&mut d, &mut out, "the read", |o| {
        !o.finished_recving.is_empty() || !o.failed_recving.is_empty()
    });
    assert_eq!(out.finished_recving, vec![id], "{out:?}");
    for i in 0..4 {
        assert!(holds(&d, i, 0, 10 + i), "block {i} from rank 0");
        assert!(holds(&d, 4 + i, 1, 20 + i), "block {} from rank 1", 4 + i);
    }
    // Each producer rank was notified, which released its lend.
    for p in [&mut p0, &mut p1] {
        let mut o = Outcomes::default();
        wait_for(p, &mut o, "the lend release", |o| {
            !o.finished_sending.is_empty()
        });
        assert_eq!(o.finished_sending, vec![id]);
        assert!(o.expired.is_empty());
    }
    assert_eq!(d.in_flight(), 0);
}

#[cfg(feature = "fault-injection")]
#[test]
fn a_failed_handle_is_reported_only_after_its_stalled_sibling_stopped_and_no_byte_changes_after() {
    let deadline = Duration::from_millis(1500);
    let (p0, mut p1) = (engine("tcp", GUARD), engine("tcp", GUARD));
    fill(&p1, 1);
    let mut d = engine("tcp", deadline);
    let (a, b) = (connect(&mut d, &p0), connect(&mut d, &p1));
    let before = snapshot(&d, &ids(&[0, 1, 2, 3]));

    // Handle 0 asks rank 0 for a block it does not have: a setup failure,
    // at once. Handle 1 reads from rank 1, which stops progressing: over tcp
    // its gets stay in flight.
    p1.stall(Duration::from_secs(4)).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let id = RequestId(9);
    let (l0, r0) = (ids(&[0, 1]), ids(&[999, 1000]));
    let (l1, r1) = (ids(&[2, 3]), ids(&[5, 6]));
    let t = Instant::now();
    let lend = Incarnation(0x1d1e); // nothing was lent under this incarnation
    d.read(
        id,
        &[
            Transfer {
                peer: a,
                local: &l0,
                remote: &r0,
                lend,
            },
            Transfer {
                peer: b,
                local: &l1,
                remote: &r1,
                lend,
            },
        ],
    )
    .unwrap();
    let mut out = Outcomes::default();
    wait_for(&mut d, &mut out, "the handle failure notice", |o| {
        !o.handle_failures.is_empty()
    });
    assert_eq!(out.handle_failures[0].0, id);
    assert_eq!(out.handle_failures[0].2.cause, Cause::Setup);
    assert!(
        out.failed_recving.is_empty(),
        "reported while a sibling was in flight"
    );

    wait_for(&mut d, &mut out, "the failure report", |o| {
        !o.failed_recving.is_empty()
    });
    // Deferred: not before the deadline forced the sibling to stop.
    assert!(
        t.elapsed() >= deadline,
        "reported before the sibling stopped"
    );
    let f = out.failed_recving[0].clone();
    assert_eq!(f.id, id);
    assert_eq!(f.reason.cause, Cause::Setup, "the first failure is kept");
    let mut invalid = out.blocks_of(&f).to_vec();
    invalid.sort();
    assert_eq!(invalid, ids(&[0, 1, 2, 3]));
    assert!(out.finished_recving.is_empty());

    // Rank 1 wakes up and would serve the gets; nothing may land any more.
    let reported = snapshot(&d, &ids(&[0, 1, 2, 3]));
    std::thread::sleep(Duration::from_secs(3));
    for _ in 0..100 {
        d.poll(&mut out);
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        snapshot(&d, &ids(&[0, 1, 2, 3])),
        reported,
        "a block changed after the report"
    );
    assert_eq!(reported, before, "blocks were written despite the failure");
    assert_eq!(out.failed_recving.len(), 1, "reported twice");
}

#[test]
fn unknown_peer_is_a_setup_failure_with_no_operation_posted() {
    let mut d = engine("tcp", GUARD);
    let id = RequestId(3);
    let (l, r) = (ids(&[1]), ids(&[1]));
    let lend = Incarnation(0x1d1e); // nothing was lent under this incarnation
    d.read(
        id,
        &[Transfer {
            peer: PeerId(42),
            local: &l,
            remote: &r,
            lend,
        }],
    )
    .unwrap();
    let mut out = Outcomes::default();
    wait_for(&mut d, &mut out, "the failure", |o| {
        !o.failed_recving.is_empty()
    });
    assert_eq!(out.failed_recving[0].reason.cause, Cause::Setup);
    assert_eq!(
        out.blocks_of(&out.failed_recving[0].clone()),
        &ids(&[1])[..]
    );
}

#[test]
fn push_is_done_only_after_the_consumer_acknowledged_and_the_data_is_there() {
    let mut p = engine("tcp", GUARD);
    fill(&p, 3);
    let mut c = engine("tcp", GUARD);
    let to_c = connect(&mut p, &c);
    let _to_p = connect(&mut c, &p); // the consumer acks through its own endpoint
    let id = RequestId(11);
    let dst = ids(&[30, 31, 32]);
    let lend = c.receive(id, &dst, 1, GUARD).unwrap();
    let src = ids(&[1, 2, 3]);
    p.write(
        id,
        &[Transfer {
            peer: to_c,
            local: &src,
            remote: &dst,
            lend,
        }],
        1,
        GUARD,
    )
    .unwrap();

    let mut po = Outcomes::default();
    wait_for(&mut p, &mut po, "the push", |o| {
        !o.finished_sending.is_empty() || !o.expired.is_empty()
    });
    assert_eq!(po.finished_sending, vec![id]);
    let mut co = Outcomes::default();
    wait_for(&mut c, &mut co, "the arrival", |o| {
        !o.finished_recving.is_empty()
    });
    assert_eq!(co.finished_recving, vec![id]);
    for i in 0..3 {
        assert!(holds(&c, 30 + i, 3, 1 + i), "block {}", 30 + i);
    }
}

#[test]
fn a_failed_push_is_never_done_and_is_reported_failed_with_its_reason_once() {
    let mut p = engine("tcp", GUARD);
    let c = engine("tcp", GUARD);
    let to_c = connect(&mut p, &c);
    let id = RequestId(12);
    let (src, dst) = (ids(&[1]), ids(&[5000])); // beyond the consumer's blocks
    let lend = Incarnation(0x1d1e); // nothing was lent under this incarnation
    p.write(
        id,
        &[Transfer {
            peer: to_c,
            local: &src,
            remote: &dst,
            lend,
        }],
        1,
        Duration::from_millis(300),
    )
    .unwrap();
    let mut out = Outcomes::default();
    wait_for(&mut p, &mut out, "the failure", |o| {
        !o.failed_sending.is_empty()
    });
    assert_eq!(out.failed_sending.len(), 1);
    assert_eq!(out.failed_sending[0].id, id);
    assert_eq!(out.failed_sending[0].reason.cause, Cause::Setup);
    assert!(
        out.finished_sending.is_empty(),
        "a failed push was reported done"
    );
    // Past the lease: no second report (no expiry after the failure).
    for _ in 0..80 {
        p.poll(&mut out);
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(out.failed_sending.len(), 1, "reported twice");
    assert!(out.expired.is_empty(), "reported twice: {out:?}");
}

#[test]
fn a_lend_is_released_only_after_both_consumer_ranks_notified() {
    let mut p = engine("tcp", GUARD);
    fill(&p, 4);
    let (mut d1, mut d2) = (engine("tcp", GUARD), engine("tcp", GUARD));
    let (a, b) = (connect(&mut d1, &p), connect(&mut d2, &p));
    let id = RequestId(21);
    let lent = ids(&[40, 41, 42, 43]);
    let lend = p.lend(id, &lent, 2, GUARD).unwrap();
    let (first, second) = (ids(&[40, 41]), ids(&[42, 43]));
    let local = ids(&[0, 1]);
    d1.read(
        id,
        &[Transfer {
            peer: a,
            local: &local,
            remote: &first,
            lend,
        }],
    )
    .unwrap();
    let mut o1 = Outcomes::default();
    wait_for(&mut d1, &mut o1, "reader 1", |o| {
        !o.finished_recving.is_empty()
    });
    // One of two notifications: still lent.
    let mut po = Outcomes::default();
    for _ in 0..100 {
        p.poll(&mut po);
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(
        po.finished_sending.is_empty(),
        "released after one of two readers"
    );
    d2.read(
        id,
        &[Transfer {
            peer: b,
            local: &local,
            remote: &second,
            lend,
        }],
    )
    .unwrap();
    let mut o2 = Outcomes::default();
    wait_for(&mut d2, &mut o2, "reader 2", |o| {
        !o.finished_recving.is_empty()
    });
    wait_for(&mut p, &mut po, "the release", |o| {
        !o.finished_sending.is_empty()
    });
    assert_eq!(po.finished_sending, vec![id]);
    assert!(holds(&d2, 1, 4, 43));
}

#[test]
fn a_heartbeat_keeps_a_lend_alive_past_the_lease_of_its_twin() {
    let mut p = engine("tcp", GUARD);
    let lease = Duration::from_millis(400);
    let (kept, dropped) = (RequestId(31), RequestId(32));
    let lend = p.lend(kept, &ids(&[1]), 1, lease).unwrap();
    p.lend(dropped, &ids(&[2]), 1, lease).unwrap();
    p.heartbeat(&[kept, RequestId(999)], Duration::from_secs(60))
        .unwrap();
    let mut out = Outcomes::default();
    wait_for(&mut p, &mut out, "the twin's expiry", |o| {
        !o.expired.is_empty()
    });
    assert_eq!(out.expired, vec![dropped]);
    assert_eq!(p.in_flight(), 1);
    assert_eq!(p.ledger_stats().ignored_heartbeats, 1);
    // The kept one is still lent: a reader can still be served and release it.
    fill(&p, 5);
    let mut d = engine("tcp", GUARD);
    let peer = connect(&mut d, &p);
    d.read(
        kept,
        &[Transfer {
            peer,
            local: &ids(&[0]),
            remote: &ids(&[1]),
            lend,
        }],
    )
    .unwrap();
    wait_for(&mut p, &mut out, "the release", |o| {
        !o.finished_sending.is_empty()
    });
    assert_eq!(out.finished_sending, vec![kept]);
}

#[cfg(feature = "fault-injection")]
#[test]
fn abort_fails_the_request_only_after_its_operations_were_cancelled() {
    let mut p = engine("tcp", GUARD);
    let mut d = engine("tcp", GUARD);
    let peer = connect(&mut d, &p);
    p.stall(Duration::from_secs(2)).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let id = RequestId(41);
    let lend = Incarnation(0x1d1e); // nothing was lent under this incarnation
    d.read(
        id,
        &[Transfer {
            peer,
            local: &ids(&[0, 1]),
            remote: &ids(&[0, 1]),
            lend,
        }],
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let mut out = Outcomes::default();
    d.poll(&mut out);
    assert!(out.failed_recving.is_empty() && out.finished_recving.is_empty());
    d.abort(id).unwrap();
    wait_for(&mut d, &mut out, "the abort", |o| {
        !o.failed_recving.is_empty()
    });
    assert_eq!(out.failed_recving[0].id, id);
    assert_eq!(out.failed_recving[0].reason.cause, Cause::Aborted);
    assert!(matches!(d.abort(id), Err(SubmitError::UnknownRequest(_))));
}

#[test]
fn malformed_metadata_and_bad_requests_give_typed_errors_and_change_nothing() {
    let mut d = engine("tcp", GUARD);
    assert!(matches!(
        d.add_peer(b"not metadata"),
        Err(PeerError::Metadata(_))
    ));
    let mut meta = engine("tcp", GUARD).local_metadata().unwrap();
    let n = meta.len();
    meta[n / 2] ^= 0x10;
    assert!(matches!(d.add_peer(&meta), Err(PeerError::Metadata(_))));
    let other = Engine::builder().block_size(8192).build().unwrap();
    assert!(matches!(
        d.add_peer(&other.local_metadata().unwrap()),
        Err(PeerError::Metadata(
            kvpoll::metadata::MetadataError::IncompatibleLayout { .. }
        ))
    ));
    let (l, r) = (ids(&[1]), ids(&[1]));
    assert!(matches!(
        d.read(
            RequestId(1),
            &[Transfer {
                peer: PeerId(0),
                local: &ids(&[1, 2]),
                remote: &r,
                lend: Incarnation(0x1d1e),
            }]
        ),
        Err(SubmitError::BadPairing { .. })
    ));
    assert!(matches!(
        d.read(
            RequestId(1),
            &[Transfer {
                peer: PeerId(0),
                local: &ids(&[64]),
                remote: &r,
                lend: Incarnation(0x1d1e),
            }]
        ),
        Err(SubmitError::BlockOutOfRange { .. })
    ));
    assert_eq!(d.in_flight(), 0);
    // No peer was added by the refused metadata: PeerId(0) is unknown.
    let lend = Incarnation(0x1d1e); // nothing was lent under this incarnation
    d.read(
        RequestId(1),
        &[Transfer {
            peer: PeerId(0),
            local: &l,
            remote: &r,
            lend,
        }],
    )
    .unwrap();
    assert!(matches!(
        d.read(
            RequestId(1),
            &[Transfer {
                peer: PeerId(0),
                local: &l,
                remote: &r,
                lend: Incarnation(0x1d1e),
            }]
        ),
        Err(SubmitError::Duplicate(_))
    ));
    let mut out = Outcomes::default();
    wait_for(&mut d, &mut out, "the setup failure", |o| {
        !o.failed_recving.is_empty()
    });
    assert_eq!(out.failed_recving[0].reason.cause, Cause::Setup);
}

#[cfg(feature = "fault-injection")]
#[test]
fn shutdown_reports_requests_in_flight_and_is_idempotent() {
    let mut p = engine("tcp", GUARD);
    let mut d = engine("tcp", GUARD);
    let peer = connect(&mut d, &p);
    p.stall(Duration::from_secs(2)).unwrap();
    let id = RequestId(51);
    let lend = Incarnation(0x1d1e); // nothing was lent under this incarnation
    d.read(
        id,
        &[Transfer {
            peer,
            local: &ids(&[0]),
            remote: &ids(&[0]),
            lend,
        }],
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    d.shutdown();
    d.shutdown();
    let mut out = Outcomes::default();
    d.poll(&mut out);
    assert_eq!(out.failed_recving.len(), 1, "{out:?}");
    assert_eq!(out.failed_recving[0].id, id);
    assert!(matches!(
        d.read(RequestId(52), &[]),
        Err(SubmitError::Stopped(kvpoll::Stopped::Shutdown))
    ));
}

#[cfg(feature = "fault-injection")]
#[test]
fn a_failed_release_holds_the_request_until_the_retry_releases_it() {
    let p = engine("tcp", GUARD);
    fill(&p, 6);
    let retry = Duration::from_millis(600);
    let mut d = Engine::builder()
        // Reads of memory no lend guards (confirmation: tests/fencing.rs).
        .confirm_reads(false)
        .block_size(BS)
        .ucx(ContextOptions::with_transports("tcp"))
        .faults(kvpoll::engine::Faults {
            release_failure_every: 1,
            release_retry_after: retry,
            ..Default::default()
        })
        .build()
        .unwrap();
    for _ in 0..REGIONS {
        d.register(BLOCKS).unwrap();
    }
    let peer = connect(&mut d, &p);
    let t = Instant::now();
    let lend = Incarnation(0x1d1e); // nothing was lent under this incarnation
    d.read(
        RequestId(61),
        &[Transfer {
            peer,
            local: &ids(&[0]),
            remote: &ids(&[9]),
            lend,
        }],
    )
    .unwrap();
    let mut out = Outcomes::default();
    wait_for(&mut d, &mut out, "the read", |o| {
        !o.finished_recving.is_empty()
    });
    assert!(t.elapsed() >= retry, "reported while its handle was held");
    assert!(holds(&d, 0, 6, 9));
    assert!(out.failed_recving.is_empty());
}

#[test]
fn malformed_or_unknown_notifications_are_counted_and_change_nothing() {
    use kvpoll::metadata::PeerMetadata;
    use kvpoll::notification::{NoteKind, Notification};
    use kvpoll::transport::ucx::{Context, Endpoint, Worker};

    let mut p = engine("tcp", GUARD);
    let id = RequestId(71);
    let lend = p.lend(id, &ids(&[1]), 1, GUARD).unwrap();
    let meta = PeerMetadata::decode(&p.local_metadata().unwrap()).unwrap();

    // A raw UCX worker plays a misbehaving peer.
    let ctx = Context::new(&ContextOptions::with_transports("tcp")).unwrap();
    let w = Worker::new(&ctx).unwrap();
    let ep = Endpoint::connect(&w, &meta.worker, 1).unwrap();
    let note = |kind, id, sender| {
        Notification {
            kind,
            id,
            incarnation: lend,
            nonce: Incarnation(1),
            sender,
            // The block lent.
            blocks: kvpoll::notification::BlocksRead::of(ids(&[1]).into_iter()),
        }
        .encode()
    };
    // Sealed when the suite runs keyed: a keyed peer's junk is judged as
    // junk, not dropped for want of a tag.
    let mut seal = common::RawSeal::new();
    let mut damaged = note(NoteKind::ReadDone, id, 1);
    damaged[5] ^= 1;
    let sends: [&[u8]; 4] = [
        b"hello",
        &damaged,
        &note(NoteKind::ReadDone, RequestId(999), 1),
        &[0u8; kvpoll::notification::LEN],
    ];
    for (i, payload) in sends.iter().enumerate() {
        let message = seal.wrap(meta.instance, payload);
        ep.send_active_message(kvpoll::engine::NOTIFY_AM_ID, &message, i as u64)
            .unwrap();
    }
    let t = Instant::now();
    while p.poller_stats().malformed_notifications < 3
        || p.ledger_stats().rejected_notifications < 1
    {
        w.progress();
        assert!(t.elapsed() < GUARD, "{:?}", p.poller_stats());
    }
    let mut out = Outcomes::default();
    p.poll(&mut out);
    assert!(out.is_empty(), "{out:?}");
    assert_eq!(p.in_flight(), 1, "the lend must still be held");

    // The same channel with a good notification releases it.
    let good = seal.wrap(meta.instance, &note(NoteKind::ReadDone, id, 1));
    ep.send_active_message(kvpoll::engine::NOTIFY_AM_ID, &good, 9)
        .unwrap();
    let t = Instant::now();
    while out.finished_sending.is_empty() {
        w.progress();
        p.poll(&mut out);
        assert!(t.elapsed() < GUARD);
    }
    assert_eq!(out.finished_sending, vec![id]);
}

#[test]
fn a_full_prefix_hit_with_nothing_to_read_is_reported_finished_at_once() {
    let mut d = engine("tcp", GUARD);
    d.read(RequestId(81), &[]).unwrap();
    let mut out = Outcomes::default();
    wait_for(&mut d, &mut out, "the prefix hit", |o| {
        !o.finished_recving.is_empty()
    });
    assert_eq!(out.finished_recving, vec![RequestId(81)]);
    assert_eq!(d.in_flight(), 0);
}

#[test]
fn a_small_ledger_reuses_its_slots_without_losing_a_request() {
    // One slot, many requests in a row: each report hands the slot back
    // just before the next request needs it.
    let mut d = Engine::builder()
        // Reads of memory no lend guards (confirmation: tests/fencing.rs).
        .confirm_reads(false)
        .block_size(BS)
        .ucx(ContextOptions::with_transports("tcp"))
        .ledger(1, 8)
        .build()
        .unwrap();
    d.register(BLOCKS).unwrap();
    let mut out = Outcomes::default();
    for i in 0..200u64 {
        d.read(RequestId(i), &[]).unwrap();
        let want = i as usize + 1;
        wait_for(&mut d, &mut out, "the prefix hit", |o| {
            o.finished_recving.len() == want
        });
    }
    assert!(matches!(
        {
            d.read(RequestId(1000), &[]).unwrap();
            d.read(RequestId(1001), &[])
        },
        Err(SubmitError::Full(1))
    ));
}

#[test]
fn the_shipped_two_core_map_places_the_poller_on_cpu_1() {
    use kvpoll::placement::{CoreMap, Topology};
    let topo = Topology::detect().unwrap();
    if topo.online_cpus().len() < 2 {
        eprintln!("skipped: this machine has one CPU");
        return;
    }
    let map = CoreMap::load(
        concat!(env!("CARGO_MANIFEST_DIR"), "/tuning/two-core.toml"),
        &topo,
    )
    .unwrap();
    let mut e = Engine::builder().core_map(&map).unwrap().build().unwrap();
    assert_eq!(e.poller_core(), Some(1));
    e.read(RequestId(1), &[]).unwrap();
    let mut out = Outcomes::default();
    wait_for(&mut e, &mut out, "the prefix hit", |o| {
        !o.finished_recving.is_empty()
    });
}

#[test]
fn reads_land_in_caller_registered_memory() {
    let p = engine("tcp", GUARD);
    fill(&p, 8);
    let mut d = Engine::builder()
        // Reads of memory no lend guards (confirmation: tests/fencing.rs).
        .confirm_reads(false)
        .block_size(BS)
        .ucx(ContextOptions::with_transports("tcp"))
        .build()
        .unwrap();
    let mut layers: Vec<Vec<u8>> = (0..REGIONS)
        .map(|_| vec![0u8; (BLOCKS * BS) as usize])
        .collect();
    for layer in &mut layers {
        // SAFETY: the buffers outlive `d` (dropped first, below) and are not
        // touched until it is shut down.
        unsafe { d.register_memory(layer.as_mut_ptr(), layer.len()).unwrap() };
    }
    // SAFETY: as above; a length that is not whole blocks is refused.
    assert!(matches!(
        unsafe { d.register_memory(layers[0].as_mut_ptr(), 100) },
        Err(RegionError::NotWholeBlocks { len: 100, .. })
    ));
    let peer = connect(&mut d, &p);
    let lend = Incarnation(0x1d1e); // nothing was lent under this incarnation
    d.read(
        RequestId(91),
        &[Transfer {
            peer,
            local: &ids(&[3]),
            remote: &ids(&[17]),
            lend,
        }],
    )
    .unwrap();
    let mut out = Outcomes::default();
    wait_for(&mut d, &mut out, "the read", |o| {
        !o.finished_recving.is_empty()
    });
    d.shutdown();
    drop(d);
    for (r, layer) in layers.iter().enumerate() {
        let block = &layer[(3 * BS) as usize..(4 * BS) as usize];
        assert!(pattern::check(seed(8, r), 17, block), "layer {r}");
    }
}

#[test]
fn metrics_count_what_was_reported_the_operations_and_the_bytes() {
    let mut p = engine("tcp", GUARD);
    let mut d = engine("tcp", GUARD);
    fill(&p, 4);
    let peer = connect(&mut d, &p);
    let id = RequestId(120);
    // Not consecutive on the remote side: one operation per block.
    let lend = p.lend(id, &ids(&[1, 3]), 1, GUARD).unwrap();
    d.read(
        id,
        &[Transfer {
            peer,
            local: &ids(&[7, 8]),
            remote: &ids(&[1, 3]),
            lend,
        }],
    )
    .unwrap();
    let mut out = Outcomes::default();
    wait_for(&mut d, &mut out, "the read", |o| o.finished_recving == [id]);
    let mut pout = Outcomes::default();
    wait_for(&mut p, &mut pout, "the release", |o| {
        o.finished_sending == [id]
    });
    d.shutdown(); // publishes the poller's last counters
    let m = d.metrics();
    assert_eq!(m.requests.finished_recving, 1);
    assert_eq!(m.latency.read.count(), 1);
    // Two blocks in each of the regions.
    let ops = 2 * REGIONS as u64;
    assert_eq!(m.pollers[0].ops_posted, ops);
    assert_eq!(m.pollers[0].ops_completed, ops);
    assert_eq!(m.pollers[0].bytes, ops * BS);
    assert!(
        m.pollers[0].busy_ns > 0,
        "a poller that moved blocks was busy"
    );
    assert_eq!(p.metrics().requests.finished_sending, 1);
}

#[cfg(feature = "fault-injection")]
#[test]
fn reads_that_finish_together_tell_their_lender_in_fewer_messages_and_need_no_answer_where_shm_gets_are_one_sided(
) {
    // Without cma: UCX progresses one cma operation per endpoint per
    // progress call, so gets over cma complete one by one and their reads
    // never finish together (docs/design.md §4).
    let tls = "posix,sysv";
    let mut p = engine(tls, GUARD);
    fill(&p, 6);
    let mut d = engine(tls, GUARD);
    let peer = connect(&mut d, &p);
    let n = 16u32;
    let lends: Vec<Incarnation> = (0..n)
        .map(|i| {
            p.lend(RequestId(100 + u64::from(i)), &ids(&[i]), 1, GUARD)
                .unwrap()
        })
        .collect();
    // The reader's poller sleeps while the reads are queued behind the
    // stall: it then posts them all at once, and they complete together.
    // (Shorter than the read heartbeat period, 250 ms: no heartbeat is due.)
    d.stall(Duration::from_millis(100)).unwrap();
    let locals: Vec<Vec<BlockId>> = (0..n).map(|i| ids(&[i])).collect();
    for i in 0..n {
        d.read(
            RequestId(100 + u64::from(i)),
            &[Transfer {
                peer,
                local: &locals[i as usize],
                remote: &locals[i as usize],
                lend: lends[i as usize],
            }],
        )
        .unwrap();
    }
    let mut out = Outcomes::default();
    wait_for(&mut d, &mut out, "the reads", |o| {
        o.finished_recving.len() + o.failed_recving.len() == n as usize
    });
    assert!(out.failed_recving.is_empty(), "{out:?}");
    let mut po = Outcomes::default();
    wait_for(&mut p, &mut po, "the releases", |o| {
        o.finished_sending.len() == n as usize
    });
    for i in 0..n {
        assert!(holds(&d, i, 6, i), "block {i}");
    }
    // Each read is confirmed from its lend word over shared memory: one
    // one-way note a read, in fewer messages, and no answer from the
    // lender (the counters are published every 1024 poller iterations and
    // before the poller blocks: wait for them).
    let settled = |e: &Engine| {
        let t = Instant::now();
        loop {
            let s = e.poller_stats();
            if s.notifications_sent >= u64::from(n) || t.elapsed() > GUARD {
                return s;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    let ds = settled(&d);
    // The lender went idle long since (it reported the releases): its
    // poller blocked, publishing its counters first.
    std::thread::sleep(Duration::from_millis(100));
    let ps = p.poller_stats();
    assert!(ps.idle_iterations > 0, "{ps:?}");
    assert_eq!(ds.notifications_sent, u64::from(n), "{ds:?}");
    assert!(ds.notification_messages < ds.notifications_sent, "{ds:?}");
    // No answer is needed where a get from UCX-allocated shared memory is
    // one-sided over posix (UCX before 1.22). On UCX 1.22 without cma such
    // a get waits for the lender's progress (docs/design.md §4): a word
    // read that misses the first progress after it was posted makes its
    // connection ask, so there the lender may answer some reads (every
    // read still confirmed). With cma it is one-sided on 1.22 too
    // (`kvpoll-cli/tests/lend_words.rs`).
    let v = ucx_sys::Version::runtime();
    if (v.major, v.minor) < (1, 22) {
        assert_eq!(ps.notifications_sent, 0, "the lender answered: {ps:?}");
    }
    assert_eq!(ps.malformed_notifications, 0, "{ps:?}");
    assert_eq!(ps.rejected_notifications, 0, "{ps:?}");
}

#[test]
fn wait_blocks_until_a_report_and_never_misses_one() {
    let mut p = engine("posix,sysv,cma", GUARD);
    fill(&p, 7);
    let mut d = engine("posix,sysv,cma", GUARD);
    let peer = connect(&mut d, &p);
    let (local, remote) = (ids(&[3]), ids(&[5]));
    // One read at a time, each waited for: a lost wake-up leaves a wait
    // blocked to its (long) timeout, with nothing reported.
    let mut out = Outcomes::default();
    for i in 0..300u64 {
        let id = RequestId(1000 + i);
        lend_and_read(&mut p, &mut d, peer, id, &local, &remote);
        out.clear();
        let t = Instant::now();
        // Returns 0 at most once per publication it already took.
        while out.finished_recving.is_empty() && out.failed_recving.is_empty() {
            d.wait(&mut out, GUARD);
            assert!(t.elapsed() < GUARD, "read {i}: the wait was not woken");
        }
        assert_eq!(out.finished_recving, vec![id], "read {i}: {out:?}");
        let mut po = Outcomes::default();
        wait_for(&mut p, &mut po, "the release", |o| {
            !o.finished_sending.is_empty()
        });
    }
    assert!(holds(&d, 3, 7, 5));
}

#[test]
fn wait_with_nothing_to_report_returns_at_its_timeout_or_when_woken() {
    let mut e = engine("tcp", GUARD);
    let mut out = Outcomes::default();
    let t = Instant::now();
    assert_eq!(e.wait(&mut out, Duration::from_millis(30)), 0);
    assert!(
        t.elapsed() >= Duration::from_millis(30),
        "{:?}",
        t.elapsed()
    );
    // Woken from another thread long before its timeout.
    let waker = e.waker();
    let wake = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        waker.wake();
    });
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(50) {
        assert_eq!(e.wait(&mut out, GUARD), 0);
    }
    wake.join().unwrap();
    assert!(t.elapsed() < GUARD);
    // A wake with nobody waiting: the next wait returns at once.
    e.waker().wake();
    let t = Instant::now();
    assert_eq!(e.wait(&mut out, GUARD), 0);
    assert!(t.elapsed() < GUARD);
    assert!(out.is_empty());
}

#[cfg(feature = "fault-injection")]
#[test]
fn a_read_answered_before_the_lenders_poller_took_the_lend_is_confirmed_not_refused() {
    // The lender's poller is slow between draining its commands and
    // progressing UCX: the lend below is pushed while it sleeps there,
    // and the reader's question arrives before it looks at its commands
    // again. Causally the lend came first (the reader learnt of it after
    // it was submitted), so the question must find it.
    let tls = "posix,sysv,cma";
    let mut p = Engine::builder()
        .block_size(BS)
        .ucx(ContextOptions::with_transports(tls))
        .faults(kvpoll::engine::Faults {
            slow_progress: Duration::from_millis(100),
            ..Default::default()
        })
        .build()
        .unwrap();
    for _ in 0..REGIONS {
        p.register(BLOCKS).unwrap();
    }
    fill(&p, 8);
    let mut d = engine(tls, GUARD);
    let peer = connect(&mut d, &p);
    let (local, remote) = (ids(&[1]), ids(&[2]));
    for i in 0..5u64 {
        let id = RequestId(500 + i);
        lend_and_read(&mut p, &mut d, peer, id, &local, &remote);
        let mut out = Outcomes::default();
        wait_for(&mut d, &mut out, "the read", |o| {
            !o.finished_recving.is_empty() || !o.failed_recving.is_empty()
        });
        assert_eq!(out.finished_recving, vec![id], "read {i}: {out:?}");
        let mut po = Outcomes::default();
        wait_for(&mut p, &mut po, "the release", |o| {
            !o.finished_sending.is_empty()
        });
    }
}

/// Block pairs consecutive on both sides (local `l, l+1, …` from remote
/// `r, r+1, …`) travel as one operation per region, in reads and in
/// pushes alike; a pair that breaks the run starts a new one. Every block
/// still lands where its pair says, over shared memory and over tcp.
#[test]
fn consecutive_blocks_travel_as_one_operation_per_region_and_land_where_their_pairs_say() {
    for tls in ["posix,sysv,cma", "tcp"] {
        // Runs: 7..=9 <- 1..=3; 5 <- 20; 10 <- 21 (the remote side follows
        // 20, the local side does not follow 5); 11 <- 40 (the local side
        // follows 10, the remote side does not follow 21).
        let local = ids(&[7, 8, 9, 5, 10, 11]);
        let remote = ids(&[1, 2, 3, 20, 21, 40]);
        let runs = 4u64;

        let mut p = engine(tls, GUARD);
        let mut d = engine(tls, GUARD);
        fill(&p, 6);
        let peer = connect(&mut d, &p);
        lend_and_read(&mut p, &mut d, peer, RequestId(1), &local, &remote);
        let mut out = Outcomes::default();
        wait_for(&mut d, &mut out, "the read", |o| {
            !o.finished_recving.is_empty() || !o.failed_recving.is_empty()
        });
        assert_eq!(out.finished_recving, [RequestId(1)], "{tls}: {out:?}");
        let pairs: Vec<(u32, u32)> = local.iter().zip(&remote).map(|(l, r)| (l.0, r.0)).collect();
        let n = local.len() as u64;
        landed_in_runs(&mut d, &pairs, 6, n, runs, &format!("{tls} read"));
        let completed = d.metrics().pollers[0].ops_completed;
        assert_eq!(completed, runs * REGIONS as u64, "{tls} read: completions");
        p.shutdown();

        // The same pairs pushed: the writer's local blocks are the sources.
        let mut w = engine(tls, GUARD);
        let mut c = engine(tls, GUARD);
        fill(&w, 7);
        let to_c = connect(&mut w, &c);
        let _to_w = connect(&mut c, &w);
        let id = RequestId(2);
        let lend = c.receive(id, &remote, 1, GUARD).unwrap();
        w.write(
            id,
            &[Transfer {
                peer: to_c,
                local: &local,
                remote: &remote,
                lend,
            }],
            1,
            GUARD,
        )
        .unwrap();
        let mut wo = Outcomes::default();
        wait_for(&mut w, &mut wo, "the push", |o| {
            !o.finished_sending.is_empty() || !o.failed_sending.is_empty()
        });
        assert_eq!(wo.finished_sending, [id], "{tls}: {wo:?}");
        let mut co = Outcomes::default();
        wait_for(&mut c, &mut co, "the arrival", |o| {
            !o.finished_recving.is_empty()
        });
        let pairs: Vec<(u32, u32)> = remote.iter().zip(&local).map(|(r, l)| (r.0, l.0)).collect();
        // The destination holds the bytes; the writer counts the operations.
        for &(dst, src) in &pairs {
            assert!(holds(&c, dst, 7, src), "{tls} push: block {dst} from {src}");
        }
        landed_in_runs(&mut w, &[], 7, n, runs, &format!("{tls} push"));
    }
}

/// Checks that each `(local, remote)` block of `pairs` holds `rank`'s
/// pattern of the remote block, then shuts `e` down and checks that it
/// moved `blocks` blocks of each region in `runs` operations per region.
fn landed_in_runs(
    e: &mut Engine,
    pairs: &[(u32, u32)],
    rank: u64,
    blocks: u64,
    runs: u64,
    what: &str,
) {
    for &(dst, src) in pairs {
        assert!(holds(e, dst, rank, src), "{what}: block {dst} from {src}");
    }
    e.shutdown();
    let m = e.metrics();
    assert_eq!(
        m.pollers[0].ops_posted,
        runs * REGIONS as u64,
        "{what}: operations"
    );
    assert_eq!(
        m.pollers[0].bytes,
        blocks * REGIONS as u64 * BS,
        "{what}: bytes"
    );
}
