//! The poller's time accounting and wake-ups over real UCX: an idle
//! adaptive poller blocks (and counts the time idle), a submit wakes it,
//! and the work it does is counted busy.

use std::time::{Duration, Instant};

use kvpoll::engine::{Engine, IdlePolicy, Outcomes};
use kvpoll::ledger::RequestId;

const GUARD: Duration = Duration::from_secs(10);

#[test]
fn an_idle_poller_counts_idle_time_and_a_submit_after_it_blocked_is_reported_and_counted_busy() {
    let mut e = Engine::builder()
        .idle(IdlePolicy::Adaptive)
        .build()
        .unwrap();
    // Long enough for the poller to pass its spin phase and block.
    std::thread::sleep(Duration::from_millis(50));
    let before = e.poller_stats();
    assert!(before.idle_ns > 0, "{before:?}");
    let mut out = Outcomes::default();
    let t = Instant::now();
    e.read(RequestId(1), &[]).unwrap();
    while out.finished_recving.is_empty() {
        assert!(t.elapsed() < GUARD, "a submit to a blocked poller was lost");
        e.poll(&mut out);
        std::thread::yield_now();
    }
    assert_eq!(out.finished_recving, vec![RequestId(1)]);
    // The counters are published before the poller blocks again.
    let t = Instant::now();
    loop {
        let s = e.poller_stats();
        if s.busy_iterations > before.busy_iterations {
            assert!(s.busy_ns > before.busy_ns, "{s:?}");
            assert!(s.idle_ns >= before.idle_ns, "{s:?}");
            break;
        }
        assert!(t.elapsed() < GUARD, "busy work never counted: {s:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
    e.shutdown();
}
