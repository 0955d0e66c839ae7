//! A peer's UCX bytes — its worker address and packed rkeys — damaged inside
//! well-framed metadata (the checksums recomputed, as a hostile peer would):
//! refused with a typed error before UCX sees them, the engine untouched,
//! and never an abort inside UCX.

mod ucx_common;

use std::process::Command;
use std::time::{Duration, Instant};

use kvpoll::engine::{Engine, IdlePolicy, Outcomes, PeerError, Transfer};
use kvpoll::ledger::{BlockId, PeerId, RequestId};
use kvpoll::metadata::{MetadataError, PeerMetadata};
use kvpoll::transport::ucx::{
    Context, ContextOptions, Endpoint, MemoryRegion, PackedRkey, RemoteKey, UcxError, Worker,
    WorkerAddress, SOFT_PIECE_AM_ID, SOFT_REQUEST_AM_ID,
};
use kvpoll::wire::{self, Kind};

use ucx_common::pattern;

const BS: u64 = 4096;
const BLOCKS: u64 = 16;
const GUARD: Duration = Duration::from_secs(60);
/// The child-process test runs only where this is set.
const CHILD: &str = "KVPOLL_PEER_BYTES_CHILD";

fn engine() -> Engine {
    engine_over("tcp", false)
}

/// An engine over `tls` with one UCX-allocated region of [`BLOCKS`]
/// blocks of the tests' pattern.
fn engine_over(tls: &str, confirm: bool) -> Engine {
    let mut e = Engine::builder()
        .block_size(BS)
        .ucx(ContextOptions::with_transports(tls))
        .idle(IdlePolicy::Adaptive)
        .confirm_reads(confirm)
        .build()
        .expect("engine");
    e.register(BLOCKS).unwrap();
    let mut buf = vec![0u8; BS as usize];
    for b in 0..BLOCKS {
        pattern::fill(9, b, &mut buf);
        e.write_block(0, BlockId(b as u32), &buf).unwrap();
    }
    e
}

/// Peer metadata rebuilt with `addr` applied to the raw UCX worker address
/// and `rkey` to each region's raw UCX rkey (after kvpoll's 16-byte bounds),
/// every frame resealed: only the UCX bytes are wrong.
fn rewrite(meta: &[u8], addr: impl Fn(&mut [u8]), rkey: impl Fn(&mut [u8])) -> Vec<u8> {
    let p = wire::decode(meta, Kind::PeerMetadata).unwrap();
    let mut out = p[..16].to_vec();
    let mut at = 16;
    let frame = |at: &mut usize, kind: Kind, skip: usize, edit: &dyn Fn(&mut [u8])| {
        let len = u32::from_le_bytes(p[*at..*at + 4].try_into().unwrap()) as usize;
        let mut inner = wire::decode(&p[*at + 4..*at + 4 + len], kind)
            .unwrap()
            .to_vec();
        let mut raw = inner.split_off(skip);
        edit(&mut raw);
        inner.extend_from_slice(&raw);
        let framed = wire::encode(kind, &inner);
        *at += 4 + len;
        framed
    };
    let a = frame(&mut at, Kind::WorkerAddress, 0, &addr);
    out.extend_from_slice(&(a.len() as u32).to_le_bytes());
    out.extend_from_slice(&a);
    let count = u16::from_le_bytes([p[at], p[at + 1]]);
    out.extend_from_slice(&p[at..at + 2]);
    at += 2;
    for _ in 0..count {
        out.extend_from_slice(&p[at..at + 12]);
        at += 12;
        let k = frame(&mut at, Kind::RemoteKey, 16, &rkey);
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&k);
    }
    wire::encode(Kind::PeerMetadata, &out)
}

/// Reads `remote` blocks of `peer` into `local` ones of `d` and polls until
/// the read is reported.
fn read(d: &mut Engine, peer: PeerId, id: u64, local: &[BlockId], remote: &[BlockId]) -> Outcomes {
    read_lent(d, peer, id, local, remote, kvpoll::Incarnation::NONE)
}

