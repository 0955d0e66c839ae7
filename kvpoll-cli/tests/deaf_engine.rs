//! An engine deafened by a peer killed inside a shared-memory send to it
//! says so: this process's engine writes to a push destination in another
//! process (`kvpoll engine-peer --lend-to writers`), which acknowledges
//! each write with an active message; gdb stops that process just after
//! one of its sends took a slot of this engine's receive FIFO, and kills
//! it there (docs/design.md §4). The engine must then report itself deaf
//! (`Engine::is_deaf`), refuse new requests with `Stopped::Deaf`, and
//! still report every write in flight exactly once. Before the kill, with
//! writes flowing for longer than the probe's bounds, it must not.
//!
//! Needs gdb (a test-only package); without it the test says so and
//! checks nothing. Time bounds here are guards against a hang.

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvpoll::engine::{Engine, Outcomes, Transfer};
use kvpoll::ledger::{BlockId, Incarnation, RequestId};
use kvpoll::transport::ucx::ContextOptions;
use kvpoll::{Stopped, SubmitError};

mod procs;

const SHM: &str = "posix,sysv,cma";
const BS: u64 = 4096;
const BLOCKS: u64 = 64;
const LEASE: Duration = Duration::from_secs(2);
const GUARD: Duration = Duration::from_secs(60);

/// Writes what the destination lent (`LENT <id> <incarnation>`), 16 in
/// flight at most, and polls; returns when `until` says so.
struct Writer {
    engine: Engine,
    peer: kvpoll::ledger::PeerId,
    lent: mpsc::Receiver<(u64, u64)>,
    submitted: HashSet<u64>,
    reported: HashSet<u64>,
    finished: u64,
    out: Outcomes,
}

impl Writer {
    fn turn(&mut self) {
        while self.engine.in_flight() < 16 && !self.engine.is_deaf() {
            let Ok((id, inc)) = self.lent.try_recv() else {
                break;
            };
            let b = [BlockId((id % BLOCKS) as u32)];
            let t = Transfer {
                peer: self.peer,
                local: &b,
                remote: &b,
                lend: Incarnation(inc),
            };
            match self.engine.write(RequestId(id), &[t], 1, LEASE) {
                Ok(()) => assert!(self.submitted.insert(id), "write {id} submitted twice"),
                Err(SubmitError::Stopped(Stopped::Deaf)) => break,
                Err(e) => panic!("write {id}: {e}"),
            }
        }
        self.out.clear();
        self.engine.poll(&mut self.out);
        self.finished += self.out.finished_sending.len() as u64;
        let ended = self
            .out
            .finished_sending
            .iter()
            .chain(&self.out.expired)
            .copied()
            .chain(self.out.failed_sending.iter().map(|f| f.id));
        for id in ended {
            assert!(self.submitted.contains(&id.0), "{id:?} was never submitted");
            assert!(self.reported.insert(id.0), "{id:?} reported twice");
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

#[test]
fn an_engine_whose_peer_was_killed_inside_a_shared_memory_send_to_it_reports_itself_deaf() {
    if !procs::have_gdb() {
        eprintln!("skipped: needs gdb to stop the destination inside a send");
        return;
    }
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvpoll"))
        .args(["engine-peer", "--tls", SHM, "--regions", "1"])
        .args([
            "--blocks",
            &BLOCKS.to_string(),
            "--block-size",
            &BS.to_string(),
        ])
        .args([
            "--lend-ahead",
            "32",
            "--lend-blocks",
            "1",
            "--lend-to",
            "writers",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn kvpoll engine-peer");
    let pid = child.id();
    let stdout = child.stdout.take().unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let _child = Reap(child);
    // `LENT` lines, then `READY <metadata>`, then more `LENT` lines as
    // writes end.
    let (tx, lent) = mpsc::channel();
    let (meta_tx, meta_rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            let mut w = line.split_whitespace();
            match (w.next(), w.next(), w.next()) {
                (Some("LENT"), Some(id), Some(inc)) => {
                    let (Ok(id), Ok(inc)) = (id.parse(), u64::from_str_radix(inc, 16)) else {
                        return;
                    };
                    if tx.send((id, inc)).is_err() {
                        return;
                    }
                }
                (Some("READY"), Some(hex), None) => {
                    let _ = meta_tx.send(kvpoll::wire::from_hex(hex).unwrap());
                }
                _ => {}
            }
        }
    });
    let meta = meta_rx.recv_timeout(GUARD).expect("engine-peer said READY");
    let mut engine = Engine::builder()
        .block_size(BS)
        .ucx(ContextOptions::with_transports(SHM))
        .build()
        .unwrap();
    engine.register(BLOCKS).unwrap();
    let peer = engine.add_peer(&meta).unwrap();
    let ours = kvpoll::wire::to_hex(&engine.local_metadata().unwrap());
    writeln!(stdin, "PEER {ours}").unwrap();
    let mut w = Writer {
        engine,
        peer,
        lent,
        submitted: HashSet::new(),
        reported: HashSet::new(),
        finished: 0,
        out: Outcomes::default(),
    };

    // Writes flow, acknowledged, for three probe periods and more: the
    // probe sees this engine hear.
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(2) || w.finished < 50 {
        assert!(t.elapsed() < GUARD, "{} writes done", w.finished);
        w.turn();
    }
    assert!(!w.engine.is_deaf(), "deaf with its peer alive");

    // Killed inside an acknowledgement's send, while writes go on.
    let killer = std::thread::spawn(move || procs::kill_inside_send(pid));
    while !killer.is_finished() {
        w.turn();
    }
    killer.join().unwrap().unwrap();
    let killed = Instant::now();
    while !w.engine.is_deaf() {
        assert!(
            killed.elapsed() < Duration::from_secs(20),
            "not deaf 20 s after its peer was killed inside a send to it"
        );
        w.turn();
    }
    eprintln!("deaf {:?} after the kill", killed.elapsed());

    // Nothing new is taken; what was in flight is reported once.
    let b = [BlockId(0)];
    let t = Transfer {
        peer,
        local: &b,
        remote: &b,
        lend: Incarnation(1),
    };
    assert!(matches!(
        w.engine.write(RequestId(u64::MAX), &[t], 1, LEASE),
        Err(SubmitError::Stopped(Stopped::Deaf))
    ));
    assert!(matches!(
        w.engine.lend(RequestId(u64::MAX - 1), &b, 1, LEASE),
        Err(SubmitError::Stopped(Stopped::Deaf))
    ));
    let t = Instant::now();
    while w.engine.in_flight() > 0 {
        assert!(
            t.elapsed() < GUARD,
            "{} still in flight",
            w.engine.in_flight()
        );
        w.turn();
    }
    assert_eq!(w.reported, w.submitted, "each write reported once");
    w.engine.shutdown();
}

/// Kills the child at the end, however the test ended.
struct Reap(std::process::Child);

impl Drop for Reap {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
