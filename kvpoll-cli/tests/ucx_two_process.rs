//! Two processes on loopback: this test process reads from a `kvpoll
//! ucx-peer` process over real UCX, and survives the peer being killed.

mod ucx_common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvpoll::transport::ucx::{
    BlockOp, Endpoint, MemoryRegion, PackedRkey, RemoteKey, WorkerAddress,
};
use kvpoll::wire::from_hex;
use ucx_common::wait_completions;

const BLOCK: u64 = 16 * 1024;
const LIMIT: Duration = Duration::from_secs(60);

struct Peer {
    child: Child,
    address: WorkerAddress,
    rkey: PackedRkey,
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn_peer(blocks: u64, seed: u64) -> Peer {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvpoll"))
        .args(["ucx-peer", "--tls", "tcp"])
        .args(["--blocks", &blocks.to_string()])
        .args(["--block-size", &BLOCK.to_string()])
        .args(["--seed", &seed.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn kvpoll ucx-peer");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .expect("read READY line");
    let parts: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(parts.first(), Some(&"READY"), "peer said {line:?}");
    let address = WorkerAddress::from_bytes(&from_hex(parts[1]).unwrap()).unwrap();
    let rkey = PackedRkey::from_bytes(&from_hex(parts[2]).unwrap()).unwrap();
    Peer {
        child,
        address,
        rkey,
    }
}

fn ops(first_token: u64, blocks: u64) -> Vec<BlockOp> {
    (0..blocks)
        .map(|b| BlockOp {
            local_offset: b * BLOCK,
            remote_offset: b * BLOCK,
            len: BLOCK as usize,
            token: first_token + b,
        })
        .collect()
}

#[test]
fn gets_from_a_peer_process_over_tcp_match_its_pattern() {
    let peer = spawn_peer(64, 5);
    let (ctx, w) = ucx_common::worker("tcp");
    let local = MemoryRegion::allocate(&ctx, (64 * BLOCK) as usize).unwrap();
    let ep = Endpoint::connect(&w, &peer.address, 1).unwrap();
    let rkey = RemoteKey::unpack(&ep, &peer.rkey).unwrap();
    ep.get_batch(&local, &rkey, &ops(0, 64)).unwrap();
    let done = wait_completions(&[&w], 64, LIMIT);
    assert!(done.iter().all(|c| c.status.is_ok()), "{done:?}");
    let mut block = vec![0u8; BLOCK as usize];
    for b in 0..64 {
        local.read(b * BLOCK, &mut block).unwrap();
        assert!(
            kvpoll_cli::pattern::check(5, b, &block),
            "block {b} differs"
        );
    }
}

#[test]
fn killed_peer_fails_every_inflight_get_with_an_error_never_a_hang() {
    let mut peer = spawn_peer(64, 9);
    let (ctx, w) = ucx_common::worker("tcp");
    let local = MemoryRegion::allocate(&ctx, (64 * BLOCK) as usize).unwrap();
    let ep = Endpoint::connect(&w, &peer.address, 77).unwrap();
    let rkey = RemoteKey::unpack(&ep, &peer.rkey).unwrap();

    // One successful get first, so the connection is up.
    ep.get_batch(&local, &rkey, &ops(0, 1)).unwrap();
    let first = wait_completions(&[&w], 1, LIMIT);
    assert!(first[0].status.is_ok());

    // Stop the peer so that nothing can complete, post, then kill it.
    let pid = peer.child.id() as libc::pid_t;
    // SAFETY: signalling our own child process.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    ep.get_batch(&local, &rkey, &ops(100, 64)).unwrap();
    let t = Instant::now();
    let mut early = Vec::new();
    while t.elapsed() < Duration::from_millis(200) {
        w.progress();
    }
    w.take_completions(&mut early);
    assert!(
        early.is_empty(),
        "gets completed from a stopped peer: {early:?}"
    );

    peer.child.kill().unwrap();
    peer.child.wait().unwrap();
    let done = wait_completions(&[&w], 64, LIMIT);
    assert!(
        done.iter().all(|c| !c.status.is_ok()),
        "a get from a killed peer reported success: {done:?}"
    );
    let mut failures = Vec::new();
    w.take_endpoint_failures(&mut failures);
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0].endpoint, 77);
    assert_eq!(ep.failure(), Some(failures[0].status));
}
