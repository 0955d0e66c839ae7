//! Zero heap allocations per request in steady state (docs/design.md §6), counted by
//! a global allocator that counts only on the measuring thread (a
//! thread-local flag), so other threads' allocations are not noise.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use kvpoll::engine::{Engine, Outcomes};
use kvpoll::ledger::{
    Begun, BlockId, Event, HandleKey, Kind, Ledger, LedgerConfig, Nanos, PeerId, Request,
    RequestId, RequestKey,
};

struct Counting;

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    // Per thread too: tests run in parallel, each counts only its own.
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

fn note() {
    // try_with: the thread-locals may be gone while a thread is torn down.
    if COUNTING.try_with(Cell::get).unwrap_or(false) {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
    }
}

// SAFETY: forwards every call to the system allocator unchanged; counting
// touches only const-initialised thread-locals (which never allocate).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: same contract as ours.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note();
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations made by `f` on this thread.
fn allocations_in(f: impl FnOnce()) -> u64 {
    let before = ALLOCATIONS.with(Cell::get);
    COUNTING.with(|c| c.set(true));
    f();
    COUNTING.with(|c| c.set(false));
    ALLOCATIONS.with(Cell::get) - before
}

/// One request through the whole ledger path on one thread: begin, post and
/// complete its handles, receive its event, read its blocks, retire it.
fn one_request(
    ledger: &mut Ledger,
    tx: &mut kvpoll::ring::EventPublisher<Event>,
    rx: &mut kvpoll::ring::EventReceiver<Event>,
    invalid: &mut Vec<BlockId>,
    id: u64,
) {
    let peers = [PeerId(0), PeerId(1)];
    let blocks = [BlockId(1), BlockId(2)];
    let req = Request {
        id: RequestId(id),
        kind: Kind::Read,
        peers: &peers,
        blocks: &blocks,
        expires: Nanos(u64::MAX),
    };
    let mut publish = |e| {
        let _ = tx.publish(e);
    };
    let key: RequestKey = match ledger.begin(&req, &mut publish) {
        Ok(Begun::Tracked(k)) => k,
        other => panic!("begin: {other:?}"),
    };
    let slots = ledger.slots().clone();
    for h in 0..2 {
        let hk = HandleKey::new(key, h).expect("handle key");
        slots.posting(hk).expect("posting");
        let result = if id % 3 == 0 && h == 1 {
            Err(kvpoll::ledger::Reason {
                cause: kvpoll::ledger::Cause::Transfer,
                status: kvpoll::Status::new(-3),
            })
        } else {
            Ok(())
        };
        slots
            .completed(hk, result, &mut publish)
            .expect("completed");
    }
    let mut seen = false;
    while let Some(ev) = rx.recv() {
        if ev.outcome.is_terminal() {
            invalid.clear();
            slots.blocks_to_invalidate(ev.key, invalid).expect("blocks");
            ledger.retire(ev.key).expect("retire");
            seen = true;
        }
    }
    assert!(seen, "request {id} was never reported");
}

#[test]
fn ledger_begin_complete_event_retire_allocates_nothing_in_steady_state() {
    let mut ledger = Ledger::new(LedgerConfig {
        slots: 64,
        max_blocks: 4,
    })
    .expect("ledger");
    let (mut tx, mut rx) = kvpoll::ring::events::<Event>(256, 256);
    let mut invalid = Vec::with_capacity(4);
    // Warm up: every slot used once, every lazily grown buffer grown.
    for id in 0..1000 {
        one_request(&mut ledger, &mut tx, &mut rx, &mut invalid, id);
    }
    let n = allocations_in(|| {
        for id in 1000..11_000 {
            one_request(&mut ledger, &mut tx, &mut rx, &mut invalid, id);
        }
    });
    assert_eq!(n, 0, "{n} allocations over 10 000 requests");
}

#[test]
fn engine_poll_with_nothing_new_allocates_nothing() {
    let mut engine = Engine::builder().build().expect("engine");
    let mut out = Outcomes::default();
    for _ in 0..1000 {
        engine.poll(&mut out);
    }
    let n = allocations_in(|| {
        for _ in 0..100_000 {
            engine.poll(&mut out);
        }
    });
    engine.shutdown();
    assert_eq!(n, 0, "{n} allocations over 100 000 idle polls");
}

#[test]
fn the_counter_sees_an_allocation_on_this_thread() {
    let n = allocations_in(|| {
        std::hint::black_box(vec![1u8; 64]);
    });
    assert!(n >= 1);
}

/// The engine thread's side of a request (submit, poll until reported),
/// with a prefix-hit read (no handles) so that no UCX is involved. The
/// poller thread is not counted here; its ledger path is the test above.
#[test]
fn engine_thread_submit_and_report_allocates_nothing_in_steady_state() {
    let mut engine = Engine::builder().build().expect("engine");
    let mut out = Outcomes::default();
    let request = |engine: &mut Engine, out: &mut Outcomes, id: u64| {
        engine.read(RequestId(id), &[]).expect("read");
        out.clear();
        while out.finished_recving.is_empty() {
            engine.poll(out);
            std::hint::spin_loop();
        }
    };
    for id in 0..1000 {
        request(&mut engine, &mut out, id);
    }
    let n = allocations_in(|| {
        for id in 1000..11_000 {
            request(&mut engine, &mut out, id);
        }
    });
    engine.shutdown();
    assert_eq!(n, 0, "{n} allocations over 10 000 requests");
}
