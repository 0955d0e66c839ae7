//! An engine's round trips in one process, as its caller sees them.
//!
//! Every poller here is adaptive (it spins briefly, then blocks until work
//! comes) and the caller blocks in `Engine::wait`, so that no thread spins
//! for long: the figures include the caller's wake-up, and the bench runs
//! on a 2-core machine without starving anything.
//!
//! - `engine/poll_nothing_new`: `Engine::poll` with nothing in flight.
//! - `engine/prefix_hit`: a read with nothing to move (`Engine::read` with
//!   no transfers): the submit, the poller, the report seen by the caller.
//! - `engine/read_one_block_shm`: two engines over UCX shared memory
//!   (`posix,sysv,cma`); the decode reads one 4 KiB block the prefill lent,
//!   from submit to the read's report seen by the caller. Between reads,
//!   untimed, the prefill waits for the reader's notification that frees
//!   the block.
//!
//! `cargo bench --bench engine`; `cargo test --bench engine` runs each
//! once. The end-to-end figures across processes, against a raw UCX loop,
//! are the tool's (`kvpoll bench e2e`, `kvpoll-cli/benches/e2e.rs`).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use kvpoll::{BlockId, ContextOptions, Engine, IdlePolicy, Outcomes, PeerId, RequestId, Transfer};

const BLOCK: u64 = 4096;
/// Longest a report may take before the bench gives up: far past any
/// figure, so only a lost report reaches it.
const GUARD: Duration = Duration::from_secs(10);

fn engine(ucx: ContextOptions) -> Engine {
    Engine::builder()
        .idle(IdlePolicy::Adaptive)
        .block_size(BLOCK)
        .ucx(ucx)
        .build()
        .expect("an engine (UCX installed?)")
}

/// Waits in `Engine::wait` until `done` says `out` holds what it waits for.
fn wait_until(e: &mut Engine, out: &mut Outcomes, what: &str, done: impl Fn(&Outcomes) -> bool) {
    let t = Instant::now();
    while !done(out) {
        e.wait(out, Duration::from_millis(10));
        assert!(t.elapsed() < GUARD, "no report in {GUARD:?}: {what}");
    }
}

fn poll_nothing_new(c: &mut Criterion) {
    let mut e = engine(ContextOptions::default());
    let mut out = Outcomes::default();
    c.bench_function("engine/poll_nothing_new", |b| {
        b.iter(|| e.poll(black_box(&mut out)))
    });
    e.shutdown();
}

fn prefix_hit(c: &mut Criterion) {
    let mut e = engine(ContextOptions::default());
    let mut out = Outcomes::default();
    let mut next = 0u64;
    c.bench_function("engine/prefix_hit", |b| {
        b.iter(|| {
            let id = RequestId(next);
            next += 1;
            out.clear();
            e.read(id, &[]).expect("a read with nothing to move");
            wait_until(&mut e, &mut out, "a prefix hit", |o| {
                o.finished_recving.contains(&id)
            });
        })
    });
    e.shutdown();
}

/// The lending and the reading engine, connected over `ucx`.
struct Pair {
    prefill: Engine,
    decode: Engine,
    peer: PeerId,
    out: Outcomes,
    next: u64,
}

impl Pair {
    fn new(ucx: ContextOptions) -> Self {
        let mut prefill = engine(ucx.clone());
        let mut decode = engine(ucx);
        prefill.register(1).expect("a region");
        decode.register(1).expect("a region");
        prefill
            .write_block(0, BlockId(0), &[7; BLOCK as usize])
            .expect("block 0");
        let meta = prefill.local_metadata().expect("metadata");
        let peer = decode.add_peer(&meta).expect("the prefill as a peer");
        Pair {
            prefill,
            decode,
            peer,
            out: Outcomes::default(),
            next: 0,
        }
    }

    /// One read of block 0; the time from its submit to its report.
    fn read(&mut self) -> Duration {
        let id = RequestId(self.next);
        self.next += 1;
        let lend = self
            .prefill
            .lend(id, &[BlockId(0)], 1, GUARD)
            .expect("a lend");
        self.out.clear();
        let t = Instant::now();
        self.decode
            .read(
                id,
                &[Transfer {
                    peer: self.peer,
                    local: &[BlockId(0)],
                    remote: &[BlockId(0)],
                    lend,
                }],
            )
            .expect("a read");
        wait_until(&mut self.decode, &mut self.out, "a read", |o| {
            o.finished_recving.contains(&id) || !o.failed_recving.is_empty()
        });
        let spent = t.elapsed();
        assert!(
            self.out.failed_recving.is_empty(),
            "the read failed: {:?}",
            self.out.failed_recving
        );
        self.out.clear();
        wait_until(
            &mut self.prefill,
            &mut self.out,
            "the lend's release",
            |o| o.finished_sending.contains(&id),
        );
        spent
    }

    fn shutdown(mut self) {
        self.decode.shutdown();
        self.prefill.shutdown();
    }
}

fn read_one_block(c: &mut Criterion) {
    let mut pair = Pair::new(ContextOptions::with_transports("posix,sysv,cma"));
    // The first read wires the endpoint up: not measured.
    pair.read();
    c.bench_function("engine/read_one_block_shm", |b| {
        b.iter_custom(|reads| (0..reads).map(|_| pair.read()).sum())
    });
    pair.shutdown();
}

criterion_group!(benches, poll_nothing_new, prefix_hit, read_one_block);
criterion_main!(benches);
