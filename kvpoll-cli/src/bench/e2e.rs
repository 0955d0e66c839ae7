//! End to end over real UCX between two processes, against a raw UCX loop
//! posting the same operations with no bookkeeping, in the same run
//! (docs/design.md §6: kvpoll's overhead ≤ 10 %).
//!
//! - **kvpoll**: an [`Engine`] in this process reads from a `kvpoll
//!   engine-peer` process. Each read is a request; the engine thread keeps
//!   `in_flight` requests submitted and collects reports with
//!   [`Engine::poll`] (yielding its core when nothing is new: on a small
//!   machine the poller and the peer need it). A successful read also sends
//!   the producer its notification (one active message per request): that
//!   is part of what a kvpoll read is, so it is counted.
//! - **raw**: a UCX worker in this process reads from a `kvpoll ucx-peer`
//!   process with [`Endpoint::get_batch`] and [`Worker::progress`], the same
//!   operations and the same number in flight, no ledger, no rings, no
//!   thread handoff. When a request's gets completed it sends the peer one
//!   eager active message of a notification's size, as kvpoll does: both
//!   sides do the same protocol work.
//!
//! - **kvpoll, confirmed**: the same engine shape with read confirmation
//!   on (the default, `confirm_reads(true)`), reading from a `kvpoll
//!   engine-peer --lend-ahead` process that lends each request id it will
//!   be asked about (to one reader, ids in order, a window ahead of those
//!   released), and reads what that lend lent: one peer lends one block
//!   an id for the single-block reads, another `request_blocks` blocks for
//!   the requests. Every read confirms its lend (its lend word, or asking
//!   its producer) and finishes on the answer. Its cost over the
//!   unconfirmed runs is what confirmation costs, the producer's lends
//!   included.
//!
//! - **kvpoll, lent, unconfirmed**: confirmation off, reading from a
//!   lending peer of its own the same way (each id lent, its incarnation
//!   named): a read finishes when its data landed and then tells its
//!   lender one way. Against it, the confirmed runs show what confirmation
//!   itself costs, the lends and the channel that hands out their
//!   incarnations being in both.
//!
//! Two shapes: single-block reads (`reads` reads of one block) and requests
//! of `request_blocks` blocks. Runs of kvpoll, confirmed kvpoll and raw
//! alternate; medians.
//!
//! Used by `kvpoll-cli/benches/e2e.rs` and `kvpoll bench`.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use thiserror::Error;

use kvpoll::transport::ucx::{
    BlockOp, Completion, Context, ContextOptions, Endpoint, MemoryRegion, PackedRkey, RemoteKey,
    UcxError, Worker, WorkerAddress, NOTIFY_AM_ID,
};
use kvpoll::wire::from_hex;
use kvpoll::{BlockId, Engine, Incarnation, Outcomes, PeerId, RequestId, Transfer};

/// Blocks the peers serve (remote offsets wrap inside them).
const PEER_BLOCKS: u64 = 64;
/// Token bit of the raw loop's notification sends (their completions are
/// not reads).
const NOTE: u64 = 1 << 63;
/// Request ids the lending peer keeps lent ahead of those released (more
/// than any shape has in flight, so a read never outruns its lend): ~20 ms
/// of reads at 400 k/s, for a lender whose engine thread is descheduled
/// that long on a loaded machine (2048 was outrun once at load average 7).
const LEND_AHEAD: u32 = 8192;
/// A run that takes longer than this is stuck, not slow.
const GUARD: Duration = Duration::from_secs(60);

/// The shape of the comparison.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct E2eConfig {
    /// UCX transports of both processes (`tcp`, or `posix,sysv,cma`).
    pub tls: String,
    /// Bytes per block.
    pub block_size: u64,
    /// Single-block reads per run.
    pub reads: u32,
    /// Single-block reads in flight.
    pub in_flight: u32,
    /// Multi-block requests per run.
    pub requests: u32,
    /// Blocks per multi-block request.
    pub request_blocks: u32,
    /// Multi-block requests in flight.
    pub requests_in_flight: u32,
    /// Runs of each (alternating); medians are reported.
    pub runs: u32,
}

impl Default for E2eConfig {
    /// 20 000 single-block 16 KiB reads, 64 in flight; 500 requests of
    /// 64 × 16 KiB, 4 in flight; over tcp; 7 runs each (a run of single
    /// blocks lasts ~40 ms here: the median of 7 is what one scheduler
    /// hiccup cannot move).
    fn default() -> Self {
        E2eConfig {
            tls: "tcp".into(),
            block_size: 16 * 1024,
            reads: 20_000,
            in_flight: 64,
            requests: 500,
            request_blocks: 64,
            requests_in_flight: 4,
            runs: 7,
        }
    }
}

