//! What each ledger call on a completion's path costs, on one thread with
//! warm caches: ns a call, the clock's own cost taken off (it is printed
//! too). Used to split the completion → visible figure
//! (`docs/latency.md`, "Completion → visible").
//!
//! `cargo run --release -p kvpoll-cli --example ledger_calls -- 2000000`

use std::time::Instant;

use kvpoll::ledger::{Begun, HandleKey, Ledger, LedgerConfig};
use kvpoll::PeerId;
use kvpoll_cli::bench::engine::bare_read;

fn main() {
    let n: u64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2_000_000);
    let mut ledger = match Ledger::new(LedgerConfig {
        slots: 64,
        max_blocks: 4,
    }) {
        Ok(l) => l,
        Err(e) => return eprintln!("ledger: {e}"),
    };
    let slots = ledger.slots().clone();
    let (mut tx, mut rx) = kvpoll::ring::events::<kvpoll::ledger::Event>(1024, 1024);
    let peers = [PeerId(0)];
    let mut invalid = Vec::new();
    // begin, posting, completed (with the ring push), recv + blocks to
    // invalidate (the engine's side), retire.
    let mut total = [0u128; 5];
    // A warm-up pass, then the measured one.
    for pass in 0..2 {
        for i in 0..n {
            let req = bare_read(i, &peers);
            let mut publish = |e| {
                let _ = tx.publish(e);
            };
            let t0 = Instant::now();
            let hk = match ledger.begin(&req, &mut publish) {
                Ok(Begun::Tracked(k)) => HandleKey::new(k, 0),
                _ => None,
            };
            let Some(hk) = hk else {
                return eprintln!("begin did not track request {i}");
            };
            let t1 = Instant::now();
            let _ = slots.posting(hk);
            let t2 = Instant::now();
            let _ = slots.completed(hk, Ok(()), &mut publish);
            let t3 = Instant::now();
            let Some(ev) = rx.recv() else {
                return eprintln!("request {i} was not reported");
            };
            let _ = slots.blocks_to_invalidate(ev.key, &mut invalid);
            let t4 = Instant::now();
            let _ = ledger.retire(ev.key);
            let t5 = Instant::now();
            if pass == 1 {
                for (k, (a, b)) in [(t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5)]
                    .into_iter()
                    .enumerate()
                {
                    total[k] += (b - a).as_nanos();
                }
            }
        }
    }
    let t = Instant::now();
    for _ in 0..n {
        std::hint::black_box(Instant::now());
    }
    let clock = t.elapsed().as_nanos() as f64 / n as f64;
    let each = |k: usize| total[k] as f64 / n as f64 - clock;
    println!(
        "ns a call (clock's {clock:.1} ns taken off): begin {:.1}, posting {:.1}, completed + ring push {:.1}, recv + blocks to invalidate {:.1}, retire {:.1}",
        each(0),
        each(1),
        each(2),
        each(3),
        each(4)
    );
}
