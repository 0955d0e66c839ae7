//! The rail-cut drill over real links: a lender and a reader of two rails
//! each, in two network namespaces joined by two veth pairs (one per rail,
//! tcp), reads kept in flight while one rail's link is set down and up
//! again, ten times. Every read is reported once; every read reported
//! finished holds the lender's bytes; reads keep finishing on the other
//! rail while one is down; the cut rail carries reads again once it is
//! back; every lend is reported once, none left behind.
//!
//! The lender and the reader are two processes of this test binary, each
//! started in its namespace (`ip netns exec`: UCX finds its devices in the
//! namespace's `/sys`, which only a process started there sees). The
//! lender lends ahead under incarnations both sides derive from the
//! request id; the reader keeps reads in flight and cuts its own ends of
//! the links.
//!
//! Needs root (`ip netns`, veth pairs). Where the machine cannot make
//! them it says so and passes without running: the library's other rail
//! tests (`tests/rails.rs`) do not need them.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::pattern;
use kvpoll::ledger::{BlockId, Incarnation, PeerId, RequestId};
use kvpoll::rails::Rails;
use kvpoll::transport::ucx::ContextOptions;
use kvpoll::{Outcomes, Transfer};

const BLOCK: u64 = 64 * 1024;
const BLOCKS: u32 = 64;
const SEED: u64 = 0xd71_1046;
/// Reads in flight at once (each on its own local blocks).
const SLOTS: u32 = 8;
const PER_SLOT: u32 = BLOCKS / SLOTS;
/// Lends the lender keeps unreported ahead of the reader at most.
const AHEAD: u64 = 96;
const CUTS: usize = 10;
const RAILS: [&str; 2] = ["kvr0", "kvr1"];
const LEASE: Duration = Duration::from_secs(6);
const ROLE: &str = "KVPOLL_RAILS_DRILL";

fn ip(args: &[&str]) -> bool {
    Command::new("ip")
        .args(args)
        .output()
        .is_ok_and(|o| o.status.success())
}

/// What both sides derive from a request id: the lend's incarnation, its
/// blocks on the lender, and how many.
fn lend_of(id: u64) -> (Incarnation, Vec<BlockId>) {
    let mut x = id.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ SEED;
    x = (x ^ (x >> 31)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    // Odd requests read a whole slot (striped), even ones two blocks
    // (whole, on one rail).
    let n = if id % 2 == 1 { PER_SLOT } else { 2 };
    let first = (id as u32).wrapping_mul(3) % (BLOCKS - n);
    (
        Incarnation(x | 1),
        (first..first + n).map(BlockId).collect(),
    )
}

fn rails(read_deadline: Duration) -> Rails {
    let mut b = Rails::builder()
        .stripe_above(4 * BLOCK)
        .relink_after(Duration::from_millis(500));
    for dev in RAILS {
        b = b.rail(
            Some(dev),
            kvpoll::Engine::builder()
                .block_size(BLOCK)
                .read_deadline(read_deadline)
                .ucx(ContextOptions::with_transports("tcp")),
        );
    }
    let mut rails = b.build().expect("rails");
    rails.register(u64::from(BLOCKS)).expect("memory");
    rails
}

/// Removes the namespaces of drills whose process is gone (killed before
/// it could remove them).
fn remove_stale() {
    let Ok(dir) = std::fs::read_dir("/run/netns") else {
        return;
    };
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let pid = name
            .strip_prefix("kvpoll-rails-")
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse::<u32>().ok());
        if pid.is_some_and(|p| !std::path::Path::new(&format!("/proc/{p}")).exists()) {
            ip(&["netns", "del", &name]);
        }
    }
}

/// Two namespaces joined by one veth pair per rail; removed on drop.
struct Links {
    near: String,
    far: String,
}

fn carrier(ns: &str, dev: &str) -> bool {
    Command::new("ip")
        .args(["-n", ns, "-o", "link", "show", dev])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("LOWER_UP"))
}

