//! A decode rank (`kvpoll connect`): an engine with a block pool that asks
//! two prefill ranks for each request's blocks and reads them (pull) or has
//! them written (push), verifying every block — at arrival, and again when
//! the block is given back to the pool, so a late write into a reused block
//! is caught.

use std::collections::{HashMap, VecDeque};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[allow(unused_imports)]
use crate::faults::*;
use hdrhistogram::Histogram;
use kvpoll::{BlockId, ContextOptions, Engine, Outcomes, PeerId, RequestId, Transfer};

use super::side::Side;
use kvpoll_cli::RunError;

use kvpoll::Cause;
use kvpoll_cli::control::{self, Session};

use super::link::{self, Incoming, LinkError};
use super::pool::{seed, Expect, Pool};
use super::proto::{Layout, Msg};

/// Who moves the blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// The decode rank reads from the prefill ranks.
    Pull,
    /// The prefill ranks write into blocks the decode rank lends them.
    Push,
}

/// What to do when a handle of a request fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Policy {
    /// kvpoll's contract: free the blocks when the failure is reported,
    /// i.e. once every handle stopped.
    Safe,
    /// The pre-fix behaviour, for comparison only (UNSAFE): free the blocks
    /// at the first handle failure, while siblings may still write.
    Eager,
}

/// Where the prefill ranks listen; a restarted rank gets a new address and
/// a bumped generation.
#[derive(Default)]
pub struct Registry {
    pub addrs: Mutex<Vec<(String, u64)>>,
    /// Process ids of the prefill ranks run as processes (for sampling).
    pub pids: Mutex<Vec<u32>>,
}

#[derive(Debug, Clone)]
pub struct DecodeConfig {
    pub rank: u32,
    pub prefill: [u32; 2],
    pub tls: String,
    pub blocks: u32,
    pub block_size: u64,
    pub layers: usize,
    pub requests: u64,
    pub window: usize,
    pub per_handle: u32,
    pub mode: Mode,
    pub policy: Policy,
    /// Every n-th request names a remote block that does not exist (0: never).
    pub setup_failure_every: u64,
    pub faults: Faults,
    pub deadline: Duration,
    pub lease: Duration,
    /// How long a finished request's blocks are held ("decoded") before
    /// they are checked again and freed.
    pub hold: Duration,
    pub give_up: Duration,
    /// How long a PREPARE may wait for its READY or BUSY before its
    /// request fails.
    pub answer_timeout: Duration,
    /// How long a prefill rank may stay unreachable before the run stops.
    pub give_up_after: Duration,
    /// Reads are confirmed and push leases are fences (false: timers,
    /// unsafe, for comparison).
    pub fence: bool,
    /// Once this many requests were reported, this rank's poller stalls
    /// for the given time (its transfers in flight stop moving).
    pub stall: Option<(u64, Duration)>,
    /// Once this many requests were reported, this rank's engine thread
    /// sleeps for the given time (it polls nothing).
    pub doze: Option<(u64, Duration)>,
    /// Where this rank publishes its rings' occupancy (commands and events
    /// waiting), about once a second, for the soak's samples.
    pub rings: Option<std::sync::Arc<AtomicU64>>,
    /// The deployment's key: the engine and the control links are keyed.
    pub auth: Option<kvpoll::auth::AuthKey>,
    /// Its rails, if any.
    pub rails: super::side::RailsSpec,
}

/// Injected faults that fired on a decode rank.
#[derive(Debug, Default, Clone, Copy)]
pub struct Fired {
    /// Handles that failed with a transfer error.
    pub transfer_errors: u64,
    /// Requests set up to name a block that does not exist.
    pub setup_failures: u64,
    /// Handle releases that failed (and were retried).
    pub release_failures: u64,
}

/// Failed requests by cause.
#[derive(Debug, Default, Clone, Copy)]
pub struct Causes {
    pub peer_lost: u64,
    pub peer_stalled: u64,
    pub deadline: u64,
    pub lease_lost: u64,
    pub other: u64,
    /// A prefill rank answered a PREPARE with a malformed READY.
    pub bad_answer: u64,
    /// A prefill rank did not answer a PREPARE in time.
    pub no_answer: u64,
}

impl Causes {
    fn count(&mut self, c: Cause) {
        match c {
            Cause::PeerLost => self.peer_lost += 1,
            Cause::PeerStalled => self.peer_stalled += 1,
            Cause::Deadline => self.deadline += 1,
            Cause::LeaseLost => self.lease_lost += 1,
            _ => self.other += 1,
        }
    }

    pub fn add(&mut self, o: &Causes) {
        self.peer_lost += o.peer_lost;
        self.peer_stalled += o.peer_stalled;
        self.deadline += o.deadline;
        self.lease_lost += o.lease_lost;
        self.other += o.other;
        self.bad_answer += o.bad_answer;
        self.no_answer += o.no_answer;
    }
}