/// The comparison could not run.
#[derive(Debug, Error)]
pub enum E2eError {
    /// The peer process did not start or did not say READY.
    #[error("peer process {what}: {why}")]
    Peer {
        /// Which peer.
        what: &'static str,
        /// What went wrong.
        why: String,
    },
    /// The engine refused something.
    #[error("engine: {0}")]
    Engine(#[from] kvpoll::Error),
    /// UCX refused something in the raw loop.
    #[error("raw UCX: {0}")]
    Ucx(#[from] UcxError),
    /// A read failed, or a run made no progress within a minute.
    #[error("{0}")]
    Failed(String),
    /// The shape cannot run (zero reads, more in flight than blocks, …).
    #[error("bad bench shape: {0}")]
    Shape(&'static str),
}

crate::from_engine_errors!(E2eError, E2eError::Engine);

/// Rates of one shape, kvpoll and raw.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rates {
    /// kvpoll, operations per second (median run).
    pub kvpoll_per_s: f64,
    /// Raw UCX loop, operations per second (median run).
    pub raw_per_s: f64,
    /// `(raw / kvpoll − 1) × 100`: how much slower kvpoll is, in percent
    /// (negative when it is faster). Target ≤ 10.
    pub overhead_pct: f64,
}

impl Rates {
    fn new(kvpoll: f64, raw: f64) -> Self {
        Rates {
            kvpoll_per_s: kvpoll,
            raw_per_s: raw,
            overhead_pct: (raw / kvpoll - 1.0) * 100.0,
        }
    }
}

/// What read confirmation costs, one shape: kvpoll with it against
/// kvpoll without it, same run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ConfirmCost {
    /// kvpoll with read confirmation, operations per second (median run).
    pub confirmed_per_s: f64,
    /// kvpoll without it (the `kvpoll_per_s` of the same shape).
    pub unconfirmed_per_s: f64,
    /// `confirmed / unconfirmed`.
    pub ratio: f64,
    /// Time per request added, µs: `1/confirmed − 1/unconfirmed`.
    pub us_per_request: f64,
}

impl ConfirmCost {
    fn new(confirmed: f64, unconfirmed: f64) -> Self {
        ConfirmCost {
            confirmed_per_s: confirmed,
            unconfirmed_per_s: unconfirmed,
            ratio: confirmed / unconfirmed,
            us_per_request: (1.0 / confirmed - 1.0 / unconfirmed) * 1e6,
        }
    }
}

/// Every figure of one comparison.
#[derive(Debug, Clone, PartialEq)]
pub struct E2eFigures {
    /// The transports used.
    pub tls: String,
    /// Single-block reads per second.
    pub reads: Rates,
    /// Multi-block requests per second.
    pub requests: Rates,
    /// Read confirmation on single-block reads.
    pub confirm_reads: ConfirmCost,
    /// Read confirmation on multi-block requests.
    pub confirm_requests: ConfirmCost,
    /// Read confirmation on single-block reads, against unconfirmed reads
    /// of lends made the same way.
    pub confirm_reads_same_lends: ConfirmCost,
    /// Read confirmation on multi-block requests, against unconfirmed
    /// reads of lends made the same way.
    pub confirm_requests_same_lends: ConfirmCost,
    /// Per-read latency (submit → visible), kvpoll with confirmation, ns,
    /// from the last run.
    pub confirmed_read_latency_ns: Vec<u64>,
    /// Per-read latency (submit → visible), kvpoll, ns, from the last run.
    pub kvpoll_read_latency_ns: Vec<u64>,
    /// Per-read latency (post → completion), raw, ns, from the last run.
    pub raw_read_latency_ns: Vec<u64>,
}

impl E2eFigures {
    /// One JSON object (latency samples left out).
    pub fn to_json(&self) -> String {
        let r = |x: &Rates| {
            format!(
                "{{\"kvpoll_per_s\":{:.0},\"raw_per_s\":{:.0},\"overhead_pct\":{:.2},\"target_overhead_pct\":10}}",
                x.kvpoll_per_s, x.raw_per_s, x.overhead_pct
            )
        };
        let c = |x: &ConfirmCost| {
            format!(
                "{{\"confirmed_per_s\":{:.0},\"unconfirmed_per_s\":{:.0},\"ratio\":{:.4},\"us_per_request\":{:.3}}}",
                x.confirmed_per_s, x.unconfirmed_per_s, x.ratio, x.us_per_request
            )
        };
        format!(
            "{{\"tls\":\"{}\",\"single_block_reads\":{},\"requests\":{},\"confirm_single_block_reads\":{},\"confirm_requests\":{},\"confirm_single_block_reads_same_lends\":{},\"confirm_requests_same_lends\":{}}}",
            self.tls,
            r(&self.reads),
            r(&self.requests),
            c(&self.confirm_reads),
            c(&self.confirm_requests),
            c(&self.confirm_reads_same_lends),
            c(&self.confirm_requests_same_lends)
        )
    }
}

/// A peer process; its standard input closing tells it to exit.
pub(crate) struct PeerProcess {
    pub(crate) child: Child,
    pub(crate) stdin: Option<ChildStdin>,
    pub(crate) ready: String,
    /// What it prints after READY, and the `LENT` lines before it.
    pub(crate) stdout: Option<BufReader<ChildStdout>>,
    pub(crate) lent: Vec<(u64, Incarnation)>,
}

/// The worker address and packed rkey a `kvpoll ucx-peer` announces on
/// its first line (two hex words).
pub(crate) fn ucx_peer_ready(ready: &str) -> Result<(Vec<u8>, Vec<u8>), E2eError> {
    let bad = |why: &str| E2eError::Peer {
        what: "ucx-peer",
        why: why.to_owned(),
    };
    let mut parts = ready.split_whitespace();
    let addr = parts
        .next()
        .and_then(|h| from_hex(h).ok())
        .ok_or_else(|| bad("bad worker address"))?;
    let rkey = parts
        .next()
        .and_then(|h| from_hex(h).ok())
        .ok_or_else(|| bad("bad rkey"))?;
    Ok((addr, rkey))
}

/// A `LENT <id> <hex incarnation>` line of a lending `engine-peer`.
pub fn lent_line(line: &str) -> Option<(u64, Incarnation)> {
    let mut parts = line.trim().strip_prefix("LENT ")?.split_whitespace();
    let id = parts.next()?.parse().ok()?;
    let inc = u64::from_str_radix(parts.next()?, 16).ok()?;
    Some((id, Incarnation(inc)))
}

impl PeerProcess {
    pub(crate) fn spawn(exe: &Path, what: &'static str, args: &[String]) -> Result<Self, E2eError> {
        Self::spawn_with_env(exe, what, args, &[])
    }

