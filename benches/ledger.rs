//! The lock-free ledger's rates (docs/design.md §6). Its comparison with a
//! locked tracker, the figure its target is set against, is the tool's:
//! `kvpoll bench ledger` runs both on the same schedule and prints the
//! ratio.
//!
//! Requests read from 8 peers (8 handles each) and begin in windows of 256;
//! their handles complete in the order the seeded transport simulator draws
//! (`kvpoll::transport::sim`, seed 1, no faults), interleaved across the
//! window.
//!
//! - `ledger_one_thread`: one thread feeds the ledger, one window at a
//!   time. `submit`: `Ledger::begin_posting` (a slot taken, every handle
//!   claimed for posting), requests a second. `complete`:
//!   `Slots::completed`, handles a second; the last handle of a request
//!   decides its report and publishes it on the event ring.
//!   `complete_and_publish`: the same with one handle a request, so that
//!   every completion publishes. What else a window needs (taking the
//!   reports, retiring the slots) runs between windows, untimed.
//! - `handle_completions`: handle completions a second from a poller
//!   thread to an engine thread. `ledger_and_event_ring`: the ledger, its
//!   reports over the event ring, the engine thread handing each key back
//!   over a command ring to be retired. Target: ≥ 20 M completions/s.
//! - `ledger_handoff`: `report_round_trip`, one request at a time: the
//!   poller thread begins a one-handle read and completes it, the engine
//!   thread takes the report (and the blocks a failure would invalidate)
//!   and hands the key back, the poller retires it. Compare with
//!   `rings_handoff` (`benches/rings.rs`): the same two hops over bare
//!   rings, and a cache line's round trip.
//!
//! `cargo bench --bench ledger`; `cargo test --bench ledger` runs each once.

mod common;

use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use crossbeam_utils::Backoff;
use kvpoll::ledger::{
    BeginError, Begun, Cause, Event, HandleKey, Kind, Ledger, LedgerConfig, Nanos, PeerId, Reason,
    Request, RequestId, RequestKey, Slots, Status,
};
use kvpoll::ring::{self, EventPublisher, EventReceiver};
use kvpoll::transport::sim::{Sim, SimConfig, SimEvent};

use common::spin_until;

/// Requests begun together.
const WINDOW: u32 = 256;
/// Completion orders drawn per shape; window `w` completes in order `w % ORDERS`.
const ORDERS: usize = 8;

/// What a handle the simulator failed completes with (`UCS_ERR_IO_ERROR`).
const FAILED: Reason = Reason {
    cause: Cause::Transfer,
    status: Status::new(-3),
};

/// The ledger's input for a handle that ended `ok` or not.
fn result(ok: bool) -> Result<(), Reason> {
    if ok {
        Ok(())
    } else {
        Err(FAILED)
    }
}

/// A read of `peers.len()` handles, no blocks, never expiring.
fn read(id: u64, peers: &[PeerId]) -> Request<'_> {
    Request {
        id: RequestId(id),
        kind: Kind::Read,
        peers,
        blocks: &[],
        expires: Nanos(u64::MAX),
    }
}

/// A window's completions in order: (request index in the window, handle,
/// succeeded).
type Order = Vec<(u32, u8, bool)>;

/// `ORDERS` completion orders of a window of requests of `handles`
/// handles, drawn once so that drawing costs nothing while measuring.
fn orders(handles: u8) -> Vec<Order> {
    let mut sim = Sim::new(SimConfig {
        seed: 1,
        ..SimConfig::default()
    });
    (0..ORDERS)
        .map(|_| {
            for i in 0..WINDOW {
                for h in 0..handles {
                    // The key only carries (i, h) through the simulator.
                    let hk = HandleKey::new(RequestKey::new(i, 0), h).expect("handle < 64");
                    sim.post(hk, PeerId(u32::from(h))).expect("no faults");
                }
            }
            std::iter::from_fn(|| sim.step())
                .filter_map(|e| match e {
                    SimEvent::Completed { handle, result, .. } => {
                        Some((handle.key().slot(), handle.handle(), result.is_ok()))
                    }
                    _ => None,
                })
                .collect()
        })
        .collect()
}

/// One thread's ledger and event ring, fed a window at a time.
struct Window {
    ledger: Ledger,
    slots: Arc<Slots>,
    tx: EventPublisher<Event>,
    rx: EventReceiver<Event>,
    peers: Vec<PeerId>,
    orders: Vec<Order>,
    keys: Vec<RequestKey>,
    windows: u64,
}

