//! Shared helpers for the tests that run `kvpoll` processes.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::Child;
use std::time::{Duration, Instant};

/// The address a freshly spawned `kvpoll serve` prints first (`LISTEN
/// addr`); its standard output must be piped.
pub fn listen_addr(child: &mut Child) -> String {
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("serve's stdout is piped"))
        .read_line(&mut line)
        .expect("read serve's first line");
    line.strip_prefix("LISTEN ")
        .unwrap_or_else(|| panic!("serve said {line:?}"))
        .trim()
        .to_owned()
}

/// Stops process `pid` (SIGSTOP) and waits until /proc says every thread of
/// it has: `kill()` returns before, and an operation posted next could
/// still be served.
pub fn stop(pid: u32) {
    // SAFETY: signalling a child process of the test.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGSTOP) }, 0);
    let stat = format!("/proc/{pid}/stat");
    let t = Instant::now();
    while !std::fs::read_to_string(&stat)
        .ok()
        .and_then(|s| {
            s.rsplit(')')
                .next()
                .map(|r| r.trim_start().starts_with('T'))
        })
        .unwrap_or(false)
    {
        assert!(t.elapsed() < Duration::from_secs(30), "{pid} did not stop");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Lets a stopped process `pid` go on (SIGCONT).
pub fn cont(pid: u32) {
    // SAFETY: signalling a child process of the test.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGCONT) }, 0);
}