    /// [`PeerProcess::spawn`] with these variables added to its environment.
    pub(crate) fn spawn_with_env(
        exe: &Path,
        what: &'static str,
        args: &[String],
        env: &[(String, String)],
    ) -> Result<Self, E2eError> {
        let fail = |why: String| E2eError::Peer { what, why };
        let mut child = Command::new(exe)
            .arg(what)
            .args(args)
            // A peer is keyed only where the caller says so.
            .env_remove(kvpoll::auth::ENV)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| fail(format!("spawning {}: {e}", exe.display())))?;
        let stdin = child.stdin.take();
        let mut p = PeerProcess {
            stdout: child.stdout.take().map(BufReader::new),
            child,
            stdin,
            ready: String::new(),
            lent: Vec::new(),
        };
        let Some(out) = p.stdout.as_mut() else {
            return Err(fail("no standard output".into()));
        };
        loop {
            let mut line = String::new();
            match out.read_line(&mut line) {
                Ok(n) if n > 0 => {}
                _ => return Err(fail("no READY line".into())),
            }
            if let Some(lent) = lent_line(&line) {
                p.lent.push(lent);
                continue;
            }
            return match line.trim().strip_prefix("READY ") {
                Some(rest) => {
                    p.ready = rest.to_owned();
                    Ok(p)
                }
                None => Err(fail(format!("said {line:?} instead of READY"))),
            };
        }
    }

