//! Fencing drills across processes: two `kvpoll serve` prefill ranks and
//! one `kvpoll connect` decode rank over tcp, pull and push, with one side
//! stopped (SIGSTOP) for half, one and a half and five times the lease
//! while requests are in flight. Every block is checked on arrival and
//! again when it is given back, so a late write into reused blocks shows as
//! corruption. A drill passes when `connect` exits 0 (nothing corrupted or
//! leaked), reports every request, and ends within a bound (a quarantine
//! that never lifts shows as a hang).
//!
//! The lease is short (400 ms) so that a 5x stop takes two seconds.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const LEASE_MS: u64 = 400;
const REQUESTS: u64 = 1500;
/// How long a drill may take end to end before it counts as hung.
const BOUND: Duration = Duration::from_secs(90);

#[derive(Clone, Copy, Debug, PartialEq)]
enum Side {
    Prefill,
    Decode,
}

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        // SAFETY: signalling our own child (it may be stopped).
        unsafe { libc::kill(self.0.id() as libc::pid_t, libc::SIGCONT) };
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn serve(rank: u32) -> (Proc, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvpoll"))
        .args(["serve", "--rank", &rank.to_string(), "--tls", "tcp"])
        .args(["--blocks", "256", "--block-size", "4096", "--layers", "2"])
        .args(["--lease-ms", &LEASE_MS.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn kvpoll serve");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .strip_prefix("LISTEN ")
        .unwrap_or_else(|| panic!("serve said {line:?}"))
        .trim()
        .to_owned();
    (Proc(child), addr)
}

/// Stops `pid` and waits until /proc says every thread of it has.
fn stop(pid: u32) {
    // SAFETY: signalling our own child.
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
        assert!(t.elapsed() < Duration::from_secs(10), "{pid} did not stop");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn cont(pid: u32) {
    // SAFETY: signalling our own child.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGCONT) }, 0);
}

/// A number field of `connect --json`'s first mode.
fn field(json: &str, name: &str) -> u64 {
    let key = format!("\"{name}\":");
    let at = json
        .find(&key)
        .unwrap_or_else(|| panic!("no {name} in {json}"));
    json[at + key.len()..]
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect::<String>()
        .parse()
        .unwrap_or_else(|_| panic!("{name} is not a number in {json}"))
}

fn drill(mode: &str, side: Side, stop_ms: u64) {
    let (p0, a0) = serve(0);
    let (_p1, a1) = serve(1);
    let mut connect = Proc(
        Command::new(env!("CARGO_BIN_EXE_kvpoll"))
            .args(["connect", "--to", &format!("{a0},{a1}"), "--mode", mode])
            .args(["--tls", "tcp", "--blocks", "256", "--block-size", "4096"])
            .args(["--layers", "2", "--requests", &REQUESTS.to_string()])
            .args(["--lease-ms", &LEASE_MS.to_string(), "--json"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn kvpoll connect"),
    );
    let start = Instant::now();
    // Let requests get going, then stop one side while they are in flight.
    std::thread::sleep(Duration::from_millis(300));
    let victim = match side {
        Side::Prefill => p0.0.id(),
        Side::Decode => connect.0.id(),
    };
    stop(victim);
    std::thread::sleep(Duration::from_millis(stop_ms));
    cont(victim);
    let status = loop {
        if let Some(s) = connect.0.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > BOUND {
            let _ = connect.0.kill();
            let mut err = String::new();
            let _ = connect.0.stderr.take().unwrap().read_to_string(&mut err);
            panic!(
                "{mode}, {side:?} stopped {stop_ms} ms: connect still running after {BOUND:?} (a quarantine that never lifts?); stderr:\n{err}"
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut out = String::new();
    connect
        .0
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    let mut err = String::new();
    let _ = connect.0.stderr.take().unwrap().read_to_string(&mut err);
    let what = format!("{mode}, {side:?} stopped {stop_ms} ms");
    eprintln!("{what}: {}", out.trim());
    assert_eq!(
        field(&out, "corrupted_blocks"),
        0,
        "{what}: corrupted blocks\n{out}\n{err}"
    );
    assert_eq!(
        field(&out, "leaked_blocks"),
        0,
        "{what}: leaked blocks\n{out}\n{err}"
    );
    let reported = field(&out, "finished")
        + field(&out, "failed")
        + field(&out, "expired")
        + field(&out, "refused");
    assert_eq!(reported, REQUESTS, "{what}: requests unaccounted\n{out}");
    assert!(status.success(), "{what}: connect exited {status}\n{err}");
}

#[test]
fn pull_prefill_stopped_for_half_the_lease() {
    drill("pull", Side::Prefill, LEASE_MS / 2);
}

#[test]
fn pull_prefill_stopped_past_the_lease() {
    drill("pull", Side::Prefill, LEASE_MS * 3 / 2);
}

#[test]
fn pull_prefill_stopped_for_five_leases() {
    drill("pull", Side::Prefill, LEASE_MS * 5);
}

#[test]
fn pull_decode_stopped_for_half_the_lease() {
    drill("pull", Side::Decode, LEASE_MS / 2);
}

#[test]
fn pull_decode_stopped_past_the_lease() {
    drill("pull", Side::Decode, LEASE_MS * 3 / 2);
}

#[test]
fn pull_decode_stopped_for_five_leases() {
    drill("pull", Side::Decode, LEASE_MS * 5);
}

#[test]
fn push_writer_stopped_for_half_the_lease() {
    drill("push", Side::Prefill, LEASE_MS / 2);
}

#[test]
fn push_writer_stopped_past_the_lease() {
    drill("push", Side::Prefill, LEASE_MS * 3 / 2);
}

#[test]
fn push_writer_stopped_for_five_leases() {
    drill("push", Side::Prefill, LEASE_MS * 5);
}

#[test]
fn push_destination_stopped_for_half_the_lease() {
    drill("push", Side::Decode, LEASE_MS / 2);
}

#[test]
fn push_destination_stopped_past_the_lease() {
    drill("push", Side::Decode, LEASE_MS * 3 / 2);
}

#[test]
fn push_destination_stopped_for_five_leases() {
    drill("push", Side::Decode, LEASE_MS * 5);
}