/// [`read`] of the lend `lend`.
fn read_lent(
    d: &mut Engine,
    peer: PeerId,
    id: u64,
    local: &[BlockId],
    remote: &[BlockId],
    lend: kvpoll::Incarnation,
) -> Outcomes {
    let handle = Transfer {
        peer,
        local,
        remote,
        lend,
    };
    if let Err(e) = d.read(RequestId(id), &[handle]) {
        panic!("read {id} refused: {e}");
    }
    until(d, "read", |o| {
        !o.finished_recving.is_empty() || !o.failed_recving.is_empty()
    })
}

/// Polls `e` until `ended` says its outcomes hold the end of its `what`.
fn until(e: &mut Engine, what: &str, ended: impl Fn(&Outcomes) -> bool) -> Outcomes {
    let mut out = Outcomes::default();
    let t = Instant::now();
    while !ended(&out) {
        e.poll(&mut out);
        assert!(t.elapsed() < GUARD, "the {what} hung: {out:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
    out
}

/// Reads blocks 0..4 of `peer` into `d`'s blocks 8..12 and checks them.
fn read_and_check(d: &mut Engine, peer: PeerId, id: u64) {
    let (local, remote) = (ids(8..12), ids(0..4));
    let out = read(d, peer, id, &local, &remote);
    assert_eq!(out.finished_recving, vec![RequestId(id)], "{out:?}");
    let mut buf = vec![0u8; BS as usize];
    for (l, r) in local.iter().zip(&remote) {
        d.read_block(0, *l, &mut buf).unwrap();
        assert!(pattern::check(9, u64::from(r.0), &buf), "block {}", l.0);
    }
}

fn ids(r: std::ops::Range<u32>) -> Vec<BlockId> {
    r.map(BlockId).collect()
}

/// The low nibble of a UCX worker address's first byte is its format
/// version (1 or 2); anything else trips UCX's assertion.
fn bad_version(a: &mut [u8]) {
    a[0] = (a[0] & 0xf0) | 0x0f;
}

#[test]
fn a_worker_address_of_an_unknown_version_is_refused_and_the_engine_still_reads() {
    let (mut d, p) = (engine(), engine());
    let bad = rewrite(&p.local_metadata().unwrap(), bad_version, |_| {});
    match d.add_peer(&bad) {
        Err(PeerError::Metadata(MetadataError::Address(e))) => {
            assert!(e.to_string().contains("version 15"), "{e}")
        }
        other => panic!("damaged address accepted or refused for another reason: {other:?}"),
    }
    let peer = d.add_peer(&p.local_metadata().unwrap()).unwrap();
    read_and_check(&mut d, peer, 1);
}

#[test]
fn a_remote_key_of_an_unknown_memory_type_is_refused() {
    let (mut d, p) = (engine(), engine());
    let meta = p.local_metadata().unwrap();
    // Bytes 0..8: the map of memory domains the key has parts for (an
    // empty one is UCX's own key for memory no domain registered); byte 8:
    // the memory type.
    for (edit, what) in [(
        &(|k: &mut [u8]| k[8] = 0xee) as &dyn Fn(&mut [u8]),
        "memory type 238",
    )] {
        match d.add_peer(&rewrite(&meta, |_| {}, edit)) {
            Err(PeerError::Metadata(MetadataError::RemoteKey { region: 0, error })) => {
                assert!(error.to_string().contains(what), "{error}")
            }
            other => panic!("damaged rkey ({what}) accepted or refused otherwise: {other:?}"),
        }
    }
    let peer = d.add_peer(&meta).unwrap();
    read_and_check(&mut d, peer, 2);
}

/// Run by the next test in a child process: add the damaged peer, read
/// from it if it was accepted, then read from the real one.
#[test]
fn child_reads_after_adding_a_peer_with_a_damaged_address() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let (mut d, p) = (engine(), engine());
    match d.add_peer(&rewrite(&p.local_metadata().unwrap(), bad_version, |_| {})) {
        Ok(peer) => {
            // What the unchecked code did: this read reaches ucp_ep_create.
            let out = read(&mut d, peer, 3, &ids(0..1), &ids(0..1));
            println!("accepted; the read ended: {out:?}");
        }
        Err(e) => println!("refused: {e}"),
    }
    let peer = d.add_peer(&p.local_metadata().unwrap()).unwrap();
    read_and_check(&mut d, peer, 4);
    println!("child done");
}

/// Runs the test `name` of this binary in a child process with `var` set
/// to `value`; returns its standard output once it has exited cleanly
/// (a child killed by a signal, or failing, fails the caller).
fn run_child(name: &str, var: &str, value: &str) -> String {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(var, value)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{name} ({var}={value}): the child died ({:?}):\n{stdout}\n{stderr}",
        out.status
    );
    stdout
}

