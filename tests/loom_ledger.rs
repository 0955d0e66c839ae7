//! loom: every interleaving of the bitmap-and-publish protocol, with two
//! pollers and the engine thread. Run with `make loom` (`--cfg loom`).
#![cfg(loom)]

use kvpoll::ledger::*;
use loom::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use loom::thread;
use std::sync::Arc;

fn check(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(f);
}

fn ledger() -> Ledger {
    Ledger::new(LedgerConfig {
        slots: 1,
        max_blocks: 1,
    })
    .unwrap()
}

fn begin(ledger: &mut Ledger, kind: Kind, n: usize) -> RequestKey {
    let peers = [PeerId(0), PeerId(1)];
    let req = Request {
        id: RequestId(1),
        kind,
        peers: &peers[..n],
        blocks: &[BlockId(5)],
        expires: Nanos(1_000),
    };
    match ledger.begin(&req, &mut |_| panic!("no event at begin")) {
        Ok(Begun::Tracked(key)) => key,
        other => panic!("{other:?}"),
    }
}

fn hk(key: RequestKey, h: u8) -> HandleKey {
    HandleKey::new(key, h).unwrap()
}

#[test]
fn loom_two_pollers_completing_one_read_publish_once_only_when_quiescent_and_engine_retires_once() {
    check(|| {
        let mut ledger = ledger();
        let key = begin(&mut ledger, Kind::Read, 2);
        let slots = ledger.slots().clone();
        slots.posting(hk(key, 0)).unwrap();
        slots.posting(hk(key, 1)).unwrap();
        let reports = Arc::new(AtomicUsize::new(0));
        let mailbox = Arc::new(AtomicU64::new(0));
        let entered = Arc::new([AtomicBool::new(false), AtomicBool::new(false)]);

        let pollers: Vec<_> = [(0u8, Err(Reason::new(Cause::Transfer, -3))), (1, Ok(()))]
            .into_iter()
            .map(|(h, result)| {
                let (slots, reports, mailbox, entered) = (
                    slots.clone(),
                    reports.clone(),
                    mailbox.clone(),
                    entered.clone(),
                );
                thread::spawn(move || {
                    entered[usize::from(h)].store(true, Ordering::Relaxed);
                    slots
                        .completed(hk(key, h), result, &mut |e| {
                            if e.outcome.is_terminal() {
                                // Quiescent: both handles' completions arrived.
                                assert!(entered[0].load(Ordering::Relaxed));
                                assert!(entered[1].load(Ordering::Relaxed));
                                assert!(matches!(e.outcome, Outcome::Failed(_)));
                                reports.fetch_add(1, Ordering::Relaxed);
                                mailbox.store(e.key.to_u64() + 1, Ordering::Release);
                            }
                        })
                        .unwrap();
                })
            })
            .collect();

        // The engine thread: on the report, read the blocks to invalidate;
        // before it, reading them is refused.
        let engine = {
            let (slots, mailbox) = (slots.clone(), mailbox.clone());
            thread::spawn(move || {
                let mut invalid = Vec::new();
                let seen = mailbox.load(Ordering::Acquire);
                if seen == 0 {
                    let early = slots.blocks_to_invalidate(key, &mut invalid);
                    // Reported by now or not, never a partial read.
                    assert!(early.is_ok() == (invalid == [BlockId(5)]));
                    return;
                }
                let k = RequestKey::from_u64(seen - 1);
                slots.blocks_to_invalidate(k, &mut invalid).unwrap();
                assert_eq!(invalid, [BlockId(5)]);
            })
        };
        for p in pollers {
            p.join().unwrap();
        }
        engine.join().unwrap();
        assert_eq!(reports.load(Ordering::Relaxed), 1, "exactly one report");
        // The owner retires the key handed back; only once.
        ledger.retire(key).unwrap();
        assert_eq!(ledger.retire(key), Err(RetireError::Stale(key)));
    });
}

#[test]
fn loom_last_write_completion_racing_last_ack_sends_done_exactly_once() {
    check(|| {
        let mut ledger = ledger();
        let key = begin(&mut ledger, Kind::Write { acks: 1 }, 1);
        let slots = ledger.slots().clone();
        slots.posting(hk(key, 0)).unwrap();
        let reports = Arc::new(AtomicUsize::new(0));

        let poller = {
            let (slots, reports) = (slots.clone(), reports.clone());
            thread::spawn(move || {
                slots
                    .completed(hk(key, 0), Ok(()), &mut |e| {
                        assert_eq!(e.outcome, Outcome::SendDone);
                        reports.fetch_add(1, Ordering::Relaxed);
                    })
                    .unwrap();
            })
        };
        let owner = {
            let reports = reports.clone();
            thread::spawn(move || {
                ledger
                    .notify(RequestId(1), 1, &mut |e| {
                        assert_eq!(e.outcome, Outcome::SendDone);
                        reports.fetch_add(1, Ordering::Relaxed);
                    })
                    .unwrap();
            })
        };
        poller.join().unwrap();
        owner.join().unwrap();
        assert_eq!(reports.load(Ordering::Relaxed), 1, "exactly one SendDone");
    });
}

#[test]
fn loom_abort_racing_a_completion_and_a_second_poller_posting_reports_once() {
    check(|| {
        let mut ledger = ledger();
        let key = begin(&mut ledger, Kind::Read, 2);
        let slots = ledger.slots().clone();
        slots.posting(hk(key, 0)).unwrap();
        let reports = Arc::new(AtomicUsize::new(0));
        let outcome = Arc::new(AtomicUsize::new(0)); // 1 finished, 2 aborted
        let record = |reports: Arc<AtomicUsize>, outcome: Arc<AtomicUsize>| {
            move |e: Event| {
                if e.outcome.is_terminal() {
                    reports.fetch_add(1, Ordering::Relaxed);
                    let code = match e.outcome {
                        Outcome::Finished => 1,
                        Outcome::Failed(r) if r.cause == Cause::Aborted => 2,
                        other => panic!("unexpected {other:?}"),
                    };
                    outcome.store(code, Ordering::Relaxed);
                }
            }
        };

        // Poller 1: handle 0 completes.
        let p1 = {
            let slots = slots.clone();
            let mut out = record(reports.clone(), outcome.clone());
            thread::spawn(move || slots.completed(hk(key, 0), Ok(()), &mut out).unwrap())
        };
        // Poller 2: posts handle 1 unless cancelled; a forced close may have
        // cancelled it, which it reports like any completion.
        let p2 = {
            let slots = slots.clone();
            let mut out = record(reports.clone(), outcome.clone());
            thread::spawn(move || match slots.posting(hk(key, 1)) {
                Ok(()) => slots.completed(hk(key, 1), Ok(()), &mut out).unwrap(),
                Err(InputError::Cancelled(_)) => {}
                Err(e) => panic!("{e}"),
            })
        };
        // The owner aborts.
        let owner = {
            let mut out = record(reports.clone(), outcome.clone());
            thread::spawn(move || ledger.abort(RequestId(1), &mut out).is_ok())
        };
        p1.join().unwrap();
        p2.join().unwrap();
        let aborted = owner.join().unwrap();
        assert_eq!(reports.load(Ordering::Relaxed), 1, "exactly one report");
        let want = if aborted { 2 } else { 1 };
        assert_eq!(outcome.load(Ordering::Relaxed), want);
    });
}