    /// The incarnations it lends, in order: those it printed before READY,
    /// then the rest as it prints them.
    fn lent(&mut self) -> mpsc::Receiver<(u64, Incarnation)> {
        let (tx, rx) = mpsc::channel();
        for &l in &self.lent {
            let _ = tx.send(l);
        }
        if let Some(mut out) = self.stdout.take() {
            std::thread::spawn(move || {
                let mut line = String::new();
                while matches!(out.read_line(&mut line), Ok(n) if n > 0) {
                    if let Some(l) = lent_line(&line) {
                        if tx.send(l).is_err() {
                            return;
                        }
                    }
                    line.clear();
                }
            });
        }
        rx
    }
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        if let Some(mut s) = self.stdin.take() {
            let _ = s.flush();
        }
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(2) {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// kvpoll's side: an engine connected to an `engine-peer`.
struct KvpollSide {
    engine: Engine,
    peer: PeerId,
    out: Outcomes,
    next_id: u64,
    /// With confirmation: the incarnations the peer lent each id with, in
    /// id order.
    lent: Option<mpsc::Receiver<(u64, Incarnation)>>,
    /// Blocks the lending peer lends an id (`--lend-blocks`; 0: its peer
    /// lends nothing, reads take blocks from 0): a read reads them all.
    lend_blocks: u32,
    /// The lending peer's blocks (its lends wrap inside them).
    lender_blocks: u64,
    /// The remote blocks of the request being submitted.
    remote: Vec<BlockId>,
}

impl KvpollSide {
    /// `confirm`: read confirmation on (its peer lends each id it reads,
    /// from 0 in order) or off (its peer serves its blocks without lending
    /// them per request, as the raw loop reads them: no lender to confirm).
    fn new(
        cfg: &E2eConfig,
        metadata: &[u8],
        local_blocks: u64,
        confirm: bool,
    ) -> Result<Self, E2eError> {
        let mut engine = Engine::builder()
            .block_size(cfg.block_size)
            .ucx(ContextOptions::with_transports(&cfg.tls))
            .confirm_reads(confirm)
            // Keyed as its peer processes are: not at all.
            .auth_key(None)
            .build()?;
        engine.register(local_blocks)?;
        let peer = engine.add_peer(metadata)?;
        Ok(KvpollSide {
            engine,
            peer,
            out: Outcomes::default(),
            next_id: 0,
            lent: None,
            lend_blocks: 0,
            lender_blocks: PEER_BLOCKS,
            remote: Vec::new(),
        })
    }

    /// Reads from a lending peer that lends `k` of its `blocks` blocks an
    /// id (`--lend-ahead`, `--lend-blocks k`), ids from 0 in order.
    fn reading_lends(mut self, peer: &mut PeerProcess, k: u32, blocks: u64) -> Self {
        self.lent = Some(peer.lent());
        self.lend_blocks = k;
        self.lender_blocks = blocks;
        self
    }

    /// The remote blocks request `id` reads: those its lend lent (the
    /// lending peer's `blocks_of`), or blocks from 0.
    fn set_remote(&mut self, id: u64, blocks: u32) {
        let (k, wrap) = (u64::from(self.lend_blocks), self.lender_blocks);
        self.remote.clear();
        self.remote.extend((0..u64::from(blocks)).map(|j| {
            let b = if k == 0 { j } else { id * k + j };
            BlockId((b % wrap) as u32)
        }));
    }

    /// `n` requests of `blocks` blocks, `depth` in flight; returns the run's
    /// time and each request's submit → visible latency.
    fn run(
        &mut self,
        n: u32,
        blocks: u32,
        depth: u32,
        lat: &mut Vec<u64>,
    ) -> Result<Duration, E2eError> {
        if self.lend_blocks != 0 && blocks != self.lend_blocks {
            return Err(E2eError::Shape(
                "a read of a lending peer reads every block of a lend",
            ));
        }
        let local: Vec<BlockId> = (0..blocks * depth).map(BlockId).collect();
        let first = self.next_id;
        self.set_remote(first, blocks);
        let mut started = vec![Instant::now(); n as usize];
        lat.clear();
        let (mut submitted, mut done) = (0u32, 0u32);
        let t0 = Instant::now();
        while done < n {
            while submitted < n && submitted - done < depth {
                let slot = (submitted % depth * blocks) as usize;
                let id = first + u64::from(submitted);
                let lend = lend_of(self.lent.as_ref(), id)?;
                if self.lend_blocks != 0 {
                    self.set_remote(id, blocks);
                }
                started[submitted as usize] = Instant::now();
                self.engine.read(
                    RequestId(id),
                    &[Transfer {
                        peer: self.peer,
                        local: &local[slot..slot + blocks as usize],
                        remote: &self.remote,
                        lend,
                    }],
                )?;
                submitted += 1;
            }
            if !poll_some(&mut self.engine, &mut self.out, Waiting::Yield, t0, done, n)? {
                continue;
            }
            let now = Instant::now();
            for id in &self.out.finished_recving {
                // Every earlier run finished all its reads, so each id is ours.
                let Some(t) =
                    id.0.checked_sub(first)
                        .and_then(|i| started.get(i as usize))
                else {
                    return Err(E2eError::Failed(format!("kvpoll reported unknown {id:?}")));
                };
                lat.push((now - *t).as_nanos() as u64);
                done += 1;
            }
        }
        let t = t0.elapsed();
        self.next_id = first + u64::from(n);
        Ok(t)
    }
}

/// The incarnation a lending peer lent `id` with, from its `LENT` lines
/// (none without a lending peer: confirmation off).
pub(crate) fn lend_of(
    lent: Option<&mpsc::Receiver<(u64, Incarnation)>>,
    id: u64,
) -> Result<Incarnation, E2eError> {
    let Some(lent) = lent else {
        return Ok(Incarnation::NONE);
    };
    loop {
        match lent.recv_timeout(GUARD) {
            Ok((i, inc)) if i == id => return Ok(inc),
            Ok(_) => {}
            Err(_) => {
                return Err(E2eError::Failed(format!(
                    "the lending peer never said how it lent request {id}"
                )))
            }
        }
    }
}

/// How long a blocking engine thread waits at most before it looks at
/// the guard: long beside any request, short beside [`GUARD`].
const BLOCK_AT_MOST: Duration = Duration::from_millis(200);

/// How the bench's engine thread waits for outcomes.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Waiting {
    /// Poll, and yield the core when nothing is new: the latency figures'
    /// engine thread, which picks an outcome up as soon as it is out.
    Yield,
    /// Block in [`Engine::wait`] until an outcome is out: an engine thread
    /// with nothing else to do until its transfers end, which leaves the
    /// cores to the pollers and the peer. It wakes on no timer but
    /// [`BLOCK_AT_MOST`]'s, for the guard: a thread that woke every
    /// millisecond (a dozen times a 64 MiB read) spent CPU on each wake
    /// that the bench counts against the transfer.
    Block,
}

/// Polls `engine` into `out` (cleared first). `Ok(false)`: nothing new,
/// after yielding the core or blocking a while (`waiting`; on a small
/// machine the poller and the peer need the core). Errors: a failed read
/// or write, an expired one, or no progress since `t0` within a minute
/// (`done` of `n` finished).
pub(crate) fn poll_some(
    engine: &mut Engine,
    out: &mut Outcomes,
    waiting: Waiting,
    t0: Instant,
    done: u32,
    n: u32,
) -> Result<bool, E2eError> {
    out.clear();
    let got = match waiting {
        Waiting::Yield => engine.poll(out),
        Waiting::Block => engine.wait(out, BLOCK_AT_MOST),
    };
    if got == 0 {
        if t0.elapsed() > GUARD {
            return Err(E2eError::Failed(format!(
                "kvpoll: {done} of {n} requests after {GUARD:?}"
            )));
        }
        if waiting == Waiting::Yield {
            std::thread::yield_now();
        }
        return Ok(false);
    }
    if let Some(f) = out.failed_recving.first() {
        return Err(E2eError::Failed(format!(
            "kvpoll read {:?} failed: {:?}",
            f.id, f.reason
        )));
    }
    if let Some(f) = out.failed_sending.first() {
        return Err(E2eError::Failed(format!(
            "kvpoll write {:?} failed: {:?}",
            f.id, f.reason
        )));
    }
    if let Some(id) = out.expired.first() {
        return Err(E2eError::Failed(format!("kvpoll {id:?} expired")));
    }
    Ok(true)
}

/// The raw side: a worker connected to a `ucx-peer`, no bookkeeping.
struct RawSide {
    // Field order is drop order: endpoint state before the worker and context.
    rkey: RemoteKey,
    ep: Endpoint,
    local: MemoryRegion,
    worker: Worker,
    _ctx: Context,
    done: Vec<Completion>,
}

impl RawSide {
    fn new(cfg: &E2eConfig, ready: &str, local_blocks: u64) -> Result<Self, E2eError> {
        let (addr, rkey) = ucx_peer_ready(ready)?;
        let ctx = Context::new(&ContextOptions::with_transports(&cfg.tls))?;
        let worker = Worker::new(&ctx)?;
        let local = MemoryRegion::allocate(&ctx, (local_blocks * cfg.block_size) as usize)?;
        let ep = Endpoint::connect(&worker, &WorkerAddress::from_bytes(&addr)?, 1)?;
        let rkey = RemoteKey::unpack(&ep, &PackedRkey::from_bytes(&rkey)?)?;
        Ok(RawSide {
            rkey,
            ep,
            local,
            worker,
            _ctx: ctx,
            done: Vec::with_capacity(4096),
        })
    }