#[test]
fn a_damaged_worker_address_does_not_abort_the_process_that_reads() {
    let stdout = run_child(
        "child_reads_after_adding_a_peer_with_a_damaged_address",
        CHILD,
        "1",
    );
    assert!(stdout.contains("refused: "), "{stdout}");
    assert!(stdout.contains("child done"), "{stdout}");
}

/// Every byte of `raw` changed three ways (low bit, high bit, all bits).
fn single_byte_flips(raw: &[u8]) -> impl Iterator<Item = (usize, Vec<u8>)> + '_ {
    (0..raw.len()).flat_map(move |i| {
        [0x01u8, 0x80, 0xff].into_iter().map(move |x| {
            let mut b = raw.to_vec();
            b[i] ^= x;
            (i, b)
        })
    })
}

/// Runs `f` on a thread of its own in a network namespace of its own with
/// only loopback up, or returns `None` where this process may not make one
/// (it needs CAP_SYS_ADMIN). A thread's sockets, and those of the UCX
/// threads it starts, live in its namespace: a flipped tcp address then
/// names an address nothing outside can be asked to connect to.
fn in_private_network<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    std::thread::spawn(move || {
        // SAFETY: plain system calls on this thread's own namespace and a
        // socket it closes; `req` is an `ifreq` (name, then flags).
        unsafe {
            if libc::unshare(libc::CLONE_NEWNET) != 0 {
                return None;
            }
            let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0);
            assert!(fd >= 0, "a socket in the new namespace");
            let mut req = [0u8; 40];
            req[..2].copy_from_slice(b"lo");
            const SIOCGIFFLAGS: libc::c_ulong = 0x8913;
            const SIOCSIFFLAGS: libc::c_ulong = 0x8914;
            assert_eq!(libc::ioctl(fd, SIOCGIFFLAGS, req.as_mut_ptr()), 0);
            let flags = i16::from_ne_bytes([req[16], req[17]]) | libc::IFF_UP as i16;
            req[16..18].copy_from_slice(&flags.to_ne_bytes());
            assert_eq!(
                libc::ioctl(fd, SIOCSIFFLAGS, req.as_mut_ptr()),
                0,
                "loopback up"
            );
            libc::close(fd);
        }
        Some(f())
    })
    .join()
    .unwrap()
}

/// Over tcp a flip can turn the address's IP into any address at all,
/// which UCX then connects to: the tcp cases run in a network namespace
/// of their own, where only loopback exists (left out, and said so, where
/// the process may not make one).
#[test]
fn any_single_byte_flip_of_a_real_worker_address_is_refused_or_connects_without_aborting() {
    flips_of_worker_addresses("posix,sysv,cma");
    if in_private_network(|| flips_of_worker_addresses("tcp")).is_none() {
        println!("tcp left out: no network namespace of its own (needs CAP_SYS_ADMIN)");
    }
}

