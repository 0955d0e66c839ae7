//! One test per rule of docs/design.md §2 (and the vLLM connector's cases),
//! driving the ledger directly.

mod common;

use common::*;
use kvpoll::ledger::*;
use kvpoll::ring;
use kvpoll::transport::sim::{CANCELED, ENDPOINT_TIMEOUT, IO_ERROR};

const T: u64 = 1_000_000;

// -- 1. exactly once ----------------------------------------------------------

#[test]
fn read_with_all_handles_completed_is_reported_finished_once() {
    let mut h = Harness::new(4);
    let key = h.begin_posted(1, Kind::Read, 3, &blocks(&[1, 2]), T);
    h.complete(key, 2, Ok(()));
    h.complete(key, 0, Ok(()));
    assert!(h.reports().is_empty());
    h.complete(key, 1, Ok(()));
    assert_eq!(h.reports_of(1), [Outcome::Finished]);
    // A duplicate completion after the report is refused and reports nothing.
    assert_eq!(
        h.slots
            .completed(hk(key, 1), Ok(()), &mut |_| panic!("event")),
        Err(InputError::AlreadyEnded(hk(key, 1)))
    );
    assert_eq!(h.retire(key), []);
    assert_eq!(h.ledger.stats().in_use, 0);
}

#[test]
fn reports_survive_a_full_event_ring_while_the_engine_stops_polling() {
    let mut h = Harness::new(64);
    let (mut tx, mut rx) = ring::events::<Event>(4, 8);
    for id in 0..40 {
        let key = h.begin_posted(id, Kind::Read, 1, &[], T);
        let mut backpressure = false;
        h.slots
            .completed(hk(key, 0), Ok(()), &mut |e| {
                backpressure |= tx.publish(e).is_err();
            })
            .unwrap();
        assert_eq!(backpressure, tx.pending() > 8);
    }
    // The engine comes back and drains everything: each request exactly once.
    let mut seen = Vec::new();
    while seen.len() < 40 {
        tx.flush();
        while let Some(e) = rx.recv() {
            h.retire(e.key);
            seen.push(e.id.0);
        }
    }
    seen.sort();
    assert_eq!(seen, (0..40).collect::<Vec<_>>());
    assert!(tx.overflowed() > 0);
    assert_eq!(h.ledger.stats().in_use, 0);
}

// -- 2. deferred failure (the vLLM cases) -------------------------------------

#[test]
fn two_handles_err_then_in_progress_then_err_is_reported_failed_once_at_the_second_poll() {
    let mut h = Harness::new(4);
    let key = h.begin_posted(7, Kind::Read, 2, &blocks(&[10, 11, 12]), T);
    // Poll 1: handle 0 ERR, handle 1 still in progress.
    h.complete(key, 0, err(IO_ERROR));
    assert!(h.reports().is_empty(), "failure must wait for quiescence");
    assert_eq!(h.notices_of(7), 1);
    // Poll 2: handle 1 ERR.
    h.complete(key, 1, err(IO_ERROR));
    assert_eq!(
        h.reports_of(7),
        [Outcome::Failed(Reason::new(Cause::Transfer, IO_ERROR))]
    );
    assert_eq!(h.retire(key), blocks(&[10, 11, 12]));
}

#[test]
fn success_of_a_sibling_never_hides_an_earlier_failure() {
    let mut h = Harness::new(4);
    let key = h.begin_posted(1, Kind::Read, 2, &blocks(&[4]), T);
    h.complete(key, 0, err(IO_ERROR));
    h.complete(key, 1, Ok(()));
    assert!(matches!(h.reports_of(1)[..], [Outcome::Failed(_)]));
    assert_eq!(h.retire(key), blocks(&[4]));
}

// -- 3. setup failures count --------------------------------------------------