#[derive(Debug, Default, Clone)]
pub struct DecodeReport {
    pub finished: u64,
    pub failed: u64,
    pub expired: u64,
    pub refused: u64,
    pub corrupted_blocks: u64,
    pub leaked_blocks: u64,
    pub bytes: u64,
    /// Request latency (issue to report) at p50, p90 and p99, in µs.
    pub latencies_us: Vec<u64>,
    /// The transfer's share of it as this rank sees it, at the same
    /// quantiles: pull, from `Engine::read` to the report; push, from the
    /// PUSH messages sent to the report.
    pub transfer_us: Vec<u64>,
    /// Pull only: from issue until both prefill ranks answered READY.
    pub control_us: Vec<u64>,
    /// The poller's busy and idle time, ns (`PollerStats`).
    pub busy_ns: u64,
    pub idle_ns: u64,
    pub seconds: f64,
    /// Requests this rank was to move.
    pub requests: u64,
    /// Failed requests by cause.
    pub causes: Causes,
    /// Why the run stopped before every request was reported, if it did.
    pub gave_up: Option<String>,
    /// Why the first request that a prefill rank answered wrongly (or not
    /// at all) failed.
    pub first_bad_answer: Option<String>,
    /// The first request the engine reported failed: its id, cause and
    /// the transport's status, and what a writer said of it (push).
    pub first_failure: Option<String>,
    /// Poller stalls and engine-thread sleeps this rank went through.
    pub stalls: u32,
    /// Injected faults that fired on this rank.
    pub faults: Fired,
    /// Reports of requests this rank was not waiting for (a duplicate, or
    /// one it never made): must stay 0.
    pub unexpected_reports: u64,
    /// Requests not read because a lend's lease may have run out before
    /// the read was posted (counted in `refused` too).
    pub lease_too_short: u64,
    /// Times this rank replaced its engine because its UCX worker went
    /// deaf (a prefill rank died inside a shared-memory send to it).
    pub engines_rebuilt: u32,
    /// Per rail (`--rail`, `--core-map`), what it carried; empty on one
    /// engine.
    pub rails: Vec<RailReport>,
}

/// What one rail carried for a decode rank (summed over its engines).
#[derive(Debug, Default, Clone)]
pub struct RailReport {
    /// Its network device.
    pub device: String,
    /// The CPU its poller is pinned to, if it is.
    pub core: Option<usize>,
    /// Bytes its poller moved.
    pub bytes: u64,
    /// Transfer operations its poller completed.
    pub operations: u64,
    /// Parts of reads it carried that ended well, and that failed.
    pub parts_finished: u64,
    pub parts_failed: u64,
    /// Times one of its links was left out after a failure of the link.
    pub links_down: u64,
    /// Lost peers added again to it.
    pub relinks: u64,
}

impl RailReport {
    /// Adds `from`'s rail `i` to `to`'s rail `i`, rail by rail.
    pub fn add_all(to: &mut Vec<RailReport>, from: &[RailReport]) {
        for (i, x) in from.iter().enumerate() {
            if to.len() <= i {
                to.push(RailReport {
                    device: x.device.clone(),
                    core: x.core,
                    ..RailReport::default()
                });
            }
            let t = &mut to[i];
            t.bytes += x.bytes;
            t.operations += x.operations;
            t.parts_finished += x.parts_finished;
            t.parts_failed += x.parts_failed;
            t.links_down += x.links_down;
            t.relinks += x.relinks;
        }
    }
}

struct Link {
    stream: Option<TcpStream>,
    /// The open connection's framing.
    session: Session,
    peer: Option<PeerId>,
    generation: u64,
    /// Connections made so far; tags of its reader's events.
    epoch: usize,
    /// Retry state: when to try next, the current backoff, attempts failed
    /// since the link was last up, since when it is down and why.
    next_try: Instant,
    backoff: Duration,
    attempts: u32,
    down_since: Instant,
    last_error: String,
}

impl Link {
    fn new() -> Link {
        Link {
            stream: None,
            session: Session::none(),
            peer: None,
            generation: u64::MAX,
            epoch: 0,
            next_try: Instant::now(),
            backoff: BACKOFF_FIRST,
            attempts: 0,
            down_since: Instant::now(),
            last_error: String::new(),
        }
    }

    fn down(&mut self, why: String) {
        if let Some(s) = self.stream.take() {
            // Its reader thread holds a clone: shut the socket itself.
            let _ = s.shutdown(std::net::Shutdown::Both);
            self.down_since = Instant::now();
        }
        self.peer = None;
        self.last_error = why;
    }
}

/// Idle rounds of the decode loop that only yield before it blocks.
const YIELDS: u32 = 4;
/// The longest block in `Engine::wait` (reports and control messages wake
/// it; this bounds how late the loop sees a timer: a link's retry, the stop
/// flag).
const IDLE_WAIT: Duration = Duration::from_millis(10);
/// The decode thread's timer slack, in ns (Linux's default is 50 µs): a
/// block release due in a few tens of µs is not overslept.
const NAP_SLACK_NS: libc::c_ulong = 1_000;

/// First retry delay after a failed attempt; it doubles up to the cap.
const BACKOFF_FIRST: Duration = Duration::from_millis(50);
const BACKOFF_CAP: Duration = Duration::from_secs(2);