fn flips_of_worker_addresses(tls: &'static str) {
    for version in ["v1", "v2"] {
        let options = ContextOptions::with_transports(tls).option("ADDRESS_VERSION", version);
        let (ca, cb) = (
            Context::new(&options).unwrap(),
            Context::new(&options).unwrap(),
        );
        let (a, b) = (Worker::new(&ca).unwrap(), Worker::new(&cb).unwrap());
        let framed = b.address().unwrap();
        let raw = wire::decode(framed.as_bytes(), Kind::WorkerAddress).unwrap();
        let (mut refused, mut connected) = (0, 0);
        for (_, bytes) in single_byte_flips(raw) {
            let Ok(addr) = WorkerAddress::from_bytes(&wire::encode(Kind::WorkerAddress, &bytes))
            else {
                refused += 1;
                continue;
            };
            // Accepted: UCX must take it without an abort, whatever it says.
            if let Ok(ep) = Endpoint::connect(&a, &addr, 1) {
                connected += 1;
                let _ = ep.force_close(7);
            }
            a.progress();
        }
        assert!(refused > 0, "{tls} {version}: nothing refused");
        println!(
            "{tls} {version}: {} bytes, {refused} flips refused, {connected} connected",
            raw.len()
        );
    }
}

#[test]
fn any_single_byte_flip_of_a_real_remote_key_is_refused_or_unpacks_without_aborting() {
    for tls in ["tcp", "posix,sysv,cma"] {
        let (_ca, a) = ucx_common::worker(tls);
        let (cb, b) = ucx_common::worker(tls);
        let region = MemoryRegion::allocate(&cb, 64 * 1024).unwrap();
        let packed = region.pack_rkey().unwrap();
        let payload = wire::decode(packed.as_bytes(), Kind::RemoteKey).unwrap();
        let ep = Endpoint::connect(&a, &b.address().unwrap(), 1).unwrap();
        let (mut refused, mut unpacked) = (0, 0);
        for (_, raw) in single_byte_flips(&payload[16..]) {
            let mut p = payload[..16].to_vec();
            p.extend_from_slice(&raw);
            match PackedRkey::from_bytes(&wire::encode(Kind::RemoteKey, &p)) {
                Err(UcxError::RemoteKeyLayout(_)) => refused += 1,
                Err(e) => panic!("refused for another reason: {e}"),
                Ok(k) => {
                    if RemoteKey::unpack(&ep, &k).is_ok() {
                        unpacked += 1;
                    }
                }
            }
        }
        assert!(refused > 0, "{tls}: nothing refused");
        println!(
            "{tls}: {} bytes, {refused} flips refused, {unpacked} unpacked",
            payload.len() - 16
        );
    }
}

/// A soft read request as a reader sends it (`src/transport/ucx/soft.rs`):
/// slot, sequence, region, 4 bytes of padding, offset, length, the lend it
/// names (here one nobody lent: served from the regions, and left to the
/// read's confirmation).
fn soft_request(region: u32, offset: u64, len: u64) -> Vec<u8> {
    let mut b = Vec::with_capacity(40);
    b.extend_from_slice(&1u32.to_le_bytes());
    b.extend_from_slice(&1u32.to_le_bytes());
    b.extend_from_slice(&region.to_le_bytes());
    b.extend_from_slice(&[0; 4]);
    b.extend_from_slice(&offset.to_le_bytes());
    b.extend_from_slice(&len.to_le_bytes());
    b.extend_from_slice(&0x5eed_u64.to_le_bytes());
    b
}