#[test]
fn setup_failure_with_no_handle_posted_is_reported_failed_once() {
    let mut h = Harness::new(4);
    let key = h.begin(1, Kind::Read, 2, &blocks(&[3]), T);
    let setup = Reason::of(Cause::Setup);
    for i in 0..2 {
        let events = &mut h.events;
        h.slots
            .setup_failed(hk(key, i), setup, &mut |e| events.push(e))
            .unwrap();
    }
    assert_eq!(h.reports_of(1), [Outcome::Failed(setup)]);
    assert_eq!(h.retire(key), blocks(&[3]));
}

#[test]
fn setup_failure_is_recorded_at_once_but_the_request_waits_for_its_other_handles() {
    let mut h = Harness::new(4);
    let key = h.begin(1, Kind::Read, 2, &[], T);
    h.slots.posting(hk(key, 1)).unwrap();
    let events = &mut h.events;
    h.slots
        .setup_failed(hk(key, 0), Reason::of(Cause::Setup), &mut |e| {
            events.push(e)
        })
        .unwrap();
    assert_eq!(h.notices_of(1), 1);
    assert!(h.reports().is_empty());
    let v = h.slots.snapshot(key).unwrap();
    assert_eq!((v.stopped, v.failed, v.posted), (0b01, 0b01, 0b10));
    h.complete(key, 1, Ok(()));
    assert!(matches!(h.reports_of(1)[..], [Outcome::Failed(r)] if r.cause == Cause::Setup));
}

// -- 4. release failures retain -----------------------------------------------

#[test]
fn release_failure_keeps_the_handle_and_holds_the_request_until_a_retry_releases_it() {
    let mut h = Harness::new(4);
    let key = h.begin_posted(1, Kind::Read, 2, &blocks(&[9]), T);
    h.complete(key, 0, Ok(()));
    let events = &mut h.events;
    h.slots
        .release_failed(hk(key, 1), Ok(()), &mut |e| events.push(e))
        .unwrap();
    assert!(h.reports().is_empty(), "held handle must hold the request");
    assert_eq!(h.slots.snapshot(key).unwrap().held, 0b10);
    // A retry that fails again keeps holding.
    h.slots
        .release_retried(hk(key, 1), false, &mut |_| panic!("event"))
        .unwrap();
    assert!(h.reports().is_empty());
    assert_eq!(h.ledger.stats().failed_release_retries, 1);
    let events = &mut h.events;
    h.slots
        .release_retried(hk(key, 1), true, &mut |e| events.push(e))
        .unwrap();
    assert_eq!(h.reports_of(1), [Outcome::Finished]);
}

#[test]
fn release_failure_after_an_error_still_defers_the_failure_until_released() {
    let mut h = Harness::new(4);
    let key = h.begin_posted(1, Kind::Read, 1, &blocks(&[9]), T);
    let events = &mut h.events;
    h.slots
        .release_failed(hk(key, 0), err(IO_ERROR), &mut |e| events.push(e))
        .unwrap();
    assert!(h.reports().is_empty());
    // Even the deadline cannot report it: the held handle is not stopped.
    h.advance(T);
    assert!(h.reports().is_empty());
    assert!(h.cancels.is_empty(), "a held handle has nothing in flight");
    let events = &mut h.events;
    h.slots
        .release_retried(hk(key, 0), true, &mut |e| events.push(e))
        .unwrap();
    assert!(matches!(h.reports_of(1)[..], [Outcome::Failed(_)]));
}

// -- 5. pull: prefix hit and notify-only ---------------------------------------

#[test]
fn full_prefix_hit_awaited_by_the_engine_is_reported_finished_at_once() {
    let mut h = Harness::new(4);
    let key = h.begin(1, Kind::PrefixHit, 0, &blocks(&[1]), T);
    assert_eq!(h.reports_of(1), [Outcome::Finished]);
    assert_eq!(h.retire(key), []);
}

#[test]
fn notify_only_receive_is_never_reported_and_takes_no_slot() {
    let mut h = Harness::new(4);
    let got = h.try_begin(1, Kind::NotifyOnly, &[], &[], T).unwrap();
    assert_eq!(got, Begun::Untracked);
    h.advance(u64::MAX);
    assert!(h.events.is_empty());
    assert_eq!(h.ledger.stats().in_use, 0);
    assert_eq!(h.ledger.key(RequestId(1)), None);
}

