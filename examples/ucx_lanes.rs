//! Which lanes UCX gives an endpoint in peer error mode (as kvpoll creates
//! every endpoint) over shared memory, and which protocol a get then uses
//! into and out of memory the caller allocated and memory UCX allocated.
//! Two workers in one process (cma reaches its own process too).
//!
//! ```text
//! UCX_LOG_LEVEL=info UCX_PROTO_INFO=y cargo run --release --example ucx_lanes 2>&1 |
//!     grep -E 'ep_cfg|get|case'
//! ```
//!
//! Each case prints `case: <tls> <memory>`, then UCX prints the endpoint
//! configuration (`ep_cfg[..]: rma(...) am(...)`) and, on UCX releases
//! with protocol selection v2, the get protocols it chose. On UCX 1.20
//! and later kvpoll turns rendezvous off so that `cma` gets a lane
//! (`ContextOptions::cma_with_error_handling`); `UCX_RNDV_THRESH=auto` in
//! the environment shows UCX's own choice.

use std::time::{Duration, Instant};

use kvpoll::transport::ucx::{
    BlockOp, Context, ContextOptions, Endpoint, MemoryRegion, PackedRkey, RemoteKey, Worker,
};

const BLOCK: usize = 64 * 1024;
const BLOCKS: usize = 16;

fn case(tls: &str, caller_memory: bool) -> Result<(), Box<dyn std::error::Error>> {
    let what = if caller_memory { "caller" } else { "ucx" };
    eprintln!(
        "case: {tls} {what}-allocated memory, ucx {}",
        ucx_sys::Version::runtime()
    );
    let opts = ContextOptions::with_transports(tls);
    let (ca, cb) = (Context::new(&opts)?, Context::new(&opts)?);
    let (a, b) = (Worker::new(&ca)?, Worker::new(&cb)?);
    let len = BLOCK * BLOCKS;
    let (mut va, mut vb) = (vec![0u8; len], vec![7u8; len]);
    let (local, remote) = if caller_memory {
        // SAFETY: both vectors outlive the regions (dropped at the end of
        // this function, after them) and are not touched meanwhile.
        unsafe {
            (
                MemoryRegion::map(&ca, va.as_mut_ptr(), len)?,
                MemoryRegion::map(&cb, vb.as_mut_ptr(), len)?,
            )
        }
    } else {
        let (l, r) = (
            MemoryRegion::allocate(&ca, len)?,
            MemoryRegion::allocate(&cb, len)?,
        );
        r.write(0, &vb)?;
        (l, r)
    };
    let ep = Endpoint::connect(&a, &b.address()?, 1)?;
    let packed = PackedRkey::from_bytes(remote.pack_rkey()?.as_bytes())?;
    let rkey = RemoteKey::unpack(&ep, &packed)?;
    let ops: Vec<BlockOp> = (0..BLOCKS as u64)
        .map(|i| BlockOp {
            local_offset: i * BLOCK as u64,
            remote_offset: i * BLOCK as u64,
            len: BLOCK,
            token: i,
        })
        .collect();
    ep.get_batch(&local, &rkey, &ops)
        .map_err(|e| format!("{e:?}"))?;
    let (t, mut done) = (Instant::now(), Vec::new());
    while done.len() < BLOCKS && t.elapsed() < Duration::from_secs(10) {
        a.progress();
        b.progress();
        a.take_completions(&mut done);
    }
    let mut back = vec![0u8; len];
    local.read(0, &mut back)?;
    eprintln!(
        "case: {tls} {what}: {} of {BLOCKS} gets done, bytes {}",
        done.iter().filter(|c| c.status.is_ok()).count(),
        if back == vec![7u8; len] {
            "match"
        } else {
            "differ"
        }
    );
    drop((rkey, ep, local, remote));
    drop((va, vb));
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let tls = args.first().map_or("posix,sysv,cma", String::as_str);
    for caller in [true, false] {
        if let Err(e) = case(tls, caller) {
            eprintln!("case: {tls}: {e}");
        }
    }
}
