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

#[cfg(feature = "fault-injection")]
/// A peer that stops draining its messages (its poller hung, its process
/// stopped) leaves this poller's sends to it queued inside UCX, and UCX
/// then refuses to arm the worker's event fd (`UCS_ERR_BUSY`: progress is
/// needed to push them out) while progress moves nothing. The poller must
/// not take that as work to spin on: it waits (a submit still wakes it at
/// once) and tries the queued sends again now and then.
///
/// Here a reader over shared memory reads from a lender whose poller is
/// stalled, one read at a time, through UCX's gets (mapped reads off: a
/// mapped read is the poller's own copy, which UCX queues behind nothing).
/// The gets are copies out of the lender's mapped memory and finish, but
/// each read's word to the lender is its own message: they fill the
/// lender's receive queue, the next ones wait in UCX, and a get posted
/// behind them waits too. While it waits, with
/// nothing else to do, the reader's poller may go round a few thousand
/// times in 300 ms (each a wait), not hundreds of thousands; the read is
/// reported once the lender drains again.
#[test]
fn a_poller_whose_sends_wait_on_a_peer_that_does_not_drain_waits_instead_of_spinning() {
    use kvpoll::engine::Transfer;
    use kvpoll::ledger::BlockId;
    use kvpoll::transport::ucx::ContextOptions;

    let shm = || {
        Engine::builder()
            .idle(IdlePolicy::Adaptive)
            .ucx(ContextOptions::with_transports("posix,sysv,cma").mapped_reads(false))
            .confirm_reads(false)
            .block_size(4096)
            .build()
            .unwrap()
    };
    let mut p = shm();
    p.register(4).unwrap();
    let mut d = shm();
    d.register(4).unwrap();
    let peer = d.add_peer(&p.local_metadata().unwrap()).unwrap();
    let mut out = Outcomes::default();
    let (local, remote) = ([BlockId(0)], [BlockId(1)]);
    // Submits read `id`; whether it was reported within `within`.
    let read = |d: &mut Engine, out: &mut Outcomes, id: u64, within: Duration| {
        out.clear();
        let transfer = Transfer {
            peer,
            local: &local,
            remote: &remote,
            // No lend guards these blocks, but naming one makes each read
            // tell the lender when it is done: those messages are what
            // fills the stalled lender's queue.
            lend: kvpoll::Incarnation(7),
        };
        d.read(RequestId(id), &[transfer]).unwrap();
        let t = Instant::now();
        while out.finished_recving.is_empty() && t.elapsed() < within {
            assert!(out.failed_recving.is_empty(), "{out:?}");
            d.poll(out);
            std::thread::yield_now();
        }
        !out.finished_recving.is_empty()
    };
    // Wired up first, then the lender's poller stalls.
    assert!(read(&mut d, &mut out, 0, GUARD), "the first read");
    let stall = Duration::from_secs(3);
    p.stall(stall).unwrap();
    let stalled_at = Instant::now();
    std::thread::sleep(Duration::from_millis(20));
    let mut waiting = None;
    for id in 1..=2000 {
        if !read(&mut d, &mut out, id, Duration::from_millis(200)) {
            waiting = Some(id);
            break;
        }
    }
    let Some(waiting) = waiting else {
        panic!("2000 reads went through: the stalled lender's queue never filled");
    };
    let counted = |d: &Engine| {
        let s = d.poller_stats();
        s.idle_iterations + s.busy_iterations
    };
    let before = counted(&d);
    std::thread::sleep(Duration::from_millis(300));
    let went_round = counted(&d) - before;
    eprintln!("reader's poller: {went_round} iterations in 300 ms behind read {waiting}");
    assert!(
        stalled_at.elapsed() < stall,
        "the test was too slow to watch the stall; make it longer"
    );
    assert!(
        went_round < 20_000,
        "the reader's poller went round {went_round} times in 300 ms with \
         nothing to do but sends its stalled peer cannot take"
    );
    // Once the lender drains again, the queued sends go out and the
    // waiting read is reported.
    let t = Instant::now();
    while !out.finished_recving.contains(&RequestId(waiting)) {
        assert!(out.failed_recving.is_empty(), "{out:?}");
        assert!(
            t.elapsed() < stall + GUARD,
            "read {waiting} was never reported"
        );
        d.poll(&mut out);
        std::thread::sleep(Duration::from_millis(1));
    }
    d.shutdown();
    p.shutdown();
}