// -- 6. push -------------------------------------------------------------------

#[test]
fn push_is_done_only_after_all_writes_completed_and_every_ack_arrived() {
    let mut h = Harness::new(4);
    let key = h.begin_posted(1, Kind::Write { acks: 2 }, 2, &[], T);
    h.notify(1, 1).unwrap();
    h.complete(key, 0, Ok(()));
    h.complete(key, 1, Ok(()));
    assert!(h.reports().is_empty(), "one ack still missing");
    h.notify(1, 1).unwrap();
    assert_eq!(h.reports_of(1), [Outcome::SendDone]);
}

#[test]
fn push_whose_writes_finish_at_different_times_is_reported_once() {
    let mut h = Harness::new(4);
    let key = h.begin_posted(1, Kind::Write { acks: 1 }, 3, &[], T);
    h.complete(key, 1, Ok(()));
    h.advance(T / 4);
    h.notify(1, 1).unwrap();
    h.advance(T / 2);
    h.complete(key, 2, Ok(()));
    assert!(h.reports().is_empty());
    h.complete(key, 0, Ok(()));
    h.advance(2 * T);
    assert_eq!(h.reports_of(1), [Outcome::SendDone]);
}

#[test]
fn failed_push_is_never_reported_done_and_fails_with_its_reason_once_quiescent() {
    let mut h = Harness::new(4);
    let key = h.begin_posted(1, Kind::Write { acks: 1 }, 2, &[], T);
    h.complete(key, 0, err(IO_ERROR));
    h.notify(1, 1).unwrap();
    assert!(h.reports().is_empty(), "a failed push waits for quiescence");
    h.complete(key, 1, Ok(()));
    assert_eq!(
        h.reports_of(1),
        [Outcome::Failed(Reason::new(Cause::Transfer, IO_ERROR))]
    );
    h.advance(T);
    assert_eq!(
        h.reports_of(1).len(),
        1,
        "no second report at the lease end"
    );
    assert_eq!(h.retire(key), [], "a write invalidates nothing");
}

#[test]
fn completion_after_lease_expiry_gives_no_second_report() {
    let mut h = Harness::new(4);
    let key = h.begin_posted(1, Kind::Write { acks: 1 }, 2, &[], T);
    h.complete(key, 0, Ok(()));
    h.advance(T);
    // Handle 1 still in flight: cancelled, not reported yet.
    assert_eq!(h.cancels, [Cancel { key, handles: 0b10 }]);
    assert!(h.reports().is_empty());
    // Its completion arrives late (it succeeded before the forced close).
    h.complete(key, 1, Ok(()));
    assert_eq!(h.reports_of(1), [Outcome::SendExpired]);
    // The late ack is rejected; a duplicate completion is refused.
    assert_eq!(
        h.notify(1, 1),
        Err(NotifyError::UnknownRequest(RequestId(1)))
    );
    assert!(h
        .slots
        .completed(hk(key, 1), Ok(()), &mut |_| panic!())
        .is_err());
    h.retire(key);
    assert_eq!(
        h.notify(1, 1),
        Err(NotifyError::UnknownRequest(RequestId(1)))
    );
    assert_eq!(h.reports_of(1), [Outcome::SendExpired]);
}

// -- 7. lend ---------------------------------------------------------------------

#[test]
fn several_consumer_ranks_notifying_one_producer_rank_release_the_lend_once() {
    let mut h = Harness::new(4);
    let key = h.begin(1, Kind::Lend { notifications: 3 }, 0, &blocks(&[5, 6]), T);
    h.notify(1, 1).unwrap();
    h.notify(1, 1).unwrap();
    assert!(h.reports().is_empty());
    h.notify(1, 1).unwrap();
    assert_eq!(h.reports_of(1), [Outcome::LendReleased]);
    // A fourth rank (or a retransmission) is rejected, never re-reported.
    assert!(h.notify(1, 1).is_err());
    assert_eq!(h.reports_of(1), [Outcome::LendReleased]);
    assert_eq!(h.retire(key), []);
}