    /// The same shape as [`KvpollSide::run`], as one `get_batch` a request.
    fn run(
        &mut self,
        bs: u64,
        n: u32,
        blocks: u32,
        depth: u32,
        lat: &mut Vec<u64>,
    ) -> Result<Duration, E2eError> {
        let mut started = vec![Instant::now(); n as usize];
        let mut left = vec![0u32; n as usize];
        let mut ops = Vec::with_capacity(blocks as usize);
        lat.clear();
        let (mut submitted, mut done) = (0u32, 0u32);
        let t0 = Instant::now();
        while done < n {
            while submitted < n && submitted - done < depth {
                let slot = u64::from(submitted % depth * blocks);
                ops.clear();
                ops.extend((0..u64::from(blocks)).map(|b| BlockOp {
                    local_offset: (slot + b) * bs,
                    remote_offset: (b % PEER_BLOCKS) * bs,
                    len: bs as usize,
                    token: u64::from(submitted),
                }));
                started[submitted as usize] = Instant::now();
                left[submitted as usize] = blocks;
                self.ep
                    .get_batch(&self.local, &self.rkey, &ops)
                    .map_err(|e| E2eError::Failed(format!("raw get_batch: {e}")))?;
                submitted += 1;
            }
            self.worker.progress();
            self.done.clear();
            self.worker.take_completions(&mut self.done);
            if self.done.is_empty() && t0.elapsed() > GUARD {
                return Err(E2eError::Failed(format!(
                    "raw: {done} of {n} reads after {GUARD:?}"
                )));
            }
            let now = Instant::now();
            for c in &self.done {
                if let Some(i) = raw_completion(&self.ep, c, &mut left)? {
                    lat.push((now - started[i]).as_nanos() as u64);
                    done += 1;
                }
            }
        }
        Ok(t0.elapsed())
    }
}

/// One completion of a raw loop whose request `i` posted `left[i]` gets
/// under token `i`: `Some(i)` when it was request `i`'s last, after
/// sending the producer its read-done notification (as kvpoll sends it:
/// same size, eager); `None` for a get with more to come or a
/// notification's own completion.
pub(crate) fn raw_completion(
    ep: &Endpoint,
    c: &Completion,
    left: &mut [u32],
) -> Result<Option<usize>, E2eError> {
    if !c.status.is_ok() {
        return Err(E2eError::Failed(format!("raw get failed: {:?}", c.status)));
    }
    if c.token & NOTE != 0 {
        return Ok(None);
    }
    let i = c.token as usize;
    let Some(l) = left.get_mut(i).filter(|l| **l > 0) else {
        return Err(E2eError::Failed(format!(
            "raw: unexpected token {}",
            c.token
        )));
    };
    *l -= 1;
    if *l > 0 {
        return Ok(None);
    }
    let note = [i as u8; kvpoll::notification::LEN];
    ep.send_active_message(NOTIFY_AM_ID, &note, NOTE | c.token)
        .map_err(|e| E2eError::Failed(format!("raw notification: {e}")))?;
    Ok(Some(i))
}

/// Both sides connected to their peer processes, ready to run shapes; what
/// [`compare`] and the criterion bench drive.
pub struct Session {
    cfg: E2eConfig,
    kv: KvpollSide,
    /// Confirmed, of single-block lends and of `request_blocks` lends.
    kv_confirmed: KvpollSide,
    kv_confirmed_requests: KvpollSide,
    /// Unconfirmed, of lends made as for the confirmed sides.
    kv_lent: KvpollSide,
    kv_lent_requests: KvpollSide,
    raw: RawSide,
    // Dropped last: the peers outlive the connections to them.
    _peers: Vec<PeerProcess>,
}

impl Session {
    /// Spawns both peers from `kvpoll_exe` (the `kvpoll` binary:
    /// `std::env::current_exe()` inside it, `CARGO_BIN_EXE_kvpoll` in tests),
    /// connects, and warms both sides up.
    pub fn start(kvpoll_exe: &Path, cfg: &E2eConfig) -> Result<Self, E2eError> {
        if cfg.reads == 0 || cfg.requests == 0 || cfg.runs == 0 {
            return Err(E2eError::Shape("reads, requests and runs must be ≥ 1"));
        }
        if cfg.in_flight == 0
            || cfg.requests_in_flight == 0
            || cfg.request_blocks == 0
            || cfg.in_flight > 1024
            || cfg.request_blocks > 512
            || u64::from(cfg.requests_in_flight) * u64::from(cfg.request_blocks) > 1 << 16
        {
            return Err(E2eError::Shape(
                "in flight 1..=1024 (the engine's ledger slots), request blocks 1..=512, request blocks × in flight ≤ 65536",
            ));
        }
        let common = |blocks: u64| -> Vec<String> {
            vec![
                "--tls".into(),
                cfg.tls.clone(),
                "--blocks".into(),
                blocks.to_string(),
                "--block-size".into(),
                cfg.block_size.to_string(),
            ]
        };
        let mut engine_args = common(PEER_BLOCKS);
        engine_args.extend(["--regions".into(), "1".into()]);
        let engine_peer = PeerProcess::spawn(kvpoll_exe, "engine-peer", &engine_args)?;
        // Lending peers of `k` blocks an id, out of at least as many.
        let b = cfg.request_blocks;
        let request_lender_blocks = PEER_BLOCKS.max(u64::from(b));
        let lender = |k: u32, blocks: u64| {
            let mut args = common(blocks);
            args.extend(["--regions".into(), "1".into()]);
            // As far ahead as half its command ring holds (each lend is
            // 1 + k entries of 65 536).
            let ahead = (32_768 / (1 + k)).min(LEND_AHEAD);
            args.extend(["--lend-ahead".into(), ahead.to_string()]);
            args.extend(["--lend-blocks".into(), k.to_string()]);
            PeerProcess::spawn(kvpoll_exe, "engine-peer", &args)
        };
        let mut lenders = [
            lender(1, PEER_BLOCKS)?,
            lender(1, PEER_BLOCKS)?,
            lender(b, request_lender_blocks)?,
            lender(b, request_lender_blocks)?,
        ];
        let ucx_peer = PeerProcess::spawn(kvpoll_exe, "ucx-peer", &common(PEER_BLOCKS))?;
        let hex = |p: &PeerProcess| {
            from_hex(&p.ready).map_err(|_| E2eError::Peer {
                what: "engine-peer",
                why: "metadata is not hex".into(),
            })
        };
        let metadata = hex(&engine_peer)?;
        let local_blocks = u64::from(
            cfg.in_flight
                .max(cfg.requests_in_flight * cfg.request_blocks),
        );
        let kv = KvpollSide::new(cfg, &metadata, local_blocks, false)?;
        // Each reads its own lending peer; its ids start at 0, the first
        // that peer lent.
        let mut side = |i: usize, confirm: bool, k: u32, blocks: u64| {
            let p = &mut lenders[i];
            let side = KvpollSide::new(cfg, &hex(p)?, local_blocks, confirm)?;
            Ok::<_, E2eError>(side.reading_lends(p, k, blocks))
        };
        let kv_confirmed = side(0, true, 1, PEER_BLOCKS)?;
        let kv_lent = side(1, false, 1, PEER_BLOCKS)?;
        let kv_confirmed_requests = side(2, true, b, request_lender_blocks)?;
        let kv_lent_requests = side(3, false, b, request_lender_blocks)?;
        let raw = RawSide::new(cfg, &ucx_peer.ready, local_blocks)?;
        let mut peers = vec![engine_peer, ucx_peer];
        peers.extend(lenders);
        let mut s = Session {
            cfg: cfg.clone(),
            kv,
            kv_confirmed,
            kv_confirmed_requests,
            kv_lent,
            kv_lent_requests,
            raw,
            _peers: peers,
        };
        // Warm all up: connections, registration caches, page faults.
        let mut lat = Vec::new();
        s.kvpoll(256, 1, &mut lat)?;
        s.kvpoll_confirmed(256, 1, &mut lat)?;
        s.read_lends(false, 256, 1, &mut lat)?;
        if cfg.request_blocks != 1 {
            let b = cfg.request_blocks;
            s.kvpoll_confirmed(16, b, &mut lat)?;
            s.read_lends(false, 16, b, &mut lat)?;
        }
        s.raw(256, 1, &mut lat)?;
        Ok(s)
    }

