//! The engine against a peer engine in another process: a stopped peer
//! (SIGSTOP) is failed at the deadline through forced close; a killed one
//! (SIGKILL) fails its reads without waiting for a deadline and can be added
//! again with fresh metadata.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvpoll::engine::{Engine, Outcomes, Transfer};
use kvpoll::ledger::{BlockId, Cause, PeerId, RequestId};
use kvpoll::transport::ucx::ContextOptions;
use kvpoll::wire::from_hex;

mod procs;

const BS: u64 = 4096;
const GUARD: Duration = Duration::from_secs(60);

struct PeerProcess {
    child: Child,
    metadata: Vec<u8>,
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        // SAFETY: signalling our own child (it may be stopped).
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGCONT) };
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const SHM: &str = "posix,sysv,cma";

fn spawn(seed: u64) -> PeerProcess {
    spawn_over(seed, "tcp", "ucx")
}

/// A peer engine over `tls` whose regions are `memory` (`ucx` or `caller`).
fn spawn_over(seed: u64, tls: &str, memory: &str) -> PeerProcess {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvpoll"))
        .args(["engine-peer", "--tls", tls, "--memory", memory])
        .args(["--blocks", "64"])
        .args(["--block-size", &BS.to_string(), "--regions", "2"])
        .args(["--seed", &seed.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn kvpoll engine-peer");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let hex = line
        .strip_prefix("READY ")
        .unwrap_or_else(|| panic!("peer said {line:?}"));
    PeerProcess {
        child,
        metadata: from_hex(hex.trim()).unwrap(),
    }
}

fn decode_engine(deadline: Duration) -> Engine {
    decode_engine_over("tcp", deadline)
}

fn decode_engine_over(tls: &str, deadline: Duration) -> Engine {
    let mut e = Engine::builder()
        .block_size(BS)
        .ucx(ContextOptions::with_transports(tls))
        .read_deadline(deadline)
        // The peer process serves its blocks without lending them: reads
        // of unguarded memory (lend confirmation: tests/fencing.rs).
        .confirm_reads(false)
        .build()
        .unwrap();
    e.register(64).unwrap();
    e.register(64).unwrap();
    e
}

fn ids(v: &[u32]) -> Vec<BlockId> {
    v.iter().map(|&b| BlockId(b)).collect()
}

fn wait_report(e: &mut Engine, out: &mut Outcomes) {
    let t = Instant::now();
    while out.finished_recving.is_empty() && out.failed_recving.is_empty() {
        e.poll(out);
        assert!(t.elapsed() < GUARD, "no report: {out:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Submits read `id` of `remote` into `local` from `peer`, which serves
/// its blocks without lending them (an unconfirmed read).
fn unguarded_read(
    d: &mut Engine,
    peer: kvpoll::ledger::PeerId,
    id: RequestId,
    local: &[BlockId],
    remote: &[BlockId],
) {
    d.read(
        id,
        &[Transfer {
            peer,
            local,
            remote,
            lend: kvpoll::Incarnation::NONE,
        }],
    )
    .unwrap();
}

/// An engine that read from a peer over `tls` (its regions `memory`),
/// then killed it and submitted read 2 to it: UCX notices a dead peer
/// when it next talks to it.
fn read_then_kill_the_peer(seed: u64, tls: &str, memory: &str) -> (Engine, PeerId) {
    let mut peer = spawn_over(seed, tls, memory);
    let mut d = decode_engine_over(tls, GUARD);
    let p = d.add_peer(&peer.metadata).unwrap();
    read_and_verify(&mut d, p, 1, seed);
    peer.child.kill().unwrap();
    peer.child.wait().unwrap();
    unguarded_read(&mut d, p, RequestId(2), &ids(&[3]), &ids(&[3]));
    (d, p)
}

/// Waits for the one read report and checks it failed `PeerLost`: a
/// killed peer is a lost peer, whichever error UCX reported first.
fn wait_one_read_failed_peer_lost(d: &mut Engine, out: &mut Outcomes) {
    wait_report(d, out);
    assert_eq!(out.failed_recving.len(), 1, "{out:?}");
    assert_eq!(
        out.failed_recving[0].reason.cause,
        Cause::PeerLost,
        "{out:?}"
    );
}

fn wait_peer_lost(e: &mut Engine, out: &mut Outcomes) {
    let t = Instant::now();
    while out.peers_lost.is_empty() {
        assert!(
            t.elapsed() < GUARD,
            "the lost peer was never reported: {out:?}"
        );
        e.poll(out);
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn read_and_verify(d: &mut Engine, peer: kvpoll::ledger::PeerId, id: u64, seed: u64) {
    let (local, remote) = (ids(&[0, 1, 2]), ids(&[7, 8, 9]));
    unguarded_read(d, peer, RequestId(id), &local, &remote);
    let mut out = Outcomes::default();
    wait_report(d, &mut out);
    assert_eq!(out.finished_recving, vec![RequestId(id)], "{out:?}");
    let mut buf = vec![0u8; BS as usize];
    for r in 0..2 {
        for (l, rb) in local.iter().zip(&remote) {
            d.read_block(r, *l, &mut buf).unwrap();
            assert!(kvpoll_cli::pattern::check(
                seed * 100 + r as u64,
                u64::from(rb.0),
                &buf
            ));
        }
    }
}

#[test]
fn a_stopped_peer_process_fails_reads_at_the_deadline_through_forced_close() {
    let peer = spawn(3);
    let deadline = Duration::from_millis(1000);
    let mut d = decode_engine(deadline);
    let p = d.add_peer(&peer.metadata).unwrap();
    read_and_verify(&mut d, p, 1, 3);

    procs::stop(peer.child.id());
    let t = Instant::now();
    unguarded_read(&mut d, p, RequestId(2), &ids(&[4]), &ids(&[4]));
    // A sibling on the same endpoint with a long deadline of its own.
    d.read_with_deadline(
        RequestId(3),
        &[Transfer {
            peer: p,
            local: &ids(&[5]),
            remote: &ids(&[5]),
            lend: kvpoll::Incarnation::NONE,
        }],
        GUARD,
    )
    .unwrap();
    let mut out = Outcomes::default();
    let t2 = Instant::now();
    while out.failed_recving.len() < 2 {
        d.poll(&mut out);
        assert!(t2.elapsed() < GUARD, "no reports: {out:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(t.elapsed() >= deadline, "failed before its deadline");
    assert_eq!(out.failed_recving.len(), 2, "{out:?}");
    let by_id = |id: u64| {
        out.failed_recving
            .iter()
            .find(|f| f.id == RequestId(id))
            .cloned()
            .unwrap_or_else(|| panic!("request {id} not failed: {out:?}"))
    };
    // The read that hit its deadline says so; its sibling, cut by the
    // forced close, says the peer stalled.
    assert_eq!(by_id(2).reason.cause, Cause::Deadline);
    assert_eq!(out.blocks_of(&by_id(2)), &ids(&[4])[..]);
    assert_eq!(by_id(3).reason.cause, Cause::PeerStalled);
}

#[test]
fn a_killed_peer_process_fails_reads_without_a_deadline_and_can_be_added_again() {
    let mut peer = spawn(4);
    let mut d = decode_engine(GUARD);
    let p = d.add_peer(&peer.metadata).unwrap();
    read_and_verify(&mut d, p, 1, 4);

    // Stop it so the read is surely in flight, then kill it.
    procs::stop(peer.child.id());
    d.read(
        RequestId(2),
        &[Transfer {
            peer: p,
            local: &ids(&[5, 6]),
            remote: &ids(&[5, 6]),
            lend: kvpoll::Incarnation::NONE,
        }],
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    peer.child.kill().unwrap();
    peer.child.wait().unwrap();
    let mut out = Outcomes::default();
    wait_one_read_failed_peer_lost(&mut d, &mut out);

    // The dead peer's state is gone: reads to it are setup failures now.
    out.clear();
    unguarded_read(&mut d, p, RequestId(3), &ids(&[5]), &ids(&[5]));
    wait_report(&mut d, &mut out);
    assert_eq!(out.failed_recving[0].reason.cause, Cause::Setup);

    // A restarted peer is added again with its fresh metadata.
    let again = spawn(5);
    let p2 = d.add_peer(&again.metadata).unwrap();
    read_and_verify(&mut d, p2, 4, 5);
}

/// Over shared memory a read of a peer's own memory (registered, not
/// UCX-allocated) is the reader's `process_vm_readv` where UCX gives `cma`
/// a lane beside peer error handling; the peer's death is still noticed:
/// a read after it fails `PeerLost`, the peer is reported lost once, and
/// the reading process lives on to read a restarted peer.
#[test]
fn over_shared_memory_a_killed_peer_whose_own_memory_was_read_is_reported_lost() {
    let (mut d, p) = read_then_kill_the_peer(7, SHM, "caller");
    let mut out = Outcomes::default();
    wait_one_read_failed_peer_lost(&mut d, &mut out);
    wait_peer_lost(&mut d, &mut out);
    assert_eq!(out.peers_lost.len(), 1, "{out:?}");
    assert_eq!(out.peers_lost[0].0, p);

    let again = spawn_over(8, SHM, "caller");
    let p2 = d.add_peer(&again.metadata).unwrap();
    read_and_verify(&mut d, p2, 4, 8);
}

/// A peer whose process dies is reported to the engine once, in
/// `Outcomes::peers_lost`, with the endpoint's status.
#[test]
fn a_killed_peer_is_reported_in_peers_lost_with_its_status() {
    let (mut d, p) = read_then_kill_the_peer(6, "tcp", "ucx");
    let mut out = Outcomes::default();
    wait_peer_lost(&mut d, &mut out);
    assert_eq!(out.peers_lost.len(), 1, "{out:?}");
    let (lost, reason) = out.peers_lost[0];
    assert_eq!(lost, p);
    assert_eq!(reason.cause, Cause::PeerLost);
    assert!(reason.status.code() < 0, "no endpoint status: {reason:?}");
    // Once: later polls do not report it again.
    std::thread::sleep(Duration::from_millis(100));
    out.clear();
    d.poll(&mut out);
    assert!(out.peers_lost.is_empty(), "{out:?}");
}
