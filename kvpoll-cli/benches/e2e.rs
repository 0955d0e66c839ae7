//! End to end over real UCX between two processes: kvpoll's engine reading
//! from a `kvpoll engine-peer` against a raw UCX loop reading from a `kvpoll
//! ucx-peer`, same operations, same run (docs/design.md §6: overhead ≤ 10 %).
//!
//! Needs the release binary for the peer processes: `cargo build --release -p kvpoll-cli`
//! first (it is looked up as `target/release/kvpoll`, next to this bench's
//! own `target/release/deps/` directory). `KVPOLL_E2E_TLS` picks the
//! transports (default `posix,sysv,cma`). The one-object summary is
//! `cargo run --release -p kvpoll-cli -- bench e2e --json`.

use std::path::PathBuf;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvpoll_cli::bench::e2e::{E2eConfig, Session};

fn kvpoll_exe() -> PathBuf {
    let exe = std::env::current_exe()
        .ok()
        .and_then(|p| Some(p.parent()?.parent()?.join("kvpoll")));
    match exe {
        Some(p) if p.is_file() => p,
        other => panic!(
            "benches/e2e needs the kvpoll binary at {other:?} for its peer processes: run `cargo build --release -p kvpoll-cli` first"
        ),
    }
}

fn e2e(c: &mut Criterion) {
    let cfg = E2eConfig {
        tls: std::env::var("KVPOLL_E2E_TLS").unwrap_or_else(|_| "posix,sysv,cma".into()),
        ..E2eConfig::default()
    };
    let mut s = Session::start(&kvpoll_exe(), &cfg).expect("start the e2e session");
    let mut lat = Vec::new();
    let mut g = c.benchmark_group(format!("e2e_{}", cfg.tls.replace(',', "_")));
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(5));
    g.throughput(Throughput::Elements(u64::from(cfg.reads)));
    g.bench_function("kvpoll_single_block_reads", |b| {
        b.iter_custom(|iters| {
            (0..iters)
                .map(|_| s.kvpoll(cfg.reads, 1, &mut lat).expect("kvpoll run"))
                .sum()
        })
    });
    g.bench_function("raw_ucx_single_block_reads", |b| {
        b.iter_custom(|iters| {
            (0..iters)
                .map(|_| s.raw(cfg.reads, 1, &mut lat).expect("raw run"))
                .sum()
        })
    });
    let (n, blocks) = (cfg.requests, cfg.request_blocks);
    g.throughput(Throughput::Elements(u64::from(n)));
    g.bench_function("kvpoll_64_block_requests", |b| {
        b.iter_custom(|iters| {
            (0..iters)
                .map(|_| s.kvpoll(n, blocks, &mut lat).expect("kvpoll run"))
                .sum()
        })
    });
    g.bench_function("raw_ucx_64_block_requests", |b| {
        b.iter_custom(|iters| {
            (0..iters)
                .map(|_| s.raw(n, blocks, &mut lat).expect("raw run"))
                .sum()
        })
    });
    g.finish();
}

criterion_group!(benches, e2e);
criterion_main!(benches);
