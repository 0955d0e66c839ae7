//! Engine latencies next to the cache-line round trip measured in the same
//! run (docs/design.md §6). `cargo bench --bench engine`; the one-object summary is
//! `cargo run --release -p kvpoll-cli -- bench engine --json`.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use kvpoll::engine::{Engine, Outcomes};
use kvpoll_cli::bench::engine::{cache_line_round_trip, completion_to_visible};

fn latency(c: &mut Criterion) {
    let mut g = c.benchmark_group("handoff");
    g.measurement_time(Duration::from_secs(3));
    g.bench_function("cache_line_round_trip", |b| {
        b.iter_custom(|iters| {
            let (ns, _) = cache_line_round_trip(iters.max(1), 1);
            Duration::from_nanos((ns * iters as f64) as u64)
        })
    });
    g.bench_function("completion_to_visible", |b| {
        b.iter_custom(|iters| {
            let lat = completion_to_visible(iters.max(1) as usize);
            Duration::from_nanos(lat.iter().sum())
        })
    });
    g.finish();
}

fn poll_idle(c: &mut Criterion) {
    let mut engine = Engine::builder().build().expect("engine");
    let mut out = Outcomes::default();
    c.bench_function("engine_poll_nothing_new", |b| {
        b.iter(|| engine.poll(std::hint::black_box(&mut out)))
    });
    engine.shutdown();
}

criterion_group!(benches, latency, poll_idle);
criterion_main!(benches);