    /// kvpoll: `n` requests of `blocks` blocks (in flight: the config's
    /// `in_flight` for one block, `requests_in_flight` otherwise). Returns
    /// the run's time; `lat` gets each request's latency in ns.
    pub fn kvpoll(
        &mut self,
        n: u32,
        blocks: u32,
        lat: &mut Vec<u64>,
    ) -> Result<Duration, E2eError> {
        let depth = self.depth(blocks);
        self.kv.run(n, blocks, depth, lat)
    }

    /// kvpoll with read confirmation, same shape as [`Session::kvpoll`],
    /// reading from the peer that lends each request id.
    pub fn kvpoll_confirmed(
        &mut self,
        n: u32,
        blocks: u32,
        lat: &mut Vec<u64>,
    ) -> Result<Duration, E2eError> {
        self.read_lends(true, n, blocks, lat)
    }

    /// `n` reads of `blocks` blocks of what the lending peers lend, with
    /// confirmation (`confirmed`) or without (the same lends, unconfirmed).
    fn read_lends(
        &mut self,
        confirmed: bool,
        n: u32,
        blocks: u32,
        lat: &mut Vec<u64>,
    ) -> Result<Duration, E2eError> {
        let depth = self.depth(blocks);
        let side = match (confirmed, blocks == 1) {
            (true, true) => &mut self.kv_confirmed,
            (true, false) => &mut self.kv_confirmed_requests,
            (false, true) => &mut self.kv_lent,
            (false, false) => &mut self.kv_lent_requests,
        };
        side.run(n, blocks, depth, lat)
    }

