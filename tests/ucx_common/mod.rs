//! Shared helpers for the real-UCX integration tests.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use kvpoll::transport::ucx::{Completion, Context, ContextOptions, Worker};

#[path = "../common/pattern.rs"]
pub mod pattern;

/// `blocks` blocks of `block_size` bytes filled with the tests' block pattern.
pub fn pattern_bytes(seed: u64, blocks: u64, block_size: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity((blocks * block_size) as usize);
    let mut block = vec![0u8; block_size as usize];
    for b in 0..blocks {
        pattern::fill(seed, b, &mut block);
        v.extend_from_slice(&block);
    }
    v
}

/// A context and worker restricted to `tls`.
pub fn worker(tls: &str) -> (Context, Worker) {
    let ctx = Context::new(&ContextOptions::with_transports(tls)).expect("UCX context");
    let w = Worker::new(&ctx).expect("UCX worker");
    (ctx, w)
}

/// Progresses `workers` until `want` completions were collected from the
/// first one. Panics after `limit` so that a hang fails the test instead of
/// stalling CI (a guard, not a speed assertion).
pub fn wait_completions(workers: &[&Worker], want: usize, limit: Duration) -> Vec<Completion> {
    let start = Instant::now();
    let mut out = Vec::new();
    while out.len() < want {
        for w in workers {
            w.progress();
        }
        workers[0].take_completions(&mut out);
        assert!(
            start.elapsed() < limit,
            "only {} of {want} completions after {limit:?}: UCX hung",
            out.len()
        );
    }
    out
}
