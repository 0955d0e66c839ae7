//! Shared helpers for the tool's real-UCX integration tests.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use kvpoll::transport::ucx::{Completion, Context, ContextOptions, Worker};

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