#[test]
fn soft_read_requests_a_peer_forges_are_answered_or_refused_and_the_lender_still_serves() {
    let (mut d, p) = (engine(), engine());
    let meta = PeerMetadata::decode(&p.local_metadata().unwrap()).unwrap();
    let ctx = Context::new(&ContextOptions::with_transports("tcp")).unwrap();
    let w = Worker::new(&ctx).unwrap();
    let ep = Endpoint::connect(&w, &meta.worker, 7).unwrap();
    let region = BS * BLOCKS;
    let answered = [
        soft_request(9, 0, 8),          // no such region
        soft_request(0, region - 4, 8), // past its end
        soft_request(0, u64::MAX, 2),   // an offset that wraps
        soft_request(0, 0, 0),          // nothing
        soft_request(0, BS, BS),        // a real block: its bytes
    ];
    let short = &soft_request(0, 0, 8)[..39]; // no request at all
    ep.send_active_message_with_reply(SOFT_REQUEST_AM_ID, short, 1)
        .unwrap();
    for (i, r) in answered.iter().enumerate() {
        ep.send_active_message_with_reply(SOFT_REQUEST_AM_ID, r, 2 + i as u64)
            .unwrap();
    }
    // Each answer (a refusal, or the bytes) is a message with a header,
    // which a plain listener counts as foreign and drops.
    w.listen_active_messages(SOFT_PIECE_AM_ID).unwrap();
    let t = Instant::now();
    while w.rejected_active_messages() < answered.len() as u64 {
        w.progress();
        assert!(
            t.elapsed() < GUARD,
            "the lender did not answer every request"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    for _ in 0..200 {
        w.progress();
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(w.rejected_active_messages(), answered.len() as u64);
    let peer = d.add_peer(&p.local_metadata().unwrap()).unwrap();
    read_and_check(&mut d, peer, 1);
    drop(ep);
}

/// Peer metadata whose regions claim `blocks` blocks each (their bounds'
/// length to match) and, where `words` is given, whose lend words claim
/// that many bytes: the UCX bytes untouched, every frame resealed, as a
/// hostile peer on the same host would send them.
fn rewrite_lengths(meta: &[u8], blocks: u64, words: Option<u64>) -> Vec<u8> {
    let p = wire::decode(meta, Kind::PeerMetadata).unwrap();
    let block_size = u64::from_le_bytes(p[8..16].try_into().unwrap());
    let u32_at = |at: usize| u32::from_le_bytes(p[at..at + 4].try_into().unwrap()) as usize;
    // A framed rkey at `at` with the length in its bounds replaced.
    let key = |at: usize, len: u64| {
        let framed = &p[at + 4..at + 4 + u32_at(at)];
        let mut payload = wire::decode(framed, Kind::RemoteKey).unwrap().to_vec();
        payload[8..16].copy_from_slice(&len.to_le_bytes());
        let k = wire::encode(Kind::RemoteKey, &payload);
        let mut out = (k.len() as u32).to_le_bytes().to_vec();
        out.extend_from_slice(&k);
        out
    };
    let mut at = 16 + 4 + u32_at(16);
    let mut out = p[..at + 2].to_vec();
    let count = u16::from_le_bytes([p[at], p[at + 1]]);
    at += 2;
    for _ in 0..count {
        out.extend_from_slice(&p[at..at + 4]);
        out.extend_from_slice(&blocks.to_le_bytes());
        out.extend_from_slice(&key(at + 12, blocks * block_size));
        at += 12 + 4 + u32_at(at + 12);
    }
    match (u32_at(at), words) {
        (0, _) | (_, None) => out.extend_from_slice(&p[at..]),
        (n, Some(len)) => {
            out.extend_from_slice(&key(at, len));
            out.extend_from_slice(&p[at + 4 + n..]);
        }
    }
    wire::encode(Kind::PeerMetadata, &out)
}

/// An engine over shared memory with its own (UCX-allocated) regions:
/// on UCX 1.13 a reader maps them, on every UCX it maps the lend words.
fn shm_engine(confirm: bool) -> Engine {
    engine_over("posix,sysv,cma", confirm)
}

/// Blocks a forged region claims: 1 TiB of them, far past any segment.
const CLAIMED: u64 = (1 << 40) / BS;
/// The child-process test below runs only where this is set.
const LENGTHS_CHILD: &str = "KVPOLL_PEER_LENGTHS_CHILD";

/// Run by the next test in a child process, for the case the variable
/// [`LENGTHS_CHILD`] names: `region`, a read of the last block a forged
/// region claims; `words`, a confirmed read whose lend word the forged
/// words put past their segment; `write`, a write to the last block a
/// forged region claims. Each from a peer whose metadata claims more than
/// it packed; then a read from an honest peer. Prints how the case ended.
#[test]
fn child_moves_blocks_past_what_a_peer_packed() {
    let Some(case) = std::env::var_os(LENGTHS_CHILD) else {
        return;
    };
    let last = BlockId((CLAIMED - 1) as u32);
    // How a transfer ended: its first failure, or none.
    let verdict = |failed: Option<kvpoll::Reason>| match failed {
        Some(reason) => format!("failed: {reason:?}"),
        None => "finished".to_string(),
    };
    let ended = match case.to_str().unwrap() {
        "region" => {
            let (mut d, p) = (shm_engine(false), shm_engine(false));
            let forged = rewrite_lengths(&p.local_metadata().unwrap(), CLAIMED, None);
            match d.add_peer(&forged) {
                Err(e) => format!("refused: {e}"),
                Ok(peer) => {
                    let out = read(&mut d, peer, 1, &ids(0..1), &[last]);
                    verdict(out.failed_recving.first().map(|f| f.reason))
                }
            }
        }
        "words" => {
            let (mut d, mut p) = (shm_engine(true), shm_engine(true));
            let count = kvpoll::transport::MAX_LEND_WORDS;
            let inc = (1u64..)
                .map(kvpoll::Incarnation)
                .find(|&i| kvpoll::transport::lend_word_of(i, count) == Some(count - 1))
                .unwrap();
            p.lend_with(RequestId(2), &ids(0..1), 1, GUARD, inc)
                .unwrap();
            let forged =
                rewrite_lengths(&p.local_metadata().unwrap(), BLOCKS, Some(count as u64 * 8));
            match d.add_peer(&forged) {
                Err(e) => format!("refused: {e}"),
                Ok(peer) => {
                    let out = read_lent(&mut d, peer, 2, &ids(0..1), &ids(0..1), inc);
                    verdict(out.failed_recving.first().map(|f| f.reason))
                }
            }
        }
        "write" => {
            let (mut w, mut dest) = (shm_engine(false), shm_engine(false));
            let lease = Duration::from_secs(5);
            let target = dest.receive(RequestId(3), &ids(0..1), 1, lease).unwrap();
            let forged = rewrite_lengths(&dest.local_metadata().unwrap(), CLAIMED, None);
            match w.add_peer(&forged) {
                Err(e) => format!("refused: {e}"),
                Ok(peer) => {
                    let handle = Transfer {
                        peer,
                        local: &ids(0..1),
                        remote: &[last],
                        lend: target,
                    };
                    w.write(RequestId(3), &[handle], 1, lease).unwrap();
                    let out = until(&mut w, "write", |o| {
                        !o.finished_sending.is_empty() || !o.failed_sending.is_empty()
                    });
                    verdict(out.failed_sending.first().map(|f| f.reason))
                }
            }
        }
        other => panic!("no case {other}"),
    };
    println!("case ended: {ended}");
    let (mut d, p) = (shm_engine(false), shm_engine(false));
    let peer = d.add_peer(&p.local_metadata().unwrap()).unwrap();
    read_and_check(&mut d, peer, 4);
    println!("child done");
}

/// A peer on the same host whose metadata claims regions (or lend words)
/// longer than the shared-memory segments it packed cannot make a reader
/// or a writer touch memory past those segments: each such read or write
/// is refused or fails, none finishes, and the process lives on to read
/// from an honest peer. (Each case in a child process of its own: before
/// the check, the first fault ended the process.)
#[test]
fn regions_a_peer_claims_past_its_segments_fail_their_transfers_without_aborting() {
    for case in ["region", "words", "write"] {
        let stdout = run_child(
            "child_moves_blocks_past_what_a_peer_packed",
            LENGTHS_CHILD,
            case,
        );
        let ended = stdout
            .split("case ended: ")
            .nth(1)
            .and_then(|s| s.lines().next())
            .unwrap_or_else(|| panic!("{case}: no end:\n{stdout}"));
        assert!(
            ended.starts_with("refused") || ended.starts_with("failed"),
            "{case}: {ended}"
        );
        assert!(stdout.contains("child done"), "{case}: {stdout}");
        println!("{case}: {ended}");
    }
}