#[test]
fn lend_without_every_notification_expires_with_its_lease() {
    let mut h = Harness::new(4);
    h.begin(1, Kind::Lend { notifications: 2 }, 0, &[], T);
    h.notify(1, 1).unwrap();
    h.advance(T);
    assert_eq!(h.reports_of(1), [Outcome::LendExpired]);
    assert!(h.cancels.is_empty());
}

#[test]
fn heartbeats_extend_only_known_leases_and_never_shorten_them() {
    let mut h = Harness::new(4);
    h.begin(1, Kind::Lend { notifications: 1 }, 0, &[], T);
    assert!(h.ledger.heartbeat(RequestId(1), Nanos(3 * T)));
    assert!(
        h.ledger.heartbeat(RequestId(1), Nanos(2 * T)),
        "known, but must not shorten"
    );
    assert!(
        !h.ledger.heartbeat(RequestId(99), Nanos(5 * T)),
        "unknown ids are ignored"
    );
    assert_eq!(h.ledger.stats().ignored_heartbeats, 1);
    h.advance(3 * T - 1);
    assert!(h.reports().is_empty());
    h.advance(3 * T);
    assert_eq!(h.reports_of(1), [Outcome::LendExpired]);
    // Reported: further heartbeats are ignored.
    assert!(!h.ledger.heartbeat(RequestId(1), Nanos(9 * T)));
}

#[test]
fn heartbeat_does_not_extend_a_read_deadline() {
    let mut h = Harness::new(4);
    h.begin_posted(1, Kind::Read, 1, &[], T);
    assert!(!h.ledger.heartbeat(RequestId(1), Nanos(5 * T)));
    h.advance(T);
    assert_eq!(h.cancels.len(), 1);
}

#[test]
fn notification_for_an_unknown_request_is_counted_as_rejected_and_dropped() {
    let mut h = Harness::new(4);
    let key = h.begin(1, Kind::Lend { notifications: 1 }, 0, &[], T);
    let before = h.slots.snapshot(key);
    assert_eq!(
        h.notify(42, 1),
        Err(NotifyError::UnknownRequest(RequestId(42)))
    );
    assert_eq!(h.notify(1, 0), Err(NotifyError::ZeroCount(RequestId(1))));
    assert_eq!(h.ledger.stats().rejected_notifications, 2);
    assert_eq!(h.slots.snapshot(key), before);
    assert!(h.events.is_empty());
}

#[test]
fn notification_for_a_read_is_rejected() {
    let mut h = Harness::new(4);
    h.begin_posted(1, Kind::Read, 1, &[], T);
    assert_eq!(h.notify(1, 1), Err(NotifyError::NotAwaited(RequestId(1))));
}

// -- 8. deadlines and abort -------------------------------------------------------

#[test]
fn deadline_cancels_handles_in_flight_and_reports_failed_after_the_last_one_stops() {
    let mut h = Harness::new(4);
    let key = h.begin_posted(1, Kind::Read, 3, &blocks(&[8]), T);
    h.complete(key, 0, Ok(()));
    h.advance(T - 1);
    assert!(h.cancels.is_empty());
    h.advance(T);
    assert_eq!(
        h.cancels,
        [Cancel {
            key,
            handles: 0b110
        }]
    );
    assert!(h.reports().is_empty(), "stalled handles still in flight");
    assert_eq!(h.slots.snapshot(key).unwrap().phase, Phase::Cancelling);
    // The forced close completes them with CANCELED.
    h.complete(key, 1, err(CANCELED));
    assert!(h.reports().is_empty());
    h.complete(key, 2, err(CANCELED));
    assert_eq!(
        h.reports_of(1),
        [Outcome::Failed(Reason::of(Cause::Deadline))]
    );
    assert_eq!(h.retire(key), blocks(&[8]));
    // A later advance finds nothing to do.
    h.advance(10 * T);
    assert_eq!(h.cancels.len(), 1);
}

