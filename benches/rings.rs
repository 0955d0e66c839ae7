//! The SPSC rings between the engine thread and its poller (`kvpoll::ring`:
//! commands engine → poller, events poller → engine).
//!
//! - `rings_one_thread`: one thread fills a ring with 256 items and drains
//!   it; items a second.
//! - `rings_two_threads`: one thread pushes, another pops, as the engine
//!   and its poller do; items a second. A side that finds the ring full or
//!   empty waits with `crossbeam_utils::Backoff` (spin, then yield).
//! - `rings_handoff`: one item there and back between two threads, the
//!   time of a round trip: a command over a command ring answered by an
//!   event over an event ring, next to the floor of any cross-core
//!   hand-off, one cache line bounced between the same two threads. The
//!   threads are not pinned: the OS places them.
//!
//! `cargo bench --bench rings`; `cargo test --bench rings` runs each once.

mod common;

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use crossbeam_utils::{Backoff, CachePadded};
use kvpoll::ring;

use common::spin_until;

/// Items a one-thread fill-and-drain moves (the rings hold exactly this many).
const BATCH: usize = 256;

fn one_thread(c: &mut Criterion) {
    let mut g = c.benchmark_group("rings_one_thread");
    g.throughput(Throughput::Elements(BATCH as u64));
    let (mut tx, mut rx) = ring::commands::<u64>(BATCH);
    g.bench_function("commands", |b| {
        b.iter(|| {
            for i in 0..BATCH as u64 {
                let _ = tx.send(black_box(i));
            }
            while let Some(i) = rx.recv() {
                black_box(i);
            }
        })
    });
    let (mut tx, mut rx) = ring::events::<u64>(BATCH, BATCH);
    g.bench_function("events", |b| {
        b.iter(|| {
            for i in 0..BATCH as u64 {
                let _ = tx.publish(black_box(i));
            }
            while let Some(i) = rx.recv() {
                black_box(i);
            }
        })
    });
    g.finish();
}

/// Ring capacity of the two-thread runs: the engine's default event ring.
const CAPACITY: usize = 4096;

fn two_threads(c: &mut Criterion) {
    let mut g = c.benchmark_group("rings_two_threads");
    g.throughput(Throughput::Elements(1));
    g.bench_function("commands", |b| {
        b.iter_custom(|items| {
            let (mut tx, mut rx) = ring::commands::<u64>(CAPACITY);
            streamed(
                items,
                move |i| {
                    let full = Backoff::new();
                    while tx.send(i).is_err() {
                        full.snooze();
                    }
                },
                move || rx.recv(),
            )
        })
    });
    g.bench_function("events", |b| {
        b.iter_custom(|items| {
            let (mut tx, mut rx) = ring::events::<u64>(CAPACITY, CAPACITY);
            streamed(
                items,
                move |i| {
                    // A publish never drops: a full ring keeps the event in
                    // the overflow, which the poller flushes as it loops.
                    let _ = tx.publish(i);
                    let full = Backoff::new();
                    while tx.flush() > 0 {
                        full.snooze();
                    }
                },
                move || rx.recv(),
            )
        })
    });
    g.finish();
}

/// `items` values sent by `push` on this thread and taken by `pop` on
/// another; the time from both threads running to the last value taken.
fn streamed(
    items: u64,
    mut push: impl FnMut(u64) + Send,
    mut pop: impl FnMut() -> Option<u64> + Send,
) -> Duration {
    let start = Barrier::new(2);
    std::thread::scope(|s| {
        let taker = s.spawn(|| {
            start.wait();
            let empty = Backoff::new();
            let mut taken = 0;
            while taken < items {
                match pop() {
                    Some(v) => {
                        black_box(v);
                        taken += 1;
                        empty.reset();
                    }
                    None => empty.snooze(),
                }
            }
            Instant::now()
        });
        start.wait();
        let t = Instant::now();
        for i in 0..items {
            push(i);
        }
        taker.join().expect("taker thread") - t
    })
}

fn handoff(c: &mut Criterion) {
    let mut g = c.benchmark_group("rings_handoff");
    g.bench_function("cache_line_round_trip", |b| {
        b.iter_custom(|trips| {
            let line = CachePadded::new(AtomicU64::new(0));
            round_trips(
                trips,
                // Odd values go there, even ones come back.
                |v| {
                    line.store(2 * v + 1, Ordering::Release);
                    spin_until(|| (line.load(Ordering::Acquire) == 2 * v + 2).then_some(()));
                },
                |v| {
                    spin_until(|| (line.load(Ordering::Acquire) == 2 * v + 1).then_some(()));
                    line.store(2 * v + 2, Ordering::Release);
                },
            )
        })
    });
    g.bench_function("command_then_event_round_trip", |b| {
        b.iter_custom(|trips| {
            let (mut cmd_tx, mut cmd_rx) = ring::commands::<u64>(64);
            let (mut ev_tx, mut ev_rx) = ring::events::<u64>(64, 64);
            round_trips(
                trips,
                |v| {
                    let _ = cmd_tx.send(v);
                    let back = spin_until(|| ev_rx.recv());
                    debug_assert_eq!(back, v);
                },
                |_| {
                    let v = spin_until(|| cmd_rx.recv());
                    let _ = ev_tx.publish(v);
                },
            )
        })
    });
    g.finish();
}

/// `trips` round trips: `there(v)` on this thread sends `v` and waits for
/// the answer that `back(v)`, on another thread, gives. The time of them
/// all, from both threads running.
fn round_trips(
    trips: u64,
    mut there: impl FnMut(u64),
    mut back: impl FnMut(u64) + Send,
) -> Duration {
    let start = Barrier::new(2);
    std::thread::scope(|s| {
        s.spawn(|| {
            start.wait();
            for v in 0..trips {
                back(v);
            }
        });
        start.wait();
        let t = Instant::now();
        for v in 0..trips {
            there(v);
        }
        t.elapsed()
    })
}

criterion_group!(benches, one_thread, two_threads, handoff);
criterion_main!(benches);