impl Window {
    fn new(handles: u8) -> Self {
        let ledger = Ledger::new(LedgerConfig {
            slots: WINDOW,
            max_blocks: 1,
        })
        .expect("ledger shape");
        // Room for a window's reports: nothing overflows.
        let (tx, rx) = ring::events(WINDOW as usize, WINDOW as usize);
        Window {
            slots: ledger.slots().clone(),
            ledger,
            tx,
            rx,
            peers: (0..u32::from(handles)).map(PeerId).collect(),
            orders: orders(handles),
            keys: Vec::with_capacity(WINDOW as usize),
            windows: 0,
        }
    }

    fn submit(&mut self) {
        self.keys.clear();
        let base = self.windows * u64::from(WINDOW);
        let tx = &mut self.tx;
        let mut publish = |e| {
            let _ = tx.publish(e);
        };
        for i in 0..u64::from(WINDOW) {
            match self
                .ledger
                .begin_posting(&read(base + i, &self.peers), &mut publish)
            {
                Ok(Begun::Tracked(key)) => self.keys.push(key),
                other => panic!("the ledger refused a request: {other:?}"),
            }
        }
    }

    fn complete(&mut self) {
        let order = &self.orders[self.windows as usize % ORDERS];
        let tx = &mut self.tx;
        let mut publish = |e| {
            let _ = tx.publish(e);
        };
        for &(i, h, ok) in order {
            let hk = HandleKey::new(self.keys[i as usize], h).expect("handle < 64");
            self.slots
                .completed(hk, result(ok), &mut publish)
                .expect("a posted handle completes");
        }
    }

    /// Takes the window's reports and retires their slots.
    fn retire(&mut self) {
        let mut reported = 0;
        while let Some(e) = self.rx.recv() {
            if e.outcome.is_terminal() {
                self.ledger.retire(e.key).expect("a reported key retires");
                reported += 1;
            }
        }
        assert_eq!(
            reported, WINDOW,
            "every request of the window reported once"
        );
        self.windows += 1;
    }
}

fn one_thread(c: &mut Criterion) {
    let mut g = c.benchmark_group("ledger_one_thread");
    let mut eight = Window::new(8);
    g.throughput(Throughput::Elements(u64::from(WINDOW)));
    g.bench_function("submit", |b| {
        b.iter_custom(|windows| {
            let mut spent = Duration::ZERO;
            for _ in 0..windows {
                let t = Instant::now();
                eight.submit();
                spent += t.elapsed();
                eight.complete();
                eight.retire();
            }
            spent
        })
    });
    g.throughput(Throughput::Elements(u64::from(WINDOW) * 8));
    g.bench_function("complete", |b| {
        b.iter_custom(|windows| {
            let mut spent = Duration::ZERO;
            for _ in 0..windows {
                eight.submit();
                let t = Instant::now();
                eight.complete();
                spent += t.elapsed();
                eight.retire();
            }
            spent
        })
    });
    let mut one = Window::new(1);
    g.throughput(Throughput::Elements(u64::from(WINDOW)));
    g.bench_function("complete_and_publish", |b| {
        b.iter_custom(|windows| {
            let mut spent = Duration::ZERO;
            for _ in 0..windows {
                one.submit();
                let t = Instant::now();
                one.complete();
                spent += t.elapsed();
                one.retire();
            }
            spent
        })
    });
    g.finish();
}

/// Requests of one two-thread run (32 windows of 256: 65 536 completions).
const REQUESTS: u32 = 1 << 13;
/// Handles a request in the two-thread runs.
const HANDLES: u8 = 8;

fn two_threads(c: &mut Criterion) {
    let orders = orders(HANDLES);
    let mut g = c.benchmark_group("handle_completions");
    g.throughput(Throughput::Elements(
        u64::from(REQUESTS) * u64::from(HANDLES),
    ));
    g.sample_size(20);
    g.measurement_time(Duration::from_secs(3));
    g.bench_function("ledger_and_event_ring", |b| {
        b.iter_custom(|runs| (0..runs).map(|_| run_ledger(&orders)).sum())
    });
    g.finish();
}