#[test]
fn deadline_stops_handles_not_yet_posted_and_posting_them_is_refused() {
    let mut h = Harness::new(4);
    let key = h.begin(1, Kind::Read, 2, &[], T);
    h.slots.posting(hk(key, 0)).unwrap();
    h.advance(T);
    assert_eq!(h.cancels, [Cancel { key, handles: 0b01 }]);
    assert_eq!(
        h.slots.posting(hk(key, 1)),
        Err(InputError::Cancelled(hk(key, 1)))
    );
    h.complete(key, 0, err(CANCELED));
    assert!(matches!(h.reports_of(1)[..], [Outcome::Failed(r)] if r.cause == Cause::Deadline));
}

#[test]
fn deadline_with_nothing_posted_reports_at_once_without_cancels() {
    let mut h = Harness::new(4);
    h.begin(1, Kind::Read, 2, &blocks(&[1]), T);
    h.advance(T);
    assert!(h.cancels.is_empty());
    assert!(matches!(h.reports_of(1)[..], [Outcome::Failed(_)]));
}

#[test]
fn abort_reports_failed_only_after_the_forced_close_completes_every_handle() {
    let mut h = Harness::new(4);
    let key = h.begin_posted(1, Kind::Read, 2, &blocks(&[2]), T);
    let cancel = h.abort(1).unwrap();
    assert_eq!(cancel, Some(Cancel { key, handles: 0b11 }));
    assert!(h.reports().is_empty());
    assert_eq!(h.abort(1), Ok(None), "already cancelling");
    h.complete(key, 0, err(CANCELED));
    assert!(h.reports().is_empty());
    h.complete(key, 1, Ok(()));
    assert_eq!(
        h.reports_of(1),
        [Outcome::Failed(Reason::of(Cause::Aborted))]
    );
    assert_eq!(h.abort(1), Err(AbortError::UnknownRequest(RequestId(1))));
}

#[test]
fn abort_of_a_lend_reports_failed_at_once() {
    let mut h = Harness::new(4);
    let key = h.begin(1, Kind::Lend { notifications: 1 }, 0, &blocks(&[1]), T);
    assert_eq!(h.abort(1), Ok(None));
    assert_eq!(
        h.reports_of(1),
        [Outcome::Failed(Reason::of(Cause::Aborted))]
    );
    assert_eq!(h.retire(key), [], "only reads invalidate blocks");
}

// -- 9. dead peers ------------------------------------------------------------------

#[test]
fn lost_peer_fails_every_handle_to_it_deferred_until_they_stop() {
    let mut h = Harness::new(4);
    // Request 1: handles to peers 0, 1; request 2: peer 1 unposted, peer 0.
    let a = h.begin_posted(1, Kind::Read, 2, &blocks(&[1]), T);
    let b = h.begin(2, Kind::Read, 2, &blocks(&[2]), T);
    h.slots.posting(hk(b, 0)).unwrap();
    let events = &mut h.events;
    let failed = h.ledger.peer_lost(PeerId(1), &mut |e| events.push(e));
    assert_eq!(failed, 2);
    assert_eq!((h.notices_of(1), h.notices_of(2)), (1, 1));
    assert!(h.reports().is_empty(), "handles to peer 0 still in flight");
    // Request 2's unposted handle to peer 1 is stopped and cannot be posted.
    assert_eq!(
        h.slots.posting(hk(b, 1)),
        Err(InputError::Cancelled(hk(b, 1)))
    );
    // Request 1's handle to peer 1 comes back with the endpoint error.
    h.complete(a, 1, err(ENDPOINT_TIMEOUT));
    h.complete(a, 0, Ok(()));
    h.complete(b, 0, Ok(()));
    assert!(matches!(h.reports_of(1)[..], [Outcome::Failed(r)] if r.cause == Cause::PeerLost));
    assert!(matches!(h.reports_of(2)[..], [Outcome::Failed(r)] if r.cause == Cause::PeerLost));
    assert_eq!(h.notices_of(1), 1, "one notice per failed handle");
}