/// `d` scaled by a random factor in [0.5, 1): retries of many clients do
/// not fall into step.
fn jitter(d: Duration, rng: &mut u64) -> Duration {
    // xorshift64: enough to spread retries, no dependency.
    *rng ^= *rng << 13;
    *rng ^= *rng >> 7;
    *rng ^= *rng << 17;
    let f = 0.5 + (*rng >> 11) as f64 / (1u64 << 53) as f64 / 2.0;
    d.mul_f64(f)
}

/// Where a request id's run tag begins (see `Decoder::run_tag`).
const RUN_TAG_SHIFT: u32 = 48;

/// A seed from the clock and the process id (odd: never 0 for xorshift).
fn seed_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
        ^ (u64::from(std::process::id()) << 32)
        | 1
}

/// splitmix64's finalizer: every bit of `x` moves every bit of the result
/// (the clock's top bits barely change between runs).
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

struct Req {
    blocks: Vec<BlockId>,
    ready: [Option<Vec<u32>>; 2],
    /// Each lender's lend incarnation, from its READY.
    lends: [kvpoll::Incarnation; 2],
    /// Until when each lender's lend is sure to be live (counted down from
    /// the lease it reported, from when its answer arrived).
    live_until: [Option<Instant>; 2],
    submitted: bool,
    freed: bool,
    /// Issued (PREPARE or the lend and PUSH sent).
    t0: Instant,
    /// Pull: both READY in; push: PUSH sent.
    t_ready: Option<Instant>,
    /// The transfer started (read submitted; PUSH sent).
    t_transfer: Option<Instant>,
    /// Push: a writer answered that its write was refused or failed.
    writer_said: Option<String>,
}

struct Decoder<'a> {
    cfg: &'a DecodeConfig,
    /// Requests reported, however they ended (for the demo's progress).
    progress: &'a AtomicU64,
    engine: Side,
    pool: Pool,
    links: [Link; 2],
    reqs: HashMap<u64, Req>,
    holding: VecDeque<(Instant, Vec<BlockId>)>,
    report: DecodeReport,
    tx: mpsc::Sender<Incoming>,
    rx: mpsc::Receiver<Incoming>,
    /// A control event taken while waiting, handled next.
    buf: Vec<u8>,
    hist: Histogram<u64>,
    hist_transfer: Histogram<u64>,
    hist_control: Histogram<u64>,
    rng: u64,
    /// The top 16 bits of every request id of this run (rank and sequence
    /// number below them), drawn at its start: a prefill rank may still
    /// hold lends for an earlier run's requests (a reader killed
    /// mid-read), and answers BUSY to a request id it holds.
    run_tag: u64,
}

pub fn run(
    cfg: &DecodeConfig,
    registry: &Registry,
    progress: &AtomicU64,
    stop: &dyn Fn() -> bool,
) -> Result<DecodeReport, RunError> {
    let engine = start_engine(cfg)?;
    let (tx, rx) = mpsc::channel();
    let mut d = Decoder {
        cfg,
        progress,
        engine,
        pool: Pool::new(cfg.blocks),
        links: [Link::new(), Link::new()],
        reqs: HashMap::new(),
        holding: VecDeque::new(),
        report: DecodeReport {
            requests: cfg.requests,
            ..DecodeReport::default()
        },
        tx,
        rx,

        buf: vec![0u8; cfg.block_size as usize],
        hist: Histogram::new(3).map_err(|_| RunError::Stuck("latency histogram"))?,
        hist_transfer: Histogram::new(3).map_err(|_| RunError::Stuck("latency histogram"))?,
        hist_control: Histogram::new(3).map_err(|_| RunError::Stuck("latency histogram"))?,
        rng: seed_now(),
        run_tag: mix(seed_now()) & !((1 << RUN_TAG_SHIFT) - 1),
    };
    // Naps below are a few tens of µs: without this, each oversleeps by the
    // default 50 µs timer slack.
    // SAFETY: PR_SET_TIMERSLACK changes only the calling thread's slack.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, NAP_SLACK_NS, 0, 0, 0) };
    let start = Instant::now();
    let mut issued = 0u64;
    let mut idle_rounds = 0u32;
    let mut out = Outcomes::default();
    let (mut stall_done, mut doze_done) = (false, false);
    let mut last_rings = Instant::now();
    let mut draining: Option<Instant> = None;
    loop {
        if d.engine.is_deaf() {
            d.rebuild()?;
        }
        d.reconnect(registry);
        let issued_before = issued;
        while draining.is_none()
            && issued < cfg.requests
            && d.reqs.len() < cfg.window
            && d.links_up()
        {
            if !d.issue(issued) {
                break;
            }
            issued += 1;
        }
        let heard = d.handle_links();
        d.expire_answers();
        out.clear();
        // After a few idle rounds, block until a report, a control message
        // (its reader thread wakes the engine's waiter) or the next timer.
        let block = if idle_rounds > YIELDS {
            d.idle_timeout()
        } else {
            Duration::ZERO
        };
        d.engine.wait(&mut out, block);
        d.handle_outcomes(&out);
        let released = d.release_due(false);
        let busy = issued != issued_before || heard || !out.is_empty() || released;
        let reported = progress_of(&d.report);
        if let Some((_, how_long)) = cfg.stall.filter(|&(at, _)| reported >= at && !stall_done) {
            // A hung poller: nothing of this rank moves for a while.
            if d.engine.stall(how_long).is_ok() {
                d.report.stalls += 1;
            }
            stall_done = true;
        }
        if let Some((_, how_long)) = cfg.doze.filter(|&(at, _)| reported >= at && !doze_done) {
            // A slow scheduler step: the engine thread polls nothing.
            std::thread::sleep(how_long);
            d.report.stalls += 1;
            doze_done = true;
        }
        let all_done = issued >= cfg.requests && d.reqs.is_empty();
        if draining.is_none() && stop() {
            // Stopped (a signal): issue nothing more, give back what never
            // reached the engine, and let what is in flight end (its
            // deadline bounds it) so that nothing is left held.
            d.drain();
            draining = Some(Instant::now() + cfg.lease * 2 + Duration::from_secs(1));
        }
        let drained = draining.is_some_and(|t| d.reqs.is_empty() || Instant::now() >= t);
        if all_done || drained || d.report.gave_up.is_some() {
            break;
        }
        if start.elapsed() > cfg.give_up {
            d.report.gave_up = Some(format!(
                "time limit of {} s reached with {} of {} requests reported",
                cfg.give_up.as_secs(),
                progress_of(&d.report),
                cfg.requests
            ));
            break;
        }
        if let Some(rings) = &cfg.rings {
            if last_rings.elapsed() >= Duration::from_secs(1) {
                let m = d.engine.metrics();
                rings.store(m.rings.iter().map(|r| r.occupancy).sum(), Ordering::Relaxed);
                last_rings = Instant::now();
            }
        }
        if busy {
            idle_rounds = 0;
        } else {
            idle_rounds += 1;
            if idle_rounds <= YIELDS {
                // A loaded CPU loses nothing to these.
                std::thread::yield_now();
            }
        }
    }
    d.release_due(true);
    // Requests still open (give-up or stop) keep their blocks: leaked.
    d.report.seconds = start.elapsed().as_secs_f64();
    d.report.leaked_blocks = u64::from(d.pool.total() - d.pool.free());
    d.count_engine();
    d.engine.shutdown();
    let mut out = Outcomes::default();
    d.engine.poll(&mut out);
    let quantiles = |h: &Histogram<u64>| {
        [0.5, 0.9, 0.99]
            .iter()
            .map(|&q| h.value_at_quantile(q))
            .collect()
    };
    d.report.latencies_us = quantiles(&d.hist);
    d.report.transfer_us = quantiles(&d.hist_transfer);
    d.report.control_us = quantiles(&d.hist_control);
    Ok(d.report)
}