/// One run through the ledger and the event ring: the time from the
/// first begin to the engine thread's last report.
fn run_ledger(orders: &[Order]) -> Duration {
    // Room for the engine thread to fall 8 windows behind before the
    // poller must wait for retired slots.
    let mut ledger = Ledger::new(LedgerConfig {
        slots: 8 * WINDOW,
        max_blocks: 1,
    })
    .expect("ledger shape");
    let slots = ledger.slots().clone();
    let (mut tx, mut rx) = ring::events::<Event>(4096, 4096);
    // Room for every slot's key: the engine thread never waits on it.
    let (mut back, mut returned) = ring::commands::<RequestKey>(8 * WINDOW as usize);
    let peers: Vec<PeerId> = (0..u32::from(HANDLES)).map(PeerId).collect();
    let start = Barrier::new(2);
    std::thread::scope(|s| {
        let engine = s.spawn(|| {
            start.wait();
            let mut invalid = Vec::new();
            let idle = Backoff::new();
            let mut reported = 0;
            while reported < REQUESTS {
                match rx.recv() {
                    Some(e) if e.outcome.is_terminal() => {
                        invalid.clear();
                        slots
                            .blocks_to_invalidate(e.key, &mut invalid)
                            .expect("a reported key");
                        back.send(e.key).expect("room for every key");
                        reported += 1;
                        idle.reset();
                    }
                    Some(_) => {}
                    None => idle.snooze(),
                }
            }
            Instant::now()
        });
        start.wait();
        let t = Instant::now();
        let mut publish = |e| {
            // At most 8 windows of reports are outstanding: the event ring
            // holds them.
            let _ = tx.publish(e);
        };
        let mut keys = vec![RequestKey::new(0, 0); WINDOW as usize];
        for w in 0..REQUESTS / WINDOW {
            for (i, key) in keys.iter_mut().enumerate() {
                let req = read(u64::from(w * WINDOW) + i as u64, &peers);
                let full = Backoff::new();
                *key = loop {
                    match ledger.begin_posting(&req, &mut publish) {
                        Ok(Begun::Tracked(k)) => break k,
                        // Retire what the engine thread handed back, or
                        // wait for it.
                        Err(BeginError::Full { .. }) => {
                            let mut any = false;
                            while let Some(k) = returned.recv() {
                                ledger.retire(k).expect("a reported key retires");
                                any = true;
                            }
                            if !any {
                                full.snooze();
                            }
                        }
                        other => panic!("the ledger refused a request: {other:?}"),
                    }
                };
            }
            for &(i, h, ok) in &orders[w as usize % ORDERS] {
                let hk = HandleKey::new(keys[i as usize], h).expect("handle < 64");
                slots
                    .completed(hk, result(ok), &mut publish)
                    .expect("a posted handle completes");
            }
        }
        let full = Backoff::new();
        while tx.flush() > 0 {
            full.snooze();
        }
        engine.join().expect("engine thread") - t
    })
}

fn handoff(c: &mut Criterion) {
    let mut g = c.benchmark_group("ledger_handoff");
    let mut ledger = Ledger::new(LedgerConfig {
        slots: 64,
        max_blocks: 1,
    })
    .expect("ledger shape");
    let slots = ledger.slots().clone();
    let peers = [PeerId(0)];
    let mut next = 0u64;
    g.bench_function("report_round_trip", |b| {
        b.iter_custom(|trips| {
            let (mut tx, mut rx) = ring::events::<Event>(64, 64);
            let (mut back, mut returned) = ring::commands::<RequestKey>(64);
            let start = Barrier::new(2);
            std::thread::scope(|s| {
                s.spawn(|| {
                    start.wait();
                    let mut invalid = Vec::new();
                    for _ in 0..trips {
                        let e = spin_until(|| rx.recv().filter(|e| e.outcome.is_terminal()));
                        invalid.clear();
                        let _ = slots.blocks_to_invalidate(e.key, &mut invalid);
                        let _ = back.send(e.key);
                    }
                });
                start.wait();
                let t = Instant::now();
                for _ in 0..trips {
                    let mut publish = |e| {
                        let _ = tx.publish(e);
                    };
                    let key = match ledger.begin_posting(&read(next, &peers), &mut publish) {
                        Ok(Begun::Tracked(key)) => key,
                        other => panic!("the ledger refused a request: {other:?}"),
                    };
                    next += 1;
                    let hk = HandleKey::new(key, 0).expect("handle 0");
                    slots
                        .completed(hk, Ok(()), &mut publish)
                        .expect("a posted handle completes");
                    let key = spin_until(|| returned.recv());
                    ledger
                        .retire(black_box(key))
                        .expect("a reported key retires");
                }
                t.elapsed()
            })
        })
    });
    g.finish();
}

criterion_group!(benches, one_thread, two_threads, handoff);
criterion_main!(benches);