// -- 10. bad input ----------------------------------------------------------------

#[test]
fn refused_begins_give_typed_errors_and_change_nothing() {
    let mut h = Harness::new(2);
    let key = h.begin_posted(1, Kind::Read, 1, &blocks(&[1]), T);
    let (snap, stats) = (h.slots.snapshot(key), h.ledger.stats());
    let p = peers(65);
    let cases: Vec<(BeginError, Result<Begun, BeginError>)> = vec![
        (
            BeginError::Duplicate(RequestId(1)),
            h.try_begin(1, Kind::Read, &p[..1], &[], T),
        ),
        (
            BeginError::TooManyHandles { given: 65 },
            h.try_begin(2, Kind::Read, &p, &[], T),
        ),
        (
            BeginError::TooManyBlocks { given: 9, max: 8 },
            h.try_begin(2, Kind::Read, &p[..1], &blocks(&[0; 9]), T),
        ),
        (
            BeginError::EmptyPlan(Kind::Read),
            h.try_begin(2, Kind::Read, &[], &[], T),
        ),
        (
            BeginError::EmptyPlan(Kind::Write { acks: 1 }),
            h.try_begin(2, Kind::Write { acks: 1 }, &[], &[], T),
        ),
        (
            BeginError::UnexpectedHandles(Kind::PrefixHit),
            h.try_begin(2, Kind::PrefixHit, &p[..1], &[], T),
        ),
        (
            BeginError::UnexpectedHandles(Kind::Lend { notifications: 1 }),
            h.try_begin(2, Kind::Lend { notifications: 1 }, &p[..1], &[], T),
        ),
        (
            BeginError::NothingToAwait,
            h.try_begin(2, Kind::Lend { notifications: 0 }, &[], &[], T),
        ),
    ];
    for (want, got) in cases {
        assert_eq!(got, Err(want));
    }
    assert_eq!(h.slots.snapshot(key), snap);
    assert_eq!(h.ledger.stats(), stats);
    assert!(h.events.is_empty());
    // Full: a second slot is taken, a third request is refused.
    h.begin(2, Kind::Read, 1, &[], T);
    assert_eq!(
        h.try_begin(3, Kind::Read, &p[..1], &[], T),
        Err(BeginError::Full { capacity: 2 })
    );
}

#[test]
fn duplicate_and_malformed_handle_inputs_give_typed_errors_and_change_nothing() {
    let mut h = Harness::new(4);
    let key = h.begin(1, Kind::Read, 2, &blocks(&[1]), T);
    h.slots.posting(hk(key, 0)).unwrap();
    h.complete(key, 0, Ok(()));
    let snap = h.slots.snapshot(key);
    let wrong_gen = RequestKey::new(key.slot(), key.generation() + 1);
    let nowhere = RequestKey::new(1000, 0);
    let mut no_event = |_: Event| panic!("refused input produced an event");
    let refused = [
        (
            h.slots.posting(hk(key, 0)),
            InputError::AlreadyPosted(hk(key, 0)),
        ),
        (
            h.slots.posting(hk(key, 5)),
            InputError::NoSuchHandle(hk(key, 5)),
        ),
        (
            h.slots.completed(hk(key, 0), err(IO_ERROR), &mut no_event),
            InputError::AlreadyEnded(hk(key, 0)),
        ),
        (
            h.slots.completed(hk(key, 1), Ok(()), &mut no_event),
            InputError::NotPosted(hk(key, 1)),
        ),
        (
            h.slots.release_retried(hk(key, 0), true, &mut no_event),
            InputError::NotHeld(hk(key, 0)),
        ),
        (
            h.slots.release_retried(hk(key, 1), false, &mut no_event),
            InputError::NotHeld(hk(key, 1)),
        ),
        (
            h.slots
                .setup_failed(hk(key, 0), Reason::of(Cause::Setup), &mut no_event),
            InputError::AlreadyEnded(hk(key, 0)),
        ),
        (
            h.slots.completed(hk(wrong_gen, 1), Ok(()), &mut no_event),
            InputError::Stale(wrong_gen),
        ),
        (h.slots.posting(hk(nowhere, 0)), InputError::Stale(nowhere)),
    ];
    let n = refused.len() as u64;
    for (got, want) in refused {
        assert_eq!(got, Err(want));
    }
    assert_eq!(
        h.slots.snapshot(key),
        snap,
        "refused inputs changed the request"
    );
    assert_eq!(h.ledger.stats().rejected_inputs, n);
    assert!(h.events.is_empty());
}