/// A decode rank's engine (one per rail, with rails) with its layers
/// registered.
fn start_engine(cfg: &DecodeConfig) -> Result<Side, RunError> {
    let builder = Engine::builder()
        .block_size(cfg.block_size)
        .ucx(ContextOptions::with_transports(&cfg.tls))
        .read_deadline(cfg.deadline)
        .confirm_reads(cfg.fence)
        .fence_push_leases(cfg.fence)
        .faults(cfg.faults)
        .auth_key(cfg.auth.clone());
    Side::start(builder, &cfg.rails, cfg.layers, cfg.blocks)
}

impl Decoder<'_> {
    /// Adds the engine's poller time and failure counters to the report
    /// (once per engine: at its replacement and at the end).
    fn count_engine(&mut self) {
        let (busy, idle) = self.engine.busy_idle();
        let m = self.engine.metrics();
        self.report.faults.transfer_errors += m.handle_failures.transfer;
        self.report.faults.release_failures += m.release_failures;
        self.report.busy_ns += busy;
        self.report.idle_ns += idle;
        let rails: Vec<RailReport> = self
            .engine
            .rail_stats()
            .into_iter()
            .map(|r| RailReport {
                device: r.device.unwrap_or_default(),
                core: r.core,
                bytes: r.poller.bytes_moved,
                operations: r.poller.ops_completed,
                parts_finished: r.parts_finished,
                parts_failed: r.parts_failed,
                links_down: r.links_down,
                relinks: r.relinks,
            })
            .collect();
        RailReport::add_all(&mut self.report.rails, &rails);
    }

    /// Replaces a deaf engine (its UCX worker hears nothing more: a prefill
    /// rank died inside a shared-memory send to it) with a new one, as
    /// `serve` does. What the old engine had in flight is cancelled by its
    /// shutdown and reported once, as any outcome (a finished request's
    /// blocks are checked); requests it never had (pull: waiting for
    /// READY) are refused. The blocks held for decoding are checked one
    /// last time while the old regions are still mapped, and every block
    /// goes back to the pool, whose indices name the new engine's regions.
    /// Every control link is dropped: reconnecting, each prefill rank is
    /// given the new engine's metadata and the new engine adds it anew.
    fn rebuild(&mut self) -> Result<(), RunError> {
        tracing::warn!(
            rank = self.cfg.rank,
            in_flight = self.reqs.len(),
            "this rank's UCX worker stopped hearing (a prefill rank died inside a shared-memory \
             send to it): replacing the engine"
        );
        let engine = start_engine(self.cfg)?;
        self.count_engine();
        self.engine.shutdown();
        let mut out = Outcomes::default();
        self.engine.poll(&mut out);
        self.handle_outcomes(&out);
        let never_started: Vec<u64> = self.reqs.keys().copied().collect();
        for id in never_started {
            if let Some(r) = self.reqs.remove(&id) {
                if !r.freed {
                    self.pool.release(&r.blocks);
                }
                self.report.refused += 1;
                self.progress.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.release_due(true);
        drop(std::mem::replace(&mut self.engine, engine));
        let now = Instant::now();
        for link in &mut self.links {
            link.down("this rank replaced its engine".into());
            link.next_try = now;
            link.backoff = BACKOFF_FIRST;
            link.attempts = 0;
            link.down_since = now;
        }
        self.report.engines_rebuilt += 1;
        tracing::warn!(
            rank = self.cfg.rank,
            "transferring with a new engine; the prefill ranks learn its metadata"
        );
        Ok(())
    }

    fn links_up(&self) -> bool {
        self.links
            .iter()
            .all(|l| l.stream.is_some() && l.peer.is_some())
    }

    /// (Re)connects to a prefill rank that is down or has a new address,
    /// backing off exponentially (with jitter) between failed attempts;
    /// gives up when one stayed unreachable for `give_up_after`.
    fn reconnect(&mut self, registry: &Registry) {
        let addrs = match registry.addrs.lock() {
            Ok(a) => a.clone(),
            Err(_) => return,
        };
        let ours = Layout {
            block_size: self.cfg.block_size,
            layers: self.cfg.layers as u32,
            blocks: self.cfg.blocks,
        };
        for i in 0..2 {
            let rank = self.cfg.prefill[i];
            let Some((addr, generation)) = addrs.get(rank as usize) else {
                continue;
            };
            let link = &mut self.links[i];
            if link.generation != *generation {
                // A new address: try it at once, afresh.
                if link.stream.is_some() {
                    link.down("the rank was restarted".into());
                }
                link.generation = *generation;
                link.next_try = Instant::now();
                link.backoff = BACKOFF_FIRST;
            }
            if link.stream.is_some() || Instant::now() < link.next_try {
                continue;
            }
            let tried = link::handshake(addr, ours, self.cfg.auth.as_ref()).and_then(|o| {
                let peer = self
                    .engine
                    .add_lender(&o.meta)
                    .map_err(|e| LinkError::Refused(format!("its metadata: {e}")))?;
                Ok((o.stream, o.session, peer))
            });
            let link = &mut self.links[i];
            let result = tried.and_then(|(mut stream, session, peer)| {
                let meta = self
                    .engine
                    .local_metadata()
                    .map_err(|e| LinkError::Refused(format!("our metadata: {e}")))?;
                control::send_in(&mut stream, &session, &Msg::Meta(meta))
                    .map_err(LinkError::Write)?;
                link.epoch += 1;
                link::spawn_reader(
                    &stream,
                    &session,
                    i + 2 * link.epoch,
                    self.tx.clone(),
                    None,
                    Some(self.engine.waker()),
                )
                .map_err(LinkError::Connect)?;
                Ok((stream, session, peer))
            });
            match result {
                Ok((stream, session, peer)) => {
                    if link.attempts > 0 {
                        tracing::info!(
                            rank,
                            addr,
                            attempts = link.attempts,
                            "prefill rank reached"
                        );
                    }
                    link.stream = Some(stream);
                    link.session = session;
                    link.peer = Some(peer);
                    link.attempts = 0;
                    link.backoff = BACKOFF_FIRST;
                }
                Err(e) => {
                    link.attempts += 1;
                    let wait = jitter(link.backoff, &mut self.rng);
                    link.backoff = (link.backoff * 2).min(BACKOFF_CAP);
                    link.next_try = Instant::now() + wait;
                    link.last_error = e.to_string();
                    let down = link.down_since.elapsed();
                    let stop = e.is_permanent() || down >= self.cfg.give_up_after;
                    if stop {
                        tracing::warn!(
                            rank,
                            addr,
                            attempt = link.attempts,
                            "connecting to prefill rank {rank} at {addr} failed: {e}; giving up"
                        );
                    } else {
                        tracing::warn!(
                        rank,
                        addr,
                        attempt = link.attempts,
                        "connecting to prefill rank {rank} at {addr} failed: {e}; retrying in {} ms",
                            wait.as_millis()
                        );
                    }
                    if stop {
                        self.report.gave_up = Some(format!(
                            "gave up on prefill rank {rank} at {addr} after {:.1} s and {} attempts: {e}",
                            down.as_secs_f64(),
                            link.attempts
                        ));
                    }
                }
            }
        }
    }

    fn issue(&mut self, seq: u64) -> bool {
        let h = self.cfg.per_handle as usize;
        let mut blocks = Vec::with_capacity(2 * h);
        if !self.pool.alloc(2 * h, &mut blocks) {
            return false;
        }
        let id = self.run_tag | (u64::from(self.cfg.rank) << 40) | seq;
        let mut req = Req {
            blocks,
            ready: [None, None],
            lends: [kvpoll::Incarnation::NONE; 2],
            live_until: [None, None],
            submitted: false,
            freed: false,
            t0: Instant::now(),
            t_ready: None,
            t_transfer: None,
            writer_said: None,
        };
        match self.cfg.mode {
            Mode::Pull => {
                for l in &mut self.links {
                    if let Some(s) = &mut l.stream {
                        link::send(
                            s,
                            &l.session,
                            &Msg::Prepare {
                                req: id,
                                n: h as u32,
                            },
                        );
                    }
                }
            }
            Mode::Push => {
                // Name the writers when both are known: the lease is then a
                // fence (the blocks wait for each writer's word or loss).
                let writers: Vec<PeerId> = self.links.iter().filter_map(|l| l.peer).collect();
                // Rails carry no receives (connect refuses push with them).
                let lent = self.engine.one("push").ok().and_then(|e| {
                    if writers.len() == self.links.len() {
                        e.receive_from(RequestId(id), &req.blocks, &writers, self.cfg.lease)
                            .ok()
                    } else {
                        e.receive(RequestId(id), &req.blocks, 2, self.cfg.lease)
                            .ok()
                    }
                });
                let Some(lend) = lent else {
                    self.pool.release(&req.blocks);
                    self.report.refused += 1;
                    return true;
                };
                let sabotage = self.cfg.setup_failure_every != 0
                    && seq % self.cfg.setup_failure_every == 7 % self.cfg.setup_failure_every;
                if sabotage {
                    self.report.faults.setup_failures += 1;
                }
                for (i, l) in self.links.iter_mut().enumerate() {
                    let mut half: Vec<u32> =
                        req.blocks[i * h..(i + 1) * h].iter().map(|b| b.0).collect();
                    if sabotage && i == 0 {
                        half[0] = u32::MAX - 1; // no such block: the write's setup fails
                    }
                    if let Some(s) = &mut l.stream {
                        link::send(
                            s,
                            &l.session,
                            &Msg::Push {
                                req: id,
                                lend: lend.0,
                                blocks: half,
                            },
                        );
                    }
                }
                let now = Instant::now();
                req.t_ready = Some(now);
                req.t_transfer = Some(now);
            }
        }
        self.reqs.insert(id, req);
        true
    }

    /// How long an idle round may block in `Engine::wait`: until the next
    /// block release or link retry, at most [`IDLE_WAIT`]. Reports and
    /// control messages wake it sooner.
    fn idle_timeout(&self) -> Duration {
        let now = Instant::now();
        let release = self.holding.front().map(|(due, _)| *due);
        let retry = self
            .links
            .iter()
            .filter(|l| l.stream.is_none())
            .map(|l| l.next_try);
        release
            .into_iter()
            .chain(retry)
            .map(|t| t.saturating_duration_since(now))
            .fold(IDLE_WAIT, Duration::min)
            .max(Duration::from_micros(1))
    }

    /// Handles the control events that arrived; whether there were any.
    fn handle_links(&mut self) -> bool {
        let mut heard = false;
        while let Ok(inc) = self.rx.try_recv() {
            heard = true;
            match inc {
                // Events of an earlier connection of a link are stale.
                Incoming::Line(t, _) | Incoming::Bad(t, _) | Incoming::Closed(t)
                    if t / 2 != self.links[t % 2].epoch =>
                {
                    continue
                }
                Incoming::Line(
                    t,
                    Msg::Ready {
                        req,
                        lease_ms,
                        lend,
                        blocks,
                    },
                ) => self.ready(t % 2, req, lease_ms, kvpoll::Incarnation(lend), blocks),
                Incoming::Line(_, Msg::Busy { req }) => self.abandon(req),
                // A writer that refused or failed: nothing more comes.
                Incoming::Line(t, Msg::Pushed { req, done: false }) => {
                    self.said_not_pushed(t % 2, req);
                    self.abandon(req)
                }
                Incoming::Line(t, Msg::Refused(why)) => {
                    let i = t % 2;
                    tracing::warn!(rank = self.cfg.prefill[i], "prefill rank refused: {why}");
                }
                Incoming::Line(_, _) => {}
                Incoming::Bad(t, why) => {
                    let i = t % 2;
                    tracing::warn!(rank = self.cfg.prefill[i], "control link lost: {why}");
                    self.link_lost(i, why);
                }
                Incoming::Closed(t) => {
                    self.link_lost(t % 2, "connection closed by peer".into());
                }
            }
        }
        heard
    }

    /// Link `i` is gone: requests still waiting for its blocks never get
    /// them.
    fn link_lost(&mut self, i: usize, why: String) {
        self.links[i].down(why);
        let waiting: Vec<u64> = self
            .reqs
            .iter()
            .filter(|(_, r)| !r.submitted && r.ready[i].is_none())
            .map(|(&id, _)| id)
            .collect();
        for id in waiting {
            self.abandon(id);
        }
    }

    /// Prefill rank `i` answered that its write of request `id` was
    /// refused or failed: the request's failure says so.
    fn said_not_pushed(&mut self, i: usize, id: u64) {
        let rank = self.cfg.prefill[i];
        if let Some(r) = self.reqs.get_mut(&id) {
            r.writer_said
                .get_or_insert_with(|| format!(" (prefill rank {rank} answered PUSHED not done)"));
        }
    }

    /// A request that never reached the engine: its blocks go back at
    /// once, and the prefill ranks that lent for it are told to release
    /// (rather than hold those blocks until the lease ends: a rank that
    /// answered BUSY leaves the other one's lend behind).
    fn abandon(&mut self, id: u64) {
        if self.cfg.mode == Mode::Push {
            // The lend is in the engine: abort it; the report frees it.
            let _ = self.engine.abort(RequestId(id));
            return;
        }
        if self.reqs.get(&id).is_some_and(|r| !r.submitted) {
            self.release_lends(id);
            if let Some(r) = self.reqs.remove(&id) {
                self.pool.release(&r.blocks);
                self.report.refused += 1;
            }
        }
    }

    /// Gives back the blocks of every request not in the engine yet, and
    /// tells the ranks that lent for them to release.
    fn drain(&mut self) {
        let waiting: Vec<u64> = self
            .reqs
            .iter()
            .filter(|(_, r)| !r.submitted)
            .map(|(&id, _)| id)
            .collect();
        for id in waiting {
            self.abandon(id);
        }
    }

    /// Tells the prefill ranks that answered READY for request `id` (not
    /// read) to release their lends now rather than at their lease's end.
    fn release_lends(&mut self, id: u64) {
        let Some(r) = self.reqs.get(&id) else {
            return;
        };
        let lenders: Vec<(PeerId, kvpoll::Incarnation)> = (0..2)
            .filter(|&j| r.ready[j].is_some())
            .filter_map(|j| self.links[j].peer.map(|p| (p, r.lends[j])))
            .collect();
        if !lenders.is_empty() {
            let _ = self.engine.notify_only(RequestId(id), &lenders);
        }
    }

    /// Fails every PREPARE that waited longer than the answer timeout.
    fn expire_answers(&mut self) {
        if self.cfg.mode != Mode::Pull {
            return;
        }
        let late: Vec<(u64, usize)> = self
            .reqs
            .iter()
            .filter(|(_, r)| !r.submitted && r.t0.elapsed() >= self.cfg.answer_timeout)
            .filter_map(|(&id, r)| r.ready.iter().position(|x| x.is_none()).map(|i| (id, i)))
            .collect();
        for (id, i) in late {
            let why = format!(
                "no answer to PREPARE from prefill rank {} within {} ms",
                self.cfg.prefill[i],
                self.cfg.answer_timeout.as_millis()
            );
            self.fail_answer(id, why, false);
        }
    }

    /// A prefill rank answered request `id` wrongly (`bad`) or not at all:
    /// it fails now, with `why`, and the ranks that did lend for it are
    /// told to release.
    fn fail_answer(&mut self, id: u64, why: String, bad: bool) {
        self.release_lends(id);
        let Some(r) = self.reqs.remove(&id) else {
            return;
        };
        self.pool.release(&r.blocks);
        self.progress.fetch_add(1, Ordering::Relaxed);
        self.report.failed += 1;
        if bad {
            self.report.causes.bad_answer += 1;
        } else {
            self.report.causes.no_answer += 1;
        }
        if self.report.first_bad_answer.is_none() {
            tracing::warn!(rank = self.cfg.rank, "request {id:#x} failed: {why}");
            self.report.first_bad_answer = Some(why);
        } else {
            tracing::debug!(rank = self.cfg.rank, "request {id:#x} failed: {why}");
        }
    }

    fn ready(
        &mut self,
        i: usize,
        id: u64,
        lease_ms: u32,
        lend: kvpoll::Incarnation,
        remote: Vec<u32>,
    ) {
        let h = self.cfg.per_handle as usize;
        let Some(r) = self.reqs.get_mut(&id) else {
            // Late (its request failed already): release the lend now.
            if let Some(p) = self.links[i].peer {
                let _ = self.engine.notify_only(RequestId(id), &[(p, lend)]);
            }
            return;
        };
        if r.submitted || r.ready[i].is_some() {
            return;
        }
        if remote.len() != h {
            let why = format!(
                "prefill rank {} answered READY with {} blocks, {h} asked for",
                self.cfg.prefill[i],
                remote.len()
            );
            // It lent something: it is told to release too.
            r.ready[i] = Some(remote);
            r.lends[i] = lend;
            return self.fail_answer(id, why, true);
        }
        r.ready[i] = Some(remote);
        r.lends[i] = lend;
        let now = Instant::now();
        r.live_until[i] = Some(now + Duration::from_millis(u64::from(lease_ms)));
        if r.ready.iter().any(|x| x.is_none()) {
            return;
        }
        r.t_ready = Some(now);
        let (Some(p0), Some(p1)) = (self.links[0].peer, self.links[1].peer) else {
            return self.abandon(id);
        };
        // Never post against a lend whose lease may have run out: with a
        // tenth of it left (its answer may have been late, our clock is not
        // its clock), tell both lenders to release instead.
        let margin = self.cfg.lease / 20;
        let left = r
            .live_until
            .iter()
            .flatten()
            .min()
            .map_or(Duration::ZERO, |t| {
                t.saturating_duration_since(Instant::now())
            });
        if left <= margin {
            self.report.lease_too_short += 1;
            return self.abandon(id);
        }
        let mut remote: Vec<Vec<BlockId>> = r
            .ready
            .iter()
            .map(|x| x.iter().flatten().map(|&b| BlockId(b)).collect())
            .collect();
        let seq = id & ((1 << 40) - 1);
        if self.cfg.setup_failure_every != 0
            && seq % self.cfg.setup_failure_every == 7 % self.cfg.setup_failure_every
        {
            remote[0][0] = BlockId(u32::MAX - 1); // no such block: a setup failure
            self.report.faults.setup_failures += 1;
        }
        let t = [
            Transfer {
                peer: p0,
                local: &r.blocks[..h],
                remote: &remote[0],
                lend: r.lends[0],
            },
            Transfer {
                peer: p1,
                local: &r.blocks[h..],
                remote: &remote[1],
                lend: r.lends[1],
            },
        ];
        let t_read = Instant::now();
        match self.engine.read(RequestId(id), &t) {
            Ok(()) => {
                r.submitted = true;
                r.t_transfer = Some(t_read);
            }
            Err(_) => self.abandon(id),
        }
    }

    fn handle_outcomes(&mut self, out: &Outcomes) {
        let progress = self.progress;
        let h = self.cfg.per_handle as usize;
        for &(id, _, _) in &out.handle_failures {
            if self.cfg.policy == Policy::Eager && self.cfg.mode == Mode::Pull {
                // UNSAFE by design: the blocks go back while a sibling
                // handle may still be writing into them.
                if let Some(r) = self.reqs.get_mut(&id.0) {
                    if !r.freed {
                        r.freed = true;
                        self.pool.release(&r.blocks);
                    }
                }
            }
        }
        for id in &out.finished_recving {
            let Some(r) = self.reqs.remove(&id.0) else {
                self.report.unexpected_reports += 1;
                continue;
            };
            progress.fetch_add(1, Ordering::Relaxed);
            if r.freed {
                continue; // eager already gave its blocks away
            }
            self.report.finished += 1;
            self.report.bytes +=
                r.blocks.len() as u64 * self.cfg.block_size * self.cfg.layers as u64;
            let now = Instant::now();
            let us = |from: Instant| (now - from).as_micros() as u64;
            let _ = self.hist.record(us(r.t0));
            if let Some(t) = r.t_transfer {
                let _ = self.hist_transfer.record(us(t));
            }
            if let (Mode::Pull, Some(t)) = (self.cfg.mode, r.t_ready) {
                let _ = self
                    .hist_control
                    .record(t.saturating_duration_since(r.t0).as_micros() as u64);
            }
            for (k, &b) in r.blocks.iter().enumerate() {
                let side = k / h;
                let e = Expect::Pattern {
                    req: id.0,
                    rank: self.cfg.prefill[side],
                    index: (k % h) as u32,
                };
                self.pool.set_expect(b, e);
                if !self.check(b) {
                    self.report.corrupted_blocks += 1;
                }
            }
            self.holding
                .push_back((Instant::now() + self.cfg.hold, r.blocks));
        }
        for f in &out.failed_recving {
            let Some(r) = self.reqs.remove(&f.id.0) else {
                self.report.unexpected_reports += 1;
                continue;
            };
            progress.fetch_add(1, Ordering::Relaxed);
            self.report.failed += 1;
            self.report.causes.count(f.reason.cause);
            let why = format!(
                "request {:#x}: {:?}, status {}{}",
                f.id.0,
                f.reason.cause,
                f.reason.status.name(),
                r.writer_said.as_deref().unwrap_or("")
            );
            tracing::debug!(rank = self.cfg.rank, "{why}");
            self.report.first_failure.get_or_insert(why);
            if !r.freed {
                // Safe: every handle stopped; nothing can land any more.
                self.pool.release(&r.blocks);
            }
        }
        for id in &out.expired {
            let Some(r) = self.reqs.remove(&id.0) else {
                self.report.unexpected_reports += 1;
                continue;
            };
            progress.fetch_add(1, Ordering::Relaxed);
            self.report.expired += 1;
            if !r.freed {
                self.pool.release(&r.blocks);
            }
        }
    }

    /// Whether block `b` holds what it is expected to, in every layer.
    fn check(&mut self, b: BlockId) -> bool {
        let Expect::Pattern { req, rank, index } = self.pool.expect(b) else {
            return true;
        };
        (0..self.cfg.layers).all(|layer| {
            self.engine.read_block(layer, b, &mut self.buf).is_ok()
                && kvpoll_cli::pattern::check(seed(req, layer, rank), u64::from(index), &self.buf)
        })
    }

    /// Gives back held blocks whose time is up (all, at the end), checking
    /// them once more: a change since arrival is a late write.
    fn release_due(&mut self, all: bool) -> bool {
        let now = Instant::now();
        let mut released = false;
        while let Some((due, _)) = self.holding.front() {
            if !all && *due > now {
                break;
            }
            let Some((_, blocks)) = self.holding.pop_front() else {
                break;
            };
            for &b in &blocks {
                if !self.check(b) {
                    self.report.corrupted_blocks += 1;
                }
            }
            self.pool.release(&blocks);
            released = true;
        }
        released
    }
}

/// Requests reported so far, however they ended.
pub fn progress_of(r: &DecodeReport) -> u64 {
    r.finished + r.failed + r.expired + r.refused
}
