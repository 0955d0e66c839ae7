//! Wake-up figures alone, several rounds, for experiments: p50 of a
//! park/unpark, of a submit wake-up and of a remote wake-up (µs).
//!
//! `cargo run --release -p kvpoll-cli --example wake_probe -- 3 posix,sysv,cma`
//!
//! `DIRECT=1`: only the remote wake-up with a plain UCX sender (to trace
//! it with `perf sched record`); `PAIR=1`: the CPU share of two connected
//! idle pollers over a quiet second; `QUIET_US=n`: the quiet spell before
//! each sample, µs (default 20 000, the bench's).

use std::time::Duration;

use kvpoll_cli::bench::engine as eb;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let rounds: u32 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(3);
    let tls = args.get(2).map_or("posix,sysv,cma", String::as_str);
    let quiet = std::env::var("QUIET_US")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(Duration::from_millis(20), Duration::from_micros);
    if std::env::var_os("DIRECT").is_some() {
        let d = eb::remote_wake_up_direct(20, quiet, tls).expect("direct");
        println!("remote direct p50 {:.1} us", eb::quantile(&d, 0.5) / 1e3);
        return;
    }
    if std::env::var_os("PAIR").is_some() {
        pair_idle_cpu(tls);
        return;
    }
    for _ in 0..rounds {
        let park = eb::park_unpark(20, quiet);
        let wake = eb::wake_up(20, quiet).expect("wake_up");
        let remote = eb::remote_wake_up(20, quiet, tls).expect("remote_wake_up");
        let direct = eb::remote_wake_up_direct(20, quiet, tls).expect("remote_wake_up_direct");
        let p = |v: &[u64]| eb::quantile(v, 0.5) / 1e3;
        println!(
            "park/unpark {:6.1} us  submit {:6.1} us ({:.2}x)  remote via engine {:6.1} us ({:.2}x)  remote direct {:6.1} us ({:.2}x)",
            p(&park),
            p(&wake),
            p(&wake) / p(&park),
            p(&remote),
            p(&remote) / p(&park),
            p(&direct),
            p(&direct) / p(&park)
        );
    }
}

/// CPU share of each poller of a connected pair over a quiet second.
fn pair_idle_cpu(tls: &str) {
    use kvpoll::{Engine, IdlePolicy, Outcomes, RequestId};
    let options = kvpoll::ContextOptions::with_transports(tls);
    let mut p = Engine::builder()
        .idle(IdlePolicy::Adaptive)
        .ucx(options.clone())
        .build()
        .unwrap();
    p.register(4).unwrap();
    let mut c = Engine::builder()
        .idle(IdlePolicy::Adaptive)
        .ucx(options)
        .build()
        .unwrap();
    c.register(4).unwrap();
    let peer = c.add_peer(&p.local_metadata().unwrap()).unwrap();
    let mut out = Outcomes::default();
    let id = RequestId(1);
    let lend = p
        .lend(id, &[kvpoll::BlockId(0)], 1, Duration::from_secs(10))
        .unwrap();
    c.notify_only(id, &[(peer, lend)]).unwrap();
    while !out.finished_sending.contains(&id) {
        p.poll(&mut out);
        std::thread::yield_now();
    }
    let p2 = RequestId(2);
    p.lend(p2, &[kvpoll::BlockId(0)], 1, Duration::from_secs(10))
        .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let (a0, b0, t0) = (
        p.poller_cpu_time().unwrap(),
        c.poller_cpu_time().unwrap(),
        std::time::Instant::now(),
    );
    let (sp0, sc0) = (p.poller_stats(), c.poller_stats());
    std::thread::sleep(Duration::from_secs(1));
    let (a1, b1, w) = (
        p.poller_cpu_time().unwrap(),
        c.poller_cpu_time().unwrap(),
        t0.elapsed(),
    );
    let (sp1, sc1) = (p.poller_stats(), c.poller_stats());
    println!(
        "{tls}: quiet pair, P poller {:.2} % core ({} idle iterations), C poller {:.2} % core ({} idle iterations)",
        (a1 - a0).as_secs_f64() / w.as_secs_f64() * 100.0,
        sp1.idle_iterations - sp0.idle_iterations,
        (b1 - b0).as_secs_f64() / w.as_secs_f64() * 100.0,
        sc1.idle_iterations - sc0.idle_iterations,
    );
}