#[test]
fn stale_key_can_never_touch_the_request_that_reuses_its_slot() {
    let mut h = Harness::new(1);
    let old = h.begin_posted(1, Kind::Read, 1, &[], T);
    h.complete(old, 0, Ok(()));
    h.retire(old);
    let new = h.begin_posted(2, Kind::Read, 1, &blocks(&[3]), T);
    assert_eq!(new.slot(), old.slot());
    assert_ne!(new.generation(), old.generation());
    let snap = h.slots.snapshot(new);
    assert_eq!(
        h.slots
            .completed(hk(old, 0), err(IO_ERROR), &mut |_| panic!()),
        Err(InputError::Stale(old))
    );
    assert_eq!(h.slots.posting(hk(old, 0)), Err(InputError::Stale(old)));
    assert_eq!(h.slots.snapshot(old), None);
    assert_eq!(h.slots.snapshot(new), snap);
    h.complete(new, 0, Ok(()));
    assert_eq!(h.reports_of(2), [Outcome::Finished]);
}

#[test]
fn retire_is_refused_before_the_report_and_after_a_retire() {
    let mut h = Harness::new(2);
    let key = h.begin_posted(1, Kind::Read, 1, &blocks(&[1]), T);
    let mut v = Vec::new();
    assert_eq!(h.ledger.retire(key), Err(RetireError::NotReported(key)));
    assert_eq!(
        h.slots.blocks_to_invalidate(key, &mut v),
        Err(RetireError::NotReported(key))
    );
    h.complete(key, 0, err(IO_ERROR));
    h.slots.blocks_to_invalidate(key, &mut v).unwrap();
    assert_eq!(v, blocks(&[1]));
    h.ledger.retire(key).unwrap();
    assert_eq!(h.ledger.retire(key), Err(RetireError::Stale(key)));
    assert_eq!(
        h.slots.blocks_to_invalidate(key, &mut v),
        Err(RetireError::Stale(key))
    );
    assert_eq!(v, blocks(&[1]), "a refused read adds no blocks");
    assert_eq!(h.ledger.stats().rejected_retires, 4);
    assert_eq!(h.ledger.stats().in_use, 0);
}

#[test]
fn freed_slots_are_reused_oldest_first() {
    let mut h = Harness::new(3);
    let a = h.begin(1, Kind::PrefixHit, 0, &[], T);
    let b = h.begin(2, Kind::PrefixHit, 0, &[], T);
    h.retire(b);
    h.retire(a);
    let c = h.begin(3, Kind::PrefixHit, 0, &[], T);
    let d = h.begin(4, Kind::PrefixHit, 0, &[], T);
    let e = h.begin(5, Kind::PrefixHit, 0, &[], T);
    assert_eq!(
        [c.slot(), d.slot(), e.slot()],
        [2, b.slot(), a.slot()],
        "never-used first, then in retirement order"
    );
}

#[test]
fn a_retired_id_can_begin_again() {
    let mut h = Harness::new(2);
    let key = h.begin(1, Kind::PrefixHit, 0, &[], T);
    assert!(
        h.try_begin(1, Kind::PrefixHit, &[], &[], T).is_err(),
        "reported, not yet retired"
    );
    h.retire(key);
    let again = h.begin(1, Kind::PrefixHit, 0, &[], T);
    assert_ne!(again, key);
    assert_eq!(h.reports_of(1).len(), 2);
}
