//! Wake-up figures alone, several rounds, for experiments: p50 of a
//! park/unpark, of a submit wake-up and of a remote wake-up (µs).
//!
//! `cargo run --release -p kvpoll-cli --example wake_probe -- 3 posix,sysv,cma`

use std::time::Duration;

use kvpoll_cli::bench::engine as eb;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let rounds: u32 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(3);
    let tls = args.get(2).map_or("posix,sysv,cma", String::as_str);
    let quiet = Duration::from_millis(20);
    for _ in 0..rounds {
        let park = eb::park_unpark(20, quiet);
        let wake = eb::wake_up(20, quiet).expect("wake_up");
        let remote = eb::remote_wake_up(20, quiet, tls).expect("remote_wake_up");
        let p = |v: &[u64]| eb::quantile(v, 0.5) / 1e3;
        println!(
            "park/unpark {:7.1} us  submit {:7.1} us ({:.2}x)  remote {:7.1} us ({:.2}x)",
            p(&park),
            p(&wake),
            p(&wake) / p(&park),
            p(&remote),
            p(&remote) / p(&park)
        );
    }
}
