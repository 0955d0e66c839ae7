//! Two UCX workers in one process, over tcp and over shared memory: real
//! one-sided transfers, verified byte for byte.

mod ucx_common;

use std::time::Duration;

use kvpoll::transport::ucx::{
    BlockOp, Endpoint, MemoryRegion, PackedRkey, RemoteKey, UcxError, UcxStatus, WorkerAddress,
};
use ucx_common::{pattern_bytes, wait_completions, worker};

const BLOCKS: u64 = 64;
const BLOCK: u64 = 16 * 1024;
const LIMIT: Duration = Duration::from_secs(60);
/// Shared memory only: if these transports cannot carry the endpoint (for
/// example because peer error mode excluded them), the transfer fails.
const SHM: &str = "posix,sysv,cma";

fn ops(blocks: u64) -> Vec<BlockOp> {
    // Reverse the remote order so a mix-up of offsets cannot pass.
    (0..blocks)
        .map(|b| BlockOp {
            local_offset: b * BLOCK,
            remote_offset: (blocks - 1 - b) * BLOCK,
            len: BLOCK as usize,
            token: 1000 + b,
        })
        .collect()
}

fn expected_after_reversal(src: &[u8], blocks: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(src.len());
    for b in 0..blocks {
        let r = (blocks - 1 - b) * BLOCK;
        v.extend_from_slice(&src[r as usize..(r + BLOCK) as usize]);
    }
    v
}

fn get_64_blocks_verified(tls: &str) {
    let (ctx_a, a) = worker(tls);
    let (ctx_b, b) = worker(tls);
    let src = pattern_bytes(7, BLOCKS, BLOCK);
    let remote = MemoryRegion::allocate(&ctx_b, src.len()).unwrap();
    remote.write(0, &src).unwrap();
    let local = MemoryRegion::allocate(&ctx_a, src.len()).unwrap();
    local.write(0, &vec![0u8; src.len()]).unwrap();

    let addr = WorkerAddress::from_bytes(b.address().unwrap().as_bytes()).unwrap();
    let ep = Endpoint::connect(&a, &addr, 1).unwrap();
    let packed = PackedRkey::from_bytes(remote.pack_rkey().unwrap().as_bytes()).unwrap();
    let rkey = RemoteKey::unpack(&ep, &packed).unwrap();

    ep.get_batch(&local, &rkey, &ops(BLOCKS)).unwrap();
    let done = wait_completions(&[&a, &b], BLOCKS as usize, LIMIT);
    let mut tokens: Vec<u64> = done.iter().map(|c| c.token).collect();
    tokens.sort_unstable();
    assert_eq!(tokens, (1000..1000 + BLOCKS).collect::<Vec<_>>());
    assert!(done.iter().all(|c| c.status.is_ok()), "{done:?}");

    let mut got = vec![0u8; src.len()];
    local.read(0, &mut got).unwrap();
    assert!(got == expected_after_reversal(&src, BLOCKS), "bytes differ");
}

fn put_then_flush_verified(tls: &str) {
    let (ctx_a, a) = worker(tls);
    let (ctx_b, b) = worker(tls);
    let src = pattern_bytes(11, BLOCKS, BLOCK);
    let local = MemoryRegion::allocate(&ctx_a, src.len()).unwrap();
    local.write(0, &src).unwrap();
    let remote = MemoryRegion::allocate(&ctx_b, src.len()).unwrap();
    remote.write(0, &vec![0u8; src.len()]).unwrap();

    let ep = Endpoint::connect(&a, &b.address().unwrap(), 1).unwrap();
    let rkey = RemoteKey::unpack(&ep, &remote.pack_rkey().unwrap()).unwrap();
    ep.put_batch(&local, &rkey, &ops(BLOCKS)).unwrap();
    ep.flush(1).unwrap();
    let done = wait_completions(&[&a, &b], BLOCKS as usize + 1, LIMIT);
    assert!(done.iter().all(|c| c.status.is_ok()), "{done:?}");
    assert!(
        done.iter().any(|c| c.token == 1),
        "flush completion missing"
    );

    // The flush completed, so every put is visible at the target.
    let mut got = vec![0u8; src.len()];
    remote.read(0, &mut got).unwrap();
    // put local block b -> remote block (63 - b): reversal is its own inverse.
    assert!(got == expected_after_reversal(&src, BLOCKS), "bytes differ");
}

#[test]
fn get_64_blocks_of_16k_over_tcp_match_byte_for_byte() {
    get_64_blocks_verified("tcp");
}

#[test]
fn get_64_blocks_of_16k_over_shared_memory_match_byte_for_byte() {
    get_64_blocks_verified(SHM);
}