    /// The raw loop, same shape as [`Session::kvpoll`].
    pub fn raw(&mut self, n: u32, blocks: u32, lat: &mut Vec<u64>) -> Result<Duration, E2eError> {
        let depth = self.depth(blocks);
        self.raw.run(self.cfg.block_size, n, blocks, depth, lat)
    }

    /// The poller counters so far (iterations, busy and idle time) of the
    /// kvpoll side with (`confirmed`) or without read confirmation, for
    /// profiling.
    pub fn kvpoll_poller_stats(&self, confirmed: bool) -> kvpoll::PollerStats {
        if confirmed {
            self.kv_confirmed.engine.poller_stats()
        } else {
            self.kv.engine.poller_stats()
        }
    }

    fn depth(&self, blocks: u32) -> u32 {
        if blocks == 1 {
            self.cfg.in_flight
        } else {
            self.cfg.requests_in_flight
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.kv.engine.shutdown();
        self.kv_confirmed.engine.shutdown();
        self.kv_confirmed_requests.engine.shutdown();
        self.kv_lent.engine.shutdown();
        self.kv_lent_requests.engine.shutdown();
    }
}

/// Runs the comparison: [`Session::start`], then `runs` alternating runs of
/// each shape on each side; medians.
pub fn compare(kvpoll_exe: &Path, cfg: &E2eConfig) -> Result<E2eFigures, E2eError> {
    let mut s = Session::start(kvpoll_exe, cfg)?;
    let rate = |n: u32, t: Duration| f64::from(n) / t.as_secs_f64();
    let (mut kv_reads, mut raw_reads, mut kv_reqs, mut raw_reqs) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut conf_reads, mut conf_reqs) = (Vec::new(), Vec::new());
    let (mut lent_reads, mut lent_reqs) = (Vec::new(), Vec::new());
    let (mut kv_lat, mut raw_lat, mut conf_lat, mut scratch) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (n, b) = (cfg.requests, cfg.request_blocks);
    for _ in 0..cfg.runs {
        kv_reads.push(rate(cfg.reads, s.kvpoll(cfg.reads, 1, &mut kv_lat)?));
        conf_reads.push(rate(
            cfg.reads,
            s.kvpoll_confirmed(cfg.reads, 1, &mut conf_lat)?,
        ));
        // Unconfirmed, of the same lends.
        let t = s.read_lends(false, cfg.reads, 1, &mut scratch)?;
        lent_reads.push(rate(cfg.reads, t));
        raw_reads.push(rate(cfg.reads, s.raw(cfg.reads, 1, &mut raw_lat)?));
        kv_reqs.push(rate(n, s.kvpoll(n, b, &mut scratch)?));
        conf_reqs.push(rate(n, s.kvpoll_confirmed(n, b, &mut scratch)?));
        lent_reqs.push(rate(n, s.read_lends(false, n, b, &mut scratch)?));
        raw_reqs.push(rate(n, s.raw(n, b, &mut scratch)?));
    }
    drop(s);
    let (kv_reads, kv_reqs) = (median(&mut kv_reads), median(&mut kv_reqs));
    let (conf_reads, conf_reqs) = (median(&mut conf_reads), median(&mut conf_reqs));
    Ok(E2eFigures {
        tls: cfg.tls.clone(),
        reads: Rates::new(kv_reads, median(&mut raw_reads)),
        requests: Rates::new(kv_reqs, median(&mut raw_reqs)),
        confirm_reads: ConfirmCost::new(conf_reads, kv_reads),
        confirm_requests: ConfirmCost::new(conf_reqs, kv_reqs),
        confirm_reads_same_lends: ConfirmCost::new(conf_reads, median(&mut lent_reads)),
        confirm_requests_same_lends: ConfirmCost::new(conf_reqs, median(&mut lent_reqs)),
        confirmed_read_latency_ns: conf_lat,
        kvpoll_read_latency_ns: kv_lat,
        raw_read_latency_ns: raw_lat,
    })
}