fn wait_carrier(ns: &str, dev: &str) {
    let t = Instant::now();
    while !carrier(ns, dev) {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{dev} has no carrier"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl Links {
    fn create() -> Option<Links> {
        // SAFETY: no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return None;
        }
        remove_stale();
        let pid = std::process::id();
        let links = Links {
            near: format!("kvpoll-rails-{pid}-a"),
            far: format!("kvpoll-rails-{pid}-b"),
        };
        let made = ip(&["netns", "add", &links.near]) && ip(&["netns", "add", &links.far]);
        let made =
            made && RAILS.iter().enumerate().all(|(i, dev)| {
                ip(&[
                    "link",
                    "add",
                    dev,
                    "netns",
                    &links.near,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    dev,
                    "netns",
                    &links.far,
                ]) && [(&links.near, 1), (&links.far, 2)]
                    .iter()
                    .all(|(ns, host)| {
                        ip(&[
                            "-n",
                            ns,
                            "addr",
                            "add",
                            &format!("10.78.{i}.{host}/24"),
                            "dev",
                            dev,
                        ]) && ip(&["-n", ns, "link", "set", dev, "up"])
                    })
            }) && [&links.near, &links.far]
                .iter()
                .all(|ns| ip(&["-n", ns, "link", "set", "lo", "up"]));
        if !made {
            return None;
        }
        for dev in RAILS {
            wait_carrier(&links.near, dev);
            wait_carrier(&links.far, dev);
        }
        Some(links)
    }

    /// This test binary as `role`, in namespace `ns`.
    fn spawn(&self, ns: &str, role: &str) -> std::process::Child {
        Command::new("ip")
            .args(["netns", "exec", ns])
            .arg(std::env::current_exe().unwrap())
            .args(["--exact", "child", "--nocapture", "--test-threads", "1"])
            .env(ROLE, role)
            .env("KVPOLL_DRILL_NS", ns)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawning a side")
    }
}

impl Drop for Links {
    fn drop(&mut self) {
        ip(&["netns", "del", &self.near]);
        ip(&["netns", "del", &self.far]);
    }
}