#[test]
fn put_then_flush_over_tcp_lands_every_byte() {
    put_then_flush_verified("tcp");
}

#[test]
fn put_then_flush_over_shared_memory_lands_every_byte() {
    put_then_flush_verified(SHM);
}

#[test]
fn forced_close_completes_every_outstanding_get_with_canceled() {
    let (ctx_a, a) = worker("tcp");
    let (ctx_b, b) = worker("tcp");
    let remote = MemoryRegion::allocate(&ctx_b, (BLOCKS * BLOCK) as usize).unwrap();
    let local = MemoryRegion::allocate(&ctx_a, (BLOCKS * BLOCK) as usize).unwrap();
    let ep = Endpoint::connect(&a, &b.address().unwrap(), 1).unwrap();
    let rkey = RemoteKey::unpack(&ep, &remote.pack_rkey().unwrap()).unwrap();

    // Over tcp a get needs the target's worker to answer; `b` is never
    // progressed, so every get stays outstanding.
    ep.get_batch(&local, &rkey, &ops(BLOCKS)).unwrap();
    for _ in 0..1000 {
        a.progress();
    }
    let mut early = Vec::new();
    a.take_completions(&mut early);
    assert!(
        early.is_empty(),
        "gets completed without the target: {early:?}"
    );

    ep.force_close(9999).unwrap();
    let done = wait_completions(&[&a], BLOCKS as usize + 1, LIMIT);
    let gets: Vec<_> = done.iter().filter(|c| c.token != 9999).collect();
    assert_eq!(gets.len(), BLOCKS as usize);
    assert!(
        gets.iter().all(|c| c.status == UcxStatus::CANCELED),
        "{gets:?}"
    );
    assert!(
        done.iter().any(|c| c.token == 9999),
        "close never completed"
    );

    // Nothing more can be posted on a closed endpoint.
    let err = ep.get_batch(&local, &rkey, &ops(1)).unwrap_err();
    assert_eq!(err.posted, 0);
    assert!(matches!(err.error, UcxError::EndpointClosed(_)));
    drop(b);
}

#[test]
fn active_message_round_trip_carries_payloads_both_ways() {
    let (_ca, a) = worker("tcp");
    let (_cb, b) = worker("tcp");
    a.listen_active_messages(7).unwrap();
    b.listen_active_messages(7).unwrap();
    let a_to_b = Endpoint::connect(&a, &b.address().unwrap(), 1).unwrap();
    let b_to_a = Endpoint::connect(&b, &a.address().unwrap(), 2).unwrap();

    a_to_b.send_active_message(7, b"ping 42", 1).unwrap();
    let mut got = Vec::new();
    for _ in 0..1_000_000 {
        a.progress();
        b.progress();
        b.take_active_messages(|m| got.push((m.id, m.payload.to_vec())));
        if !got.is_empty() {
            break;
        }
    }
    assert_eq!(got, vec![(7u16, b"ping 42".to_vec())]);

    b_to_a.send_active_message(7, b"pong 42", 2).unwrap();
    let mut back = Vec::new();
    for _ in 0..1_000_000 {
        a.progress();
        b.progress();
        a.take_active_messages(|m| back.push((m.id, m.payload.to_vec())));
        if !back.is_empty() {
            break;
        }
    }
    assert_eq!(back, vec![(7u16, b"pong 42".to_vec())]);
    // Both sends completed successfully.
    let sent_a = wait_completions(&[&a, &b], 1, LIMIT);
    assert_eq!(sent_a[0].token, 1);
    assert!(sent_a[0].status.is_ok());
}

