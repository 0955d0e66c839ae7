//! Which UCX transports an endpoint uses with and without
//! `UCP_FEATURE_WAKEUP`, and whether the receiver's armed event fd fires
//! when an active message arrives (and how fast).
//!
//! Run with UCX's info log to see each endpoint's lanes:
//!
//! ```text
//! UCX_LOG_LEVEL=info cargo run --release --example wakeup_tls 2>&1 | grep -E 'ep_cfg|tls='
//! ```
//!
//! Each case prints `tls=<list> wakeup=<on|off>`, then UCX prints the
//! endpoint configuration (`ep_cfg[..]: rma(...) am(...)`), then the case
//! prints whether the fd fired.

use std::time::{Duration, Instant};

use kvpoll::transport::ucx::{Context, ContextOptions, Endpoint, Worker, NOTIFY_AM_ID};

fn progress_for(workers: &[&Worker], d: Duration) {
    let t = Instant::now();
    while t.elapsed() < d {
        for w in workers {
            while w.progress() > 0 {}
        }
    }
}

fn case(tls: &str, wakeup: bool) -> Result<(), Box<dyn std::error::Error>> {
    eprintln!("tls={tls} wakeup={}", if wakeup { "on" } else { "off" });
    let opts = ContextOptions::with_transports(tls).wakeup(wakeup);
    let (ca, cb) = (Context::new(&opts)?, Context::new(&opts)?);
    let (a, b) = (Worker::new(&ca)?, Worker::new(&cb)?);
    b.listen_active_messages(NOTIFY_AM_ID)?;
    let ep = Endpoint::connect(&a, &b.address()?, 1)?;
    // Wire-up: a first message both ways of progress.
    ep.send_active_message(NOTIFY_AM_ID, &[0u8; 28], 1)?;
    progress_for(&[&a, &b], Duration::from_millis(50));
    b.take_active_messages(|_| {});
    let Some(fd) = b.event_fd() else {
        eprintln!("tls={tls} wakeup=off: no event fd");
        return Ok(());
    };
    let mut fired = 0;
    let mut lat = Vec::new();
    for _ in 0..20 {
        while !b.arm()? {
            b.progress();
        }
        let t = Instant::now();
        ep.send_active_message(NOTIFY_AM_ID, &[0u8; 28], 2)?;
        // Only the sender progresses: the receiver must be woken by its fd.
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let mut woke = false;
        while t.elapsed() < Duration::from_millis(200) {
            a.progress();
            // SAFETY: one valid pollfd, alive for the call; zero timeout.
            if unsafe { libc::poll(&mut pfd, 1, 0) } > 0 {
                woke = true;
                break;
            }
        }
        if woke {
            fired += 1;
            lat.push(t.elapsed().as_nanos() as u64);
        }
        progress_for(&[&a, &b], Duration::from_millis(2));
        b.take_active_messages(|_| {});
    }
    lat.sort_unstable();
    eprintln!(
        "tls={tls} wakeup=on: event fd fired for {fired}/20 messages, p50 {:.1} us",
        lat.get(lat.len() / 2).map_or(f64::NAN, |&n| n as f64 / 1e3)
    );
    drop(ep);
    progress_for(&[&a, &b], Duration::from_millis(10));
    Ok(())
}

fn main() {
    // `wakeup_tls <tls> <on|off>` runs one case (so that UCX's log lines
    // cannot interleave with another case's).
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [tls, on] = args.as_slice() {
        if let Err(e) = case(tls, on == "on") {
            eprintln!("tls={tls} wakeup={on}: {e}");
        }
        return;
    }
    for tls in ["posix,sysv,cma", "posix", "sysv", "cma", "tcp"] {
        for wakeup in [false, true] {
            if let Err(e) = case(tls, wakeup) {
                eprintln!("tls={tls} wakeup={wakeup}: {e}");
            }
        }
    }
}
