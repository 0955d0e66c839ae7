//! Handle completions per second through ledger + event ring (one poller
//! thread, one engine thread), against a `Mutex<HashMap<request, Vec<handle>>>`
//! tracker doing the same bookkeeping, in the same run.
//!
//! Targets (docs/design.md §6): ≥ 20 M completions/s, ≥ 10× the locked tracker.
//! `cargo run --release -p kvpoll-cli -- bench ledger --json` prints the same comparison as
//! one JSON object.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvpoll_cli::bench::ledger::{run_ledger, run_locked, BenchConfig, Schedule};

fn completions(c: &mut Criterion) {
    let config = BenchConfig {
        requests: 1 << 13,
        ..BenchConfig::default()
    };
    let schedule = Schedule::new(config).expect("valid bench shape");
    let mut group = c.benchmark_group("handle_completions");
    group.throughput(Throughput::Elements(schedule.completions()));
    group.sample_size(20);
    group.measurement_time(Duration::from_secs(3));
    group.bench_function("ledger_and_event_ring", |b| {
        b.iter_custom(|iters| {
            (0..iters)
                .map(|_| run_ledger(&schedule).expect("ledger run"))
                .sum()
        })
    });
    group.bench_function("mutex_hashmap_tracker", |b| {
        b.iter_custom(|iters| {
            (0..iters)
                .map(|_| run_locked(&schedule).expect("locked run"))
                .sum()
        })
    });
    group.finish();
}

criterion_group!(benches, completions);
criterion_main!(benches);
