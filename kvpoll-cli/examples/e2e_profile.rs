//! One side of the e2e bench, alone, for a profiler: `n` requests of
//! `blocks` blocks through kvpoll (`kvpoll`, confirmation off as in the
//! bench; `kvpoll-confirm`, with read confirmation against the lending
//! peer) or through the raw UCX
//! loop (`raw`), after the session's warm-up. Run it under
//! `valgrind --tool=callgrind` (see docs/latency.md); the peer processes
//! run natively.
//!
//! ```text
//! cargo build --release -p kvpoll-cli --example e2e_profile
//! target/release/examples/e2e_profile kvpoll 20000 1
//! ```
//!
//! Needs the release `kvpoll` binary (`target/release/kvpoll`) for the
//! peer processes; `KVPOLL_E2E_TLS` picks the transports (default
//! `posix,sysv,cma`).

use std::path::PathBuf;

use kvpoll_cli::bench::e2e::{E2eConfig, Session};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mode = args.get(1).map_or("kvpoll", String::as_str);
    let n: u32 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(20_000);
    let blocks: u32 = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(1);
    let exe = std::env::current_exe()
        .ok()
        .and_then(|p| Some(p.parent()?.parent()?.join("kvpoll")))
        .filter(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from("target/release/kvpoll"));
    let cfg = E2eConfig {
        tls: std::env::var("KVPOLL_E2E_TLS").unwrap_or_else(|_| "posix,sysv,cma".into()),
        ..E2eConfig::default()
    };
    let mut s = Session::start(&exe, &cfg).expect("start the e2e session");
    let mut lat = Vec::new();
    let confirmed = mode == "kvpoll-confirm";
    let before = s.kvpoll_poller_stats(confirmed);
    let t = match mode {
        "raw" => s.raw(n, blocks, &mut lat),
        "kvpoll-confirm" => s.kvpoll_confirmed(n, blocks, &mut lat),
        _ => s.kvpoll(n, blocks, &mut lat),
    }
    .expect("run");
    println!(
        "{mode}: {n} x {blocks} blocks in {:.3} s ({:.0}/s)",
        t.as_secs_f64(),
        f64::from(n) / t.as_secs_f64()
    );
    let after = s.kvpoll_poller_stats(confirmed);
    if mode != "raw" {
        let per = |a: u64, b: u64| (a - b) as f64 / f64::from(n);
        println!(
            "poller per request: {:.2} busy and {:.2} idle iterations, {:.0} ns busy, {:.0} ns idle",
            per(after.busy_iterations, before.busy_iterations),
            per(after.idle_iterations, before.idle_iterations),
            per(after.busy_ns, before.busy_ns),
            per(after.idle_ns, before.idle_ns),
        );
        let notes = after.notifications_sent - before.notifications_sent;
        let messages = after.notification_messages - before.notification_messages;
        println!(
            "notifications sent: {notes} in {messages} messages ({:.1} a message)",
            notes as f64 / messages.max(1) as f64
        );
    }
}