/// What follows `tag ` on the first line of `out` that has it (the test
/// harness may have written its own words before it on that line).
fn line(out: &mut impl BufRead, tag: &str) -> String {
    let tag = format!("{tag} ");
    let mut l = String::new();
    loop {
        l.clear();
        assert!(out.read_line(&mut l).unwrap() > 0, "no {tag}line");
        if let Some(at) = l.find(&tag) {
            return l[at + tag.len()..].trim().to_owned();
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// The lender: prints its metadata, lends ahead of the reader (at most
/// `AHEAD` unreported), until its standard input closes; then waits for
/// every lend to be reported and prints what it saw.
fn lender() {
    let mut rails = rails(Duration::from_secs(30));
    let mut buf = vec![0u8; BLOCK as usize];
    for b in 0..BLOCKS {
        pattern::fill(SEED, u64::from(b), &mut buf);
        rails.write_block(0, BlockId(b), &buf).unwrap();
    }
    println!("META {}", hex(&rails.local_metadata().unwrap()));
    static EOF: AtomicBool = AtomicBool::new(false);
    std::thread::spawn(|| {
        let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut Vec::new());
        EOF.store(true, Ordering::Release);
    });
    let mut reports: HashMap<RequestId, usize> = HashMap::new();
    let mut lent = 0u64;
    let mut out = Outcomes::default();
    let mut take = |rails: &mut Rails, reports: &mut HashMap<RequestId, usize>| {
        out.clear();
        rails.poll(&mut out);
        for id in out.finished_sending.iter().chain(&out.expired) {
            *reports.entry(*id).or_default() += 1;
        }
        assert!(out.failed_sending.is_empty(), "{out:?}");
    };
    while !EOF.load(Ordering::Acquire) {
        while lent < reports.len() as u64 + AHEAD {
            lent += 1;
            let (inc, blocks) = lend_of(lent);
            rails
                .lend_with(RequestId(lent), &blocks, 1, LEASE, inc)
                .expect("lend");
        }
        take(&mut rails, &mut reports);
        std::thread::sleep(Duration::from_micros(200));
    }
    let t = Instant::now();
    while rails.in_flight() > 0 {
        assert!(
            t.elapsed() < LEASE + Duration::from_secs(10),
            "lends never reported"
        );
        take(&mut rails, &mut reports);
        std::thread::sleep(Duration::from_millis(1));
    }
    let twice = reports.values().filter(|&&n| n > 1).count();
    println!("LENDS {lent} {} {twice}", reports.len());
}

struct InFlight {
    slot: u32,
    lent: Vec<BlockId>,
}

struct Reader {
    rails: Rails,
    peer: PeerId,
    out: Outcomes,
    next: u64,
    free: Vec<u32>,
    flying: HashMap<RequestId, InFlight>,
    reports: HashMap<RequestId, usize>,
    finished: u64,
    failed: u64,
    refused: u64,
    corrupted: u64,
    /// Failed reads by cause.
    causes: std::collections::BTreeMap<String, u64>,
}

impl Reader {
    fn submit(&mut self) {
        while let Some(slot) = self.free.pop() {
            self.next += 1;
            let id = RequestId(self.next);
            let (inc, lent) = lend_of(self.next);
            let local: Vec<_> = (slot * PER_SLOT..slot * PER_SLOT + lent.len() as u32)
                .map(BlockId)
                .collect();
            let t = Transfer {
                peer: self.peer,
                local: &local,
                remote: &lent,
                lend: inc,
            };
            match self.rails.read(id, &[t]) {
                Ok(()) => {
                    self.flying.insert(id, InFlight { slot, lent });
                }
                Err(kvpoll::rails::RailsError::NoLiveRail { .. }) => {
                    // No rail reaches the lender now (every link lost,
                    // none added again yet): nothing was sent (the lend
                    // ends at its lease); try the next one later.
                    self.refused += 1;
                    self.free.push(slot);
                    return;
                }
                Err(e) => panic!("read: {e}"),
            }
        }
    }

    fn poll(&mut self) {
        self.out.clear();
        self.rails.poll(&mut self.out);
        let mut buf = vec![0u8; BLOCK as usize];
        for id in self.out.finished_recving.clone() {
            *self.reports.entry(id).or_default() += 1;
            let f = self.flying.remove(&id).expect("a read in flight");
            for (i, r) in f.lent.iter().enumerate() {
                self.rails
                    .read_block(0, BlockId(f.slot * PER_SLOT + i as u32), &mut buf)
                    .unwrap();
                if !pattern::check(SEED, u64::from(r.0), &buf) {
                    self.corrupted += 1;
                }
            }
            self.finished += 1;
            self.free.push(f.slot);
        }
        for f in self.out.failed_recving.clone() {
            *self.reports.entry(f.id).or_default() += 1;
            let fl = self.flying.remove(&f.id).expect("a read in flight");
            for i in 0..fl.lent.len() as u32 {
                let b = BlockId(fl.slot * PER_SLOT + i);
                assert!(
                    self.out.blocks_of(&f).contains(&b),
                    "a failed read names its blocks"
                );
            }
            self.failed += 1;
            *self
                .causes
                .entry(format!("{:?}", f.reason.cause))
                .or_default() += 1;
            self.free.push(fl.slot);
        }
    }

    /// Keeps reads in flight for `d`.
    fn run(&mut self, d: Duration) {
        let t = Instant::now();
        while t.elapsed() < d {
            self.submit();
            self.poll();
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    fn parts(&self, rail: usize) -> u64 {
        self.rails.stats()[rail].parts_finished
    }
}

/// The reader: takes the lender's metadata, keeps reads in flight, and
/// cuts each rail's link in turn (its own end), `CUTS` times.
fn reader() {
    let ns = std::env::var("KVPOLL_DRILL_NS").unwrap();
    let mut rails = rails(Duration::from_millis(1500));
    let meta = unhex(&line(&mut BufReader::new(std::io::stdin()), "META"));
    let peer = rails.add_peer(&meta).unwrap();
    let mut r = Reader {
        rails,
        peer,
        out: Outcomes::default(),
        next: 0,
        free: (0..SLOTS).collect(),
        flying: HashMap::new(),
        reports: HashMap::new(),
        finished: 0,
        failed: 0,
        refused: 0,
        corrupted: 0,
        causes: Default::default(),
    };
    r.run(Duration::from_millis(500));
    let mut log = Vec::new();
    for cut in 0..CUTS {
        let rail = cut % 2;
        assert!(ip(&["link", "set", RAILS[rail], "down"]));
        let before = r.finished;
        r.run(Duration::from_millis(2500));
        let during = r.finished - before;
        assert!(ip(&["link", "set", RAILS[rail], "up"]));
        wait_carrier(&ns, RAILS[rail]);
        // Back: the cut rail carries a read that ends well again.
        let parts = r.parts(rail);
        let t = Instant::now();
        while r.parts(rail) == parts {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "cut {cut}: rail {rail} carried no read in 20 s after it came back: {:?}; failed reads by cause {:?}",
                r.rails.stats(),
                r.causes
            );
            r.run(Duration::from_millis(50));
        }
        log.push((cut, rail, during, t.elapsed().as_millis()));
        assert!(
            during > 0,
            "cut {cut}: no read finished while rail {rail} was down"
        );
    }
    let t = Instant::now();
    while !r.flying.is_empty() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "reads never reported"
        );
        r.poll();
        std::thread::sleep(Duration::from_millis(1));
    }
    eprintln!(
        "reader: per cut (cut, rail, reads finished while down, ms until the rail carried one again): {log:?}; failed reads by cause {:?}",
        r.causes
    );
    for (i, s) in r.rails.stats().iter().enumerate() {
        eprintln!(
            "reader rail {i}: parts finished {} failed {}, links left out {}, added again {}, bytes {}",
            s.parts_finished, s.parts_failed, s.links_down, s.relinks, s.poller.bytes_moved
        );
    }
    let twice = r.reports.values().filter(|&&n| n > 1).count();
    let unreported = r.next - r.refused - r.reports.len() as u64;
    println!(
        "READS {} {} {} {} {} {twice} {unreported}",
        r.next, r.finished, r.failed, r.refused, r.corrupted
    );
    assert_eq!(r.rails.in_flight(), 0);
}

/// The sides; do nothing unless run as one.
#[test]
fn child() {
    match std::env::var(ROLE).as_deref() {
        Ok("lender") => lender(),
        Ok("reader") => reader(),
        _ => {}
    }
}

#[test]
fn a_rail_cut_and_restored_ten_times_under_load_loses_no_read_and_no_block() {
    let Some(links) = Links::create() else {
        eprintln!("skipped: this machine cannot make network namespaces joined by veth pairs");
        return;
    };
    let mut lender = links.spawn(&links.far, "lender");
    let mut lender_out = BufReader::new(lender.stdout.take().unwrap());
    let meta = line(&mut lender_out, "META");
    let mut reader = links.spawn(&links.near, "reader");
    writeln!(reader.stdin.take().unwrap(), "META {meta}").unwrap();
    let mut reader_out = BufReader::new(reader.stdout.take().unwrap());
    let reads = line(&mut reader_out, "READS");
    assert!(reader.wait().unwrap().success(), "the reader failed");
    drop(lender.stdin.take());
    let lends = line(&mut lender_out, "LENDS");
    assert!(lender.wait().unwrap().success(), "the lender failed");
    let reads: Vec<u64> = reads.split(' ').map(|v| v.parse().unwrap()).collect();
    let lends: Vec<u64> = lends.split(' ').map(|v| v.parse().unwrap()).collect();
    eprintln!(
        "{} reads: {} finished, {} failed, {} not sent (no live rail); {} lends, {} reported",
        reads[0], reads[1], reads[2], reads[3], lends[0], lends[1]
    );
    assert_eq!(
        reads[4], 0,
        "blocks read finished that did not hold the lender's bytes"
    );
    assert_eq!(reads[5], 0, "reads reported twice");
    assert_eq!(reads[6], 0, "reads never reported");
    assert_eq!(lends[0], lends[1], "lends never reported (blocks leaked)");
    assert_eq!(lends[2], 0, "lends reported twice");
}