#[test]
fn garbage_worker_address_and_rkey_give_typed_errors() {
    let (ctx, w) = worker("tcp");
    let garbage: Vec<u8> = (0..200u32).map(|i| (i * 37 + 11) as u8).collect();
    assert!(matches!(
        WorkerAddress::from_bytes(&garbage),
        Err(UcxError::BadWorkerAddress(_))
    ));
    assert!(matches!(
        PackedRkey::from_bytes(&garbage),
        Err(UcxError::BadRemoteKey(_))
    ));

    // A real address with one byte damaged, and one cut short.
    let good = w.address().unwrap();
    let mut damaged = good.as_bytes().to_vec();
    let mid = damaged.len() / 2;
    damaged[mid] ^= 0xff;
    assert!(matches!(
        WorkerAddress::from_bytes(&damaged),
        Err(UcxError::BadWorkerAddress(_))
    ));
    let cut = &good.as_bytes()[..good.as_bytes().len() - 3];
    assert!(matches!(
        WorkerAddress::from_bytes(cut),
        Err(UcxError::BadWorkerAddress(_))
    ));

    // A worker address offered as an rkey is refused by kind.
    assert!(matches!(
        PackedRkey::from_bytes(good.as_bytes()),
        Err(UcxError::BadRemoteKey(_))
    ));

    // A remote range outside the peer's region is refused before posting.
    let region = MemoryRegion::allocate(&ctx, 4096).unwrap();
    let ep = Endpoint::connect(&w, &good, 1).unwrap();
    let rkey = RemoteKey::unpack(&ep, &region.pack_rkey().unwrap()).unwrap();
    let err = ep
        .get_batch(
            &region,
            &rkey,
            &[BlockOp {
                local_offset: 0,
                remote_offset: 4000,
                len: 200,
                token: 1,
            }],
        )
        .unwrap_err();
    assert_eq!(err.posted, 0);
    assert!(matches!(err.error, UcxError::OutOfRange { .. }));
    let mut none = Vec::new();
    w.progress();
    w.take_completions(&mut none);
    assert!(none.is_empty());
}

#[test]
fn get_into_user_mapped_memory_over_tcp_matches_byte_for_byte() {
    let (ctx_a, a) = worker("tcp");
    let (ctx_b, b) = worker("tcp");
    let src = pattern_bytes(13, 8, BLOCK);
    let remote = MemoryRegion::allocate(&ctx_b, src.len()).unwrap();
    remote.write(0, &src).unwrap();
    let mut user = vec![0u8; src.len()];
    // SAFETY: `user` outlives `local` (dropped at the end of this function,
    // after `local`) and is not moved or resized meanwhile.
    let local = unsafe { MemoryRegion::map(&ctx_a, user.as_mut_ptr(), user.len()) }.unwrap();
    let ep = Endpoint::connect(&a, &b.address().unwrap(), 1).unwrap();
    let rkey = RemoteKey::unpack(&ep, &remote.pack_rkey().unwrap()).unwrap();
    ep.get_batch(&local, &rkey, &ops(8)).unwrap();
    let done = wait_completions(&[&a, &b], 8, LIMIT);
    assert!(done.iter().all(|c| c.status.is_ok()), "{done:?}");
    drop(rkey);
    drop(ep);
    drop(local);
    assert!(user == expected_after_reversal(&src, 8), "bytes differ");
}

/// Over shared memory, a get from memory the caller registered (not
/// UCX-allocated) is one-sided through `cma` beside peer error handling:
/// it completes, byte for byte, while its target's worker is never
/// progressed. Before UCX 1.20 peer error mode gives `cma` no lane and
/// such a get waits for the target's progress (docs/design.md §4).
#[test]
#[cfg_attr(
    not(ucx_cma_with_peer_errors),
    ignore = "UCX before 1.20 gives cma no lane in peer error mode: the get needs its target's progress"
)]
fn a_get_from_caller_memory_over_shared_memory_completes_without_its_targets_progress() {
    let (ctx_a, a) = worker(SHM);
    let (ctx_b, b) = worker(SHM);
    let src = pattern_bytes(17, BLOCKS, BLOCK);
    let mut theirs = src.clone();
    let mut ours = vec![0u8; src.len()];
    // SAFETY: both vectors outlive their regions (dropped below, before
    // them) and are not moved or resized meanwhile.
    let (remote, local) = unsafe {
        (
            MemoryRegion::map(&ctx_b, theirs.as_mut_ptr(), theirs.len()).unwrap(),
            MemoryRegion::map(&ctx_a, ours.as_mut_ptr(), ours.len()).unwrap(),
        )
    };
    let ep = Endpoint::connect(&a, &b.address().unwrap(), 1).unwrap();
    let rkey = RemoteKey::unpack(&ep, &remote.pack_rkey().unwrap()).unwrap();
    ep.get_batch(&local, &rkey, &ops(BLOCKS)).unwrap();
    // Only the reader progresses.
    let (start, mut done) = (std::time::Instant::now(), Vec::new());
    while done.len() < BLOCKS as usize && start.elapsed() < Duration::from_secs(10) {
        a.progress();
        a.take_completions(&mut done);
    }
    assert_eq!(
        done.len(),
        BLOCKS as usize,
        "gets done in 10 s with their target not progressing: not one-sided"
    );
    assert!(done.iter().all(|c| c.status.is_ok()), "{done:?}");
    drop(rkey);
    drop(ep);
    drop((local, remote));
    assert!(
        ours == expected_after_reversal(&src, BLOCKS),
        "bytes differ"
    );
    drop(theirs);
}
