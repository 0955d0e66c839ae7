//! Read confirmation from the lender's lend word, across processes over
//! real UCX: a `kvpoll engine-peer --lend-ahead` process lends request ids
//! (printing each id's incarnation), and an engine here reads them with
//! confirmation on. Over shared memory the data and the word are read
//! one-sidedly, so a read is confirmed while its lender is stopped; a
//! lend that ended (consumed) fails a second read of it; over tcp, where
//! a word's get is not one-sided, reads ask and are confirmed.

use std::io::{BufRead, BufReader, Lines};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use kvpoll::engine::{Engine, Outcomes, Transfer};
use kvpoll::ledger::{BlockId, Cause, RequestId};
use kvpoll::transport::ucx::ContextOptions;
use kvpoll::wire::from_hex;
use kvpoll::Incarnation;
use kvpoll_cli::bench::e2e::lent_line;

mod procs;

const BS: u64 = 4096;
const SEED: u64 = 5;
const SHM: &str = "posix,sysv,cma";
const GUARD: Duration = Duration::from_secs(60);

/// A lending peer: its metadata, what it lent so far, and its output.
struct Lender {
    child: Child,
    metadata: Vec<u8>,
    lent: Vec<(u64, Incarnation)>,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Drop for Lender {
    fn drop(&mut self) {
        // SAFETY: signalling our own child (it may be stopped).
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGCONT) };
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Lender {
    /// A peer over `tls` lending ids 0..`ahead` (one reader each, an hour's
    /// lease), and one more each time one ends.
    fn spawn(tls: &str, ahead: u32) -> Lender {
        Self::spawn_in(tls, ahead, "ucx")
    }

    /// [`Lender::spawn`] with its blocks in `memory`: `ucx` (UCX-allocated)
    /// or `caller` (memory the peer mapped itself).
    fn spawn_in(tls: &str, ahead: u32, memory: &str) -> Lender {
        Self::spawn_with(tls, ahead, memory, &[])
    }

    /// [`Lender::spawn_in`] with more options of `engine-peer`.
    fn spawn_with(tls: &str, ahead: u32, memory: &str, more: &[&str]) -> Lender {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvpoll"))
            .args(["engine-peer", "--tls", tls, "--blocks", "16"])
            .args(["--memory", memory])
            .args(["--block-size", &BS.to_string(), "--regions", "1"])
            .args(["--seed", &SEED.to_string()])
            .args(["--lend-ahead", &ahead.to_string()])
            .args(more)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn kvpoll engine-peer");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut lent = Vec::new();
        loop {
            let line = lines.next().expect("the peer's READY").unwrap();
            if let Some(l) = lent_line(&line) {
                lent.push(l);
                continue;
            }
            let hex = line
                .strip_prefix("READY ")
                .unwrap_or_else(|| panic!("peer said {line:?}"));
            return Lender {
                child,
                metadata: from_hex(hex.trim()).unwrap(),
                lent,
                lines,
            };
        }
    }

    /// Waits until the peer lent id `id` (it lends one more each time a
    /// lend ends and the end reached its engine).
    fn wait_lent(&mut self, id: u64) {
        while !self.lent.iter().any(|&(i, _)| i == id) {
            let line = self.lines.next().expect("a LENT line").unwrap();
            if let Some(l) = lent_line(&line) {
                self.lent.push(l);
            }
        }
    }

    fn incarnation(&self, id: u64) -> Incarnation {
        self.lent
            .iter()
            .find(|&&(i, _)| i == id)
            .map(|&(_, inc)| inc)
            .expect("lent")
    }
}

fn reader(tls: &str) -> Engine {
    let mut e = Engine::builder()
        .block_size(BS)
        .ucx(ContextOptions::with_transports(tls))
        .build()
        .unwrap();
    e.register(16).unwrap();
    e
}

/// The block the peer lends under request id `id` (`--lend-blocks` 1 of
/// its 16).
fn lent_block(id: u64) -> u32 {
    (id % 16) as u32
}

/// Reads the block of lend `id` (incarnation `inc`) into local block
/// `local` within `deadline`; returns the report.
fn read(
    e: &mut Engine,
    peer: kvpoll::PeerId,
    id: u64,
    inc: Incarnation,
    local: u32,
    deadline: Duration,
) -> Outcomes {
    e.read_with_deadline(
        RequestId(id),
        &[Transfer {
            peer,
            local: &[BlockId(local)],
            remote: &[BlockId(lent_block(id))],
            lend: inc,
        }],
        deadline,
    )
    .unwrap();
    let mut out = Outcomes::default();
    let t = Instant::now();
    while out.finished_recving.is_empty() && out.failed_recving.is_empty() {
        e.poll(&mut out);
        assert!(t.elapsed() < GUARD, "no report: {out:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
    out
}

/// Whether local block `local` holds the block of lend `id`.
fn holds_the_lent_block(e: &Engine, local: u32, id: u64) -> bool {
    let mut buf = vec![0u8; BS as usize];
    e.read_block(0, BlockId(local), &mut buf).unwrap();
    kvpoll_cli::pattern::check(SEED * 100, u64::from(lent_block(id)), &buf)
}

/// Over shared memory a confirmed read needs nothing of its lender's
/// poller: its data and then the lender's word for the lend are read
/// one-sidedly, and the word names the lend, so the read finishes while
/// the lender is stopped (asking it would wait for it to resume).
#[test]
fn over_shared_memory_a_read_is_confirmed_from_the_lend_word_while_its_lender_is_stopped() {
    read_while_the_lender_is_stopped("ucx");
}

/// The same of memory the lender mapped itself, which UCX 1.13 reads only
/// through the lender's progress: kvpoll reads it directly
/// (`process_vm_readv`), one-sided on every UCX version.
#[test]
fn over_shared_memory_a_read_of_caller_memory_is_confirmed_while_its_lender_is_stopped() {
    read_while_the_lender_is_stopped("caller");
}

fn read_while_the_lender_is_stopped(memory: &str) {
    let lender = Lender::spawn_in(SHM, 4, memory);
    let mut e = reader(SHM);
    let peer = e.add_peer(&lender.metadata).unwrap();
    // Connected and warm: one read while the lender runs.
    let out = read(
        &mut e,
        peer,
        0,
        lender.incarnation(0),
        0,
        Duration::from_secs(10),
    );
    assert_eq!(out.finished_recving, vec![RequestId(0)], "{out:?}");
    procs::stop(lender.child.id());
    let t = Instant::now();
    let out = read(
        &mut e,
        peer,
        1,
        lender.incarnation(1),
        1,
        Duration::from_secs(3),
    );
    assert_eq!(
        out.finished_recving,
        vec![RequestId(1)],
        "not confirmed while the lender was stopped: {out:?}"
    );
    assert!(t.elapsed() < Duration::from_secs(3));
    assert!(holds_the_lent_block(&e, 1, 1));
    procs::cont(lender.child.id());
}

/// A lend that ended (its one reader was counted) has its word
/// overwritten before its end reaches the lender's engine: a second read
/// naming it finds no word, asks, and is refused.
#[test]
fn over_shared_memory_a_read_of_a_consumed_lend_fails() {
    read_of_a_consumed_lend("ucx");
}

/// The same when the lender's blocks are its own memory, read directly:
/// the data is read, the word is not the lend's any more, and the read
/// fails.
#[test]
fn over_shared_memory_a_direct_read_of_a_consumed_lend_fails() {
    read_of_a_consumed_lend("caller");
}

fn read_of_a_consumed_lend(memory: &str) {
    let mut lender = Lender::spawn_in(SHM, 4, memory);
    let mut e = reader(SHM);
    let peer = e.add_peer(&lender.metadata).unwrap();
    let inc = lender.incarnation(0);
    let out = read(&mut e, peer, 0, inc, 0, Duration::from_secs(10));
    assert_eq!(out.finished_recving, vec![RequestId(0)], "{out:?}");
    // The lender's engine heard that lend 0 ended: it lent id 4.
    lender.wait_lent(4);
    let out = read(&mut e, peer, 0, inc, 1, Duration::from_secs(10));
    assert_eq!(out.failed_recving.len(), 1, "{out:?}");
    assert_eq!(out.failed_recving[0].reason.cause, Cause::LeaseLost);
}

/// Over tcp, where UCX serves a get from the lender's progress (behind
/// other reads' data), the first word read is not done at once and the
/// reads after it ask: all are confirmed, and their lends consumed.
#[test]
fn over_tcp_reads_are_confirmed_and_their_lends_consumed() {
    let mut lender = Lender::spawn("tcp", 4);
    let mut e = reader("tcp");
    let peer = e.add_peer(&lender.metadata).unwrap();
    for id in 0..4 {
        let out = read(
            &mut e,
            peer,
            id,
            lender.incarnation(id),
            id as u32,
            Duration::from_secs(10),
        );
        assert_eq!(out.finished_recving, vec![RequestId(id)], "{out:?}");
        assert!(holds_the_lent_block(&e, id as u32, id));
    }
    // Each of the four ended at the lender: it lent 4 more.
    lender.wait_lent(7);
}

/// A lender whose command ring fills while it lends ahead (a ring of two
/// entries holds one lend: its poller is behind at once) polls and lends
/// again instead of giving up: it lends all it was asked to before READY,
/// and lends on as reads end, through the same full ring.
#[test]
fn a_lender_whose_command_ring_fills_polls_and_lends_on() {
    const AHEAD: u32 = 2000;
    let mut lender = Lender::spawn_with(SHM, AHEAD, "ucx", &["--command-ring", "2"]);
    assert_eq!(lender.lent.len(), AHEAD as usize);
    let mut e = reader(SHM);
    let peer = e.add_peer(&lender.metadata).unwrap();
    for id in 0..4 {
        let inc = lender.incarnation(id);
        let out = read(&mut e, peer, id, inc, id as u32, Duration::from_secs(10));
        assert_eq!(out.finished_recving, vec![RequestId(id)], "{out:?}");
    }
    // Each of the four ended at the lender: it lent four more.
    lender.wait_lent(u64::from(AHEAD) + 3);
    drop(lender.child.stdin.take());
    let t = Instant::now();
    let status = loop {
        if let Some(s) = lender.child.try_wait().unwrap() {
            break s;
        }
        assert!(t.elapsed() < GUARD, "the lender did not stop");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(status.success(), "{status:?}");
}
