//! The raw UCX baseline: a decode rank's transfer shape — from each of its
//! two prefill ranks, `per_handle` blocks in each of `layers` regions — done
//! by a plain UCX worker loop (no kvpoll engine, ledger, rings, control
//! messages or confirmation), against the live prefill ranks' registered
//! memory. Gets for pull; puts and a flush of both endpoints for push. What
//! it measures is the transfer alone, so that the demo's figures show
//! kvpoll's share.
//!
//! It runs before a mode's requests, while no request is in flight, so it
//! fires no fault and nothing it writes is read by the checker: a prefill
//! rank fills every block it lends or pushes right before, so what a raw
//! put left in one of its free blocks is overwritten first.

use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use kvpoll::metadata::PeerMetadata;
use kvpoll::transport::ucx::{
    BlockOp, Completion, Context, ContextOptions, Endpoint, MemoryRegion, RemoteKey, Worker,
};

use super::decode::Mode;
use super::link;
use super::proto::Layout;

/// The shape of one raw run.
#[derive(Debug, Clone)]
pub struct RawConfig {
    pub tls: String,
    pub layout: Layout,
    pub per_handle: u32,
    pub mode: Mode,
    /// Requests to time.
    pub requests: u32,
    /// Requests in flight at once.
    pub window: usize,
    /// The deployment's key, for the handshake (the raw loop's UCX reads
    /// need none: the key does not guard one-sided access).
    pub auth: Option<kvpoll::auth::AuthKey>,
}

/// How long a raw run may take before it is called failed.
const GUARD: Duration = Duration::from_secs(30);
/// Set in a flush's token.
const FLUSH: u64 = 1 << 63;

/// The latency of every request, in µs, as a histogram.
pub type Latencies = Histogram<u64>;

/// Connects to the two prefill ranks at `addrs` (their control ports: the
/// handshake gives their engines' metadata) and times `cfg.requests`
/// transfers.
pub fn measure(cfg: &RawConfig, addrs: [&str; 2]) -> Result<Latencies, String> {
    let ctx = Context::new(&ContextOptions::with_transports(&cfg.tls))
        .map_err(|e| format!("UCX context: {e}"))?;
    let worker = Worker::new(&ctx).map_err(|e| format!("UCX worker: {e}"))?;
    let bs = cfg.layout.block_size;
    let layers = cfg.layout.layers as usize;
    let per = u64::from(cfg.per_handle);
    // Local blocks: window slots x 2 sides x layers x per_handle.
    let local_len = (cfg.window as u64)
        .checked_mul(2 * layers as u64)
        .and_then(|n| n.checked_mul(per))
        .and_then(|n| n.checked_mul(bs))
        .and_then(|n| usize::try_from(n).ok())
        .ok_or("local buffer size overflows")?;
    let local =
        MemoryRegion::allocate(&ctx, local_len).map_err(|e| format!("local memory: {e}"))?;
    let mut sides = Vec::with_capacity(2);
    for (i, addr) in addrs.iter().enumerate() {
        // The control stream is dropped once the metadata is read: the
        // prefill rank forgets the connection, nothing else.
        let opened = link::handshake(addr, cfg.layout, cfg.auth.as_ref())
            .map_err(|e| format!("prefill rank at {addr}: {e}"))?;
        let meta = PeerMetadata::decode(&opened.meta)
            .map_err(|e| format!("prefill rank at {addr}: {e}"))?;
        if meta.layout.block_size != bs {
            return Err(format!(
                "prefill rank at {addr} has {} byte blocks, not {bs}",
                meta.layout.block_size
            ));
        }
        if meta.regions.len() < layers {
            return Err(format!(
                "prefill rank at {addr} has {} regions, not {layers}",
                meta.regions.len()
            ));
        }
        // A slot's blocks must exist in every region, and the slots must
        // not overlap (a window of puts into the same block would race).
        let needed = (cfg.window as u64).saturating_mul(per);
        if let Some(r) = meta.regions.iter().take(layers).find(|r| r.blocks < needed) {
            return Err(format!(
                "prefill rank at {addr}: region {} has {} blocks, {needed} needed",
                r.id, r.blocks
            ));
        }
        let ep = Endpoint::connect(&worker, &meta.worker, i as u64)
            .map_err(|e| format!("connecting to prefill rank at {addr}: {e}"))?;
        let rkeys = meta
            .regions
            .iter()
            .take(layers)
            .map(|r| RemoteKey::unpack(&ep, &r.rkey))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("prefill rank at {addr}: {e}"))?;
        sides.push((rkeys, ep));
    }
    let mut run = Run {
        cfg,
        worker: &worker,
        local: &local,
        sides: &sides,
        left: vec![0; cfg.requests as usize],
        started: vec![Instant::now(); cfg.requests as usize],
        done: Vec::with_capacity(1024),
        outstanding: 0,
    };
    let result = run.run();
    // Whatever happened, nothing may be in flight when the keys and the
    // endpoints go: wait (bounded) for what was posted.
    run.drain();
    drop(sides);
    result
}

