//! Fencing drills across processes: two `kvpoll serve` prefill ranks and
//! one `kvpoll connect` decode rank over tcp, pull and push, with one side
//! stopped (SIGSTOP) for half, one and a half and five times the lease
//! while requests are in flight. Every block is checked on arrival and
//! again when it is given back, so a late write into reused blocks shows as
//! corruption. A drill passes when `connect --allow-failures` exits 0
//! (nothing corrupted or leaked), reports every request, and ends within a
//! bound (a quarantine that never lifts shows as a hang).
//!
//! Partitions too: one prefill rank runs in its own network namespace,
//! joined to the others by a veth pair whose link is cut (`ip link set
//! down`) for 1.5x and 5x the lease. Building namespaces needs root
//! (CAP_NET_ADMIN) and `ip`; without them those drills say so and skip.
//!
//! The lease is short (400 ms) so that a 5x stop takes two seconds.

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod procs;

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

/// A prefill rank here, its UCX on loopback only: interfaces that other
/// drills bring up and down (their veth pairs) must not carry its traffic.
fn serve(rank: u32) -> (Proc, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvpoll"))
        .args(["serve", "--rank", &rank.to_string(), "--tls", "tcp"])
        .arg("--until-stdin-closes")
        .env("UCX_NET_DEVICES", "lo")
        .args(["--blocks", "256", "--block-size", "4096", "--layers", "2"])
        .args(["--lease-ms", &LEASE_MS.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn kvpoll serve");
    let addr = procs::listen_addr(&mut child);
    (Proc(child), addr)
}

/// A number field of `connect --json`'s first mode.
use procs::json_field as field;

/// What happens to the run while requests are in flight.
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// One side's process is stopped (SIGSTOP) this long.
    Stop(Side, u64),
    /// Prefill rank 0's link is down this long.
    Partition(u64),
}

/// A network namespace holding one end of a veth pair; the other end is in
/// this namespace. Removed on drop.
struct Netns {
    name: String,
    host_if: String,
    ns_if: String,
    ns_addr: String,
    host_addr: String,
}

impl Netns {
    /// `None` where namespaces cannot be built here (not root, no `ip`, no
    /// veth pairs).
    fn new(n: u32) -> Option<Netns> {
        let id = std::process::id() % 10_000;
        let ns = Netns {
            name: format!("kvpoll-drill-{id}-{n}"),
            host_if: format!("kvh{id}x{n}"),
            ns_if: format!("kvn{id}x{n}"),
            ns_addr: format!("10.77.{n}.2"),
            host_addr: format!("10.77.{n}.1"),
        };
        let ip = |args: &[&str]| {
            Command::new("ip")
                .args(args)
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        if !ip(&["netns", "add", &ns.name]) {
            return None;
        }
        let ok = ip(&[
            "link",
            "add",
            &ns.host_if,
            "type",
            "veth",
            "peer",
            "name",
            &ns.ns_if,
        ]) && ip(&["link", "set", &ns.ns_if, "netns", &ns.name])
            && ip(&[
                "addr",
                "add",
                &format!("{}/24", ns.host_addr),
                "dev",
                &ns.host_if,
            ])
            && ip(&["link", "set", &ns.host_if, "up"])
            && ip(&[
                "netns",
                "exec",
                &ns.name,
                "ip",
                "addr",
                "add",
                &format!("{}/24", ns.ns_addr),
                "dev",
                &ns.ns_if,
            ])
            && ip(&[
                "netns", "exec", &ns.name, "ip", "link", "set", &ns.ns_if, "up",
            ])
            && ip(&["netns", "exec", &ns.name, "ip", "link", "set", "lo", "up"])
            && Command::new("ip")
                .args([
                    "netns",
                    "exec",
                    &ns.name,
                    env!("CARGO_BIN_EXE_kvpoll"),
                    "--version",
                ])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
        // A namespace without veth support (some containers): the drill
        // cannot run here; `ns` is removed on drop.
        ok.then_some(ns)
    }

    fn link(&self, up: bool) {
        let st = Command::new("ip")
            .args(["link", "set", &self.host_if, if up { "up" } else { "down" }])
            .status()
            .expect("ip link set");
        assert!(st.success(), "ip link set {} failed", self.host_if);
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", &self.host_if])
            .stderr(Stdio::null())
            .status();
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .stderr(Stdio::null())
            .status();
    }
}

/// A prefill rank inside namespace `ns` (UCX there and here limited to the
/// veth ends).
fn serve_in(ns: &Netns, rank: u32) -> (Proc, String) {
    let mut child = Command::new("ip")
        .args(["netns", "exec", &ns.name, env!("CARGO_BIN_EXE_kvpoll")])
        .args(["serve", "--rank", &rank.to_string(), "--tls", "tcp"])
        .arg("--until-stdin-closes")
        .args(["--listen", &format!("{}:0", ns.ns_addr)])
        .args(["--blocks", "256", "--block-size", "4096", "--layers", "2"])
        .args(["--lease-ms", &LEASE_MS.to_string()])
        .env("UCX_NET_DEVICES", &ns.ns_if)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn kvpoll serve in a namespace");
    let addr = procs::listen_addr(&mut child);
    (Proc(child), addr)
}

fn drill(mode: &str, side: Side, stop_ms: u64) {
    run_drill(mode, Fault::Stop(side, stop_ms), None);
}

fn partition_drill(mode: &str, n: u32, down_ms: u64) {
    let Some(ns) = Netns::new(n) else {
        eprintln!(
            "SKIPPED: partition drill ({mode}, link down {down_ms} ms) needs root, `ip` \
             and veth pairs to build a network namespace"
        );
        return;
    };
    run_drill(mode, Fault::Partition(down_ms), Some(&ns));
}

fn run_drill(mode: &str, fault: Fault, ns: Option<&Netns>) {
    let ((p0, a0), (_p1, a1)) = match ns {
        Some(ns) => (serve_in(ns, 0), serve(1)),
        None => (serve(0), serve(1)),
    };
    let mut command = Command::new(env!("CARGO_BIN_EXE_kvpoll"));
    // Loopback to the rank here; the veth pair to the one in a namespace.
    match ns {
        Some(ns) => command.env("UCX_NET_DEVICES", format!("lo,{}", ns.host_if)),
        None => command.env("UCX_NET_DEVICES", "lo"),
    };
    let mut connect = Proc(
        command
            .args(["connect", "--to", &format!("{a0},{a1}"), "--mode", mode])
            .args(["--tls", "tcp", "--blocks", "256", "--block-size", "4096"])
            .args(["--layers", "2", "--requests", &REQUESTS.to_string()])
            .args(["--lease-ms", &LEASE_MS.to_string(), "--json"])
            // Requests may fail in a drill; what must not happen is
            // corruption, a leak or a request unaccounted for.
            .arg("--allow-failures")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn kvpoll connect"),
    );
    let start = Instant::now();
    // Let requests get going, then strike while they are in flight.
    std::thread::sleep(Duration::from_millis(300));
    match fault {
        Fault::Stop(side, ms) => {
            let victim = match side {
                Side::Prefill => p0.0.id(),
                Side::Decode => connect.0.id(),
            };
            procs::stop(victim);
            std::thread::sleep(Duration::from_millis(ms));
            procs::cont(victim);
        }
        Fault::Partition(ms) => {
            let ns = ns.expect("a partition needs a namespace");
            ns.link(false);
            std::thread::sleep(Duration::from_millis(ms));
            ns.link(true);
        }
    }
    let status = loop {
        if let Some(s) = connect.0.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > BOUND {
            let _ = connect.0.kill();
            let mut err = String::new();
            let _ = connect.0.stderr.take().unwrap().read_to_string(&mut err);
            panic!(
                "{mode}, {fault:?}: connect still running after {BOUND:?} (a quarantine that never lifts?); stderr:\n{err}"
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
    let what = format!("{mode}, {fault:?}");
    eprintln!("{what}: {}", out.trim());
    // No report at all: how it ended and what it said tell why.
    assert!(
        out.contains("\"corrupted_blocks\""),
        "{what}: connect printed no report (exit {status}); stderr:\n{err}"
    );
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

#[test]
fn pull_partitioned_past_the_lease() {
    partition_drill("pull", 1, LEASE_MS * 3 / 2);
}

#[test]
fn pull_partitioned_for_five_leases() {
    partition_drill("pull", 2, LEASE_MS * 5);
}

#[test]
fn push_partitioned_past_the_lease() {
    partition_drill("push", 3, LEASE_MS * 3 / 2);
}

#[test]
fn push_partitioned_for_five_leases() {
    partition_drill("push", 4, LEASE_MS * 5);
}