struct Run<'a> {
    cfg: &'a RawConfig,
    worker: &'a Worker,
    local: &'a MemoryRegion,
    sides: &'a [(Vec<RemoteKey>, Endpoint)],
    /// Operations each request still waits for.
    left: Vec<u32>,
    started: Vec<Instant>,
    done: Vec<Completion>,
    /// Operations posted and not completed.
    outstanding: u64,
}

impl Run<'_> {
    fn run(&mut self) -> Result<Latencies, String> {
        let cfg = self.cfg;
        let n = cfg.requests;
        let layers = cfg.layout.layers as usize;
        let per = u64::from(cfg.per_handle);
        let bs = cfg.layout.block_size;
        let window = cfg.window.max(1) as u32;
        let mut hist = Histogram::new(3).map_err(|e| format!("histogram: {e}"))?;
        let ops_per_request =
            2 * layers as u32 * cfg.per_handle + if cfg.mode == Mode::Push { 2 } else { 0 };
        let mut ops = Vec::with_capacity(cfg.per_handle as usize);
        let (mut submitted, mut finished) = (0u32, 0u32);
        let t0 = Instant::now();
        while finished < n {
            while submitted < n && submitted - finished < window {
                let seq = submitted;
                let slot = u64::from(seq % window);
                self.started[seq as usize] = Instant::now();
                self.left[seq as usize] = ops_per_request;
                for (side, (rkeys, ep)) in self.sides.iter().enumerate() {
                    for (layer, rkey) in rkeys.iter().enumerate() {
                        ops.clear();
                        ops.extend((0..per).map(|b| BlockOp {
                            local_offset: (((slot * 2 + side as u64) * layers as u64
                                + layer as u64)
                                * per
                                + b)
                                * bs,
                            remote_offset: (slot * per + b) * bs,
                            len: bs as usize,
                            token: u64::from(seq),
                        }));
                        let posted = match cfg.mode {
                            Mode::Pull => ep.get_batch(self.local, rkey, &ops),
                            Mode::Push => ep.put_batch(self.local, rkey, &ops),
                        };
                        if let Err(e) = posted {
                            self.outstanding += e.posted as u64;
                            return Err(format!("posting: {e}"));
                        }
                        self.outstanding += per;
                    }
                    if cfg.mode == Mode::Push {
                        // A put is done when it is visible at the target.
                        ep.flush(FLUSH | u64::from(seq))
                            .map_err(|e| format!("flush: {e}"))?;
                        self.outstanding += 1;
                    }
                }
                submitted += 1;
            }
            let got = self.progress();
            let now = Instant::now();
            for c in &self.done {
                if !c.status.is_ok() {
                    return Err(format!("a raw transfer failed: {}", c.status.as_str()));
                }
                let seq = (c.token & !FLUSH) as usize;
                let Some(l) = self.left.get_mut(seq).filter(|l| **l > 0) else {
                    return Err(format!("unexpected completion token {}", c.token));
                };
                *l -= 1;
                if *l == 0 {
                    let us = (now - self.started[seq]).as_micros() as u64;
                    let _ = hist.record(us.max(1));
                    finished += 1;
                }
            }
            if !got && t0.elapsed() > GUARD {
                return Err(format!("{finished} of {n} transfers done after {GUARD:?}"));
            }
        }
        Ok(hist)
    }

    /// Progresses the worker once and collects completions into
    /// `self.done`; whether any came. Yields the CPU when nothing did: on
    /// a small machine the prefill ranks' pollers need it (over tcp they
    /// apply our gets and puts).
    fn progress(&mut self) -> bool {
        self.worker.progress();
        self.done.clear();
        self.worker.take_completions(&mut self.done);
        self.outstanding = self.outstanding.saturating_sub(self.done.len() as u64);
        if self.done.is_empty() {
            std::thread::yield_now();
        }
        !self.done.is_empty()
    }

    /// Waits, up to a bound, for every posted operation to complete.
    fn drain(&mut self) {
        let until = Instant::now() + Duration::from_secs(5);
        while self.outstanding > 0 && Instant::now() < until {
            self.progress();
        }
    }
}
