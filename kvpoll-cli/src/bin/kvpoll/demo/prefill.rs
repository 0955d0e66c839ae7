//! A prefill rank (`kvpoll serve`): an engine with a block pool that fills
//! blocks for each request and lends them to decode readers (pull) or
//! writes them into decode blocks (push).

use std::collections::HashMap;
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[allow(unused_imports)]
use crate::faults::*;
use kvpoll::metrics::MetricsSnapshot;
use kvpoll::{BlockId, ContextOptions, Engine, Outcomes, PeerId, RequestId, Transfer};

use super::side::Side;
use kvpoll_cli::RunError;

use super::door::{self, ToEngine};
use super::pool::{seed, Pool};
use super::proto::{Layout, Msg};

#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub rank: u32,
    pub tls: String,
    pub blocks: u32,
    pub block_size: u64,
    pub layers: usize,
    /// Lease of a lend or a push.
    pub lease: Duration,
    pub faults: Faults,
    /// Fault injection over the control port (`STALL`) is taken only when
    /// set (`serve --testing`).
    pub testing: bool,
    /// The control port's bounds.
    pub limits: door::Limits,
    /// Where to publish the engine's metrics (`serve --metrics`), about
    /// every 100 ms.
    pub metrics: Option<Arc<Mutex<MetricsSnapshot>>>,
    /// The deployment's key: the engine and the control port are keyed.
    pub auth: Option<kvpoll::auth::AuthKey>,
    /// Its rails, if any.
    pub rails: super::side::RailsSpec,
}

/// How often a serving rank refreshes its published metrics.
const METRICS_EVERY: Duration = Duration::from_millis(100);

/// The longest stall a `--testing` server accepts.
const MAX_STALL: Duration = Duration::from_secs(60);

struct Held {
    blocks: Vec<BlockId>,
    /// The connection to answer for a push.
    push_conn: Option<usize>,
    /// When the lend or write was submitted.
    since: Instant,
}

/// Serves decode ranks on `listener` until `stop` says so; `ready` runs
/// once the engine is up and the control port is served.
pub fn serve(
    listener: TcpListener,
    cfg: ServeConfig,
    stop: impl Fn() -> bool,
    ready: impl FnOnce(),
) -> Result<(), RunError> {
    let (mut engine, meta) = start_engine(&cfg)?;
    let ours = Layout {
        block_size: cfg.block_size,
        layers: cfg.layers as u32,
        blocks: cfg.blocks,
    };
    if Msg::Meta(meta.clone()).encode().is_err() {
        return Err(RunError::Stuck(
            "engine metadata does not fit in a control frame: fewer layers",
        ));
    }
    let door = door::start(
        listener,
        ours,
        meta,
        cfg.auth.clone(),
        cfg.testing,
        cfg.limits,
        cfg.rank,
    )
    .map_err(|_| RunError::Stuck("the control port cannot be served"))?;

    let mut pool = Pool::new(cfg.blocks);
    // The peer of each connection that sent its metadata.
    let mut peers: HashMap<usize, PeerId> = HashMap::new();
    let mut held: HashMap<u64, Held> = HashMap::new();
    let mut out = Outcomes::default();
    let mut buf = vec![0u8; cfg.block_size as usize];
    let mut alloc = Vec::new();
    // Outcomes and latencies seen here; the engine's own counters are read
    // at each refresh.
    let mut tally = MetricsSnapshot::default();
    let mut published: Option<Instant> = None;
    let mut stats_at: Option<Instant> = None;
    ready();
    while !stop() {
        if let Some(m) = &cfg.metrics {
            if published.is_none_or(|t| t.elapsed() >= METRICS_EVERY) {
                publish(&engine, &tally, m);
                published = Some(Instant::now());
            }
        }
        if stats_at.is_none_or(|t| t.elapsed() >= STATS_EVERY) {
            door.publish(stats(&engine, &pool));
            stats_at = Some(Instant::now());
        }
        // What arrived, up to a turn's worth, then the engine; wait a little
        // only when there was nothing. Bounded: messages that keep
        // arriving while one is handled (a destination refilling its
        // window as each push lands, while this thread fills the next
        // push's blocks) would otherwise keep the engine from being
        // polled, and the blocks of the writes that ended from coming
        // back, until the pool ran dry.
        let mut next = door.rx.recv_timeout(Duration::from_micros(500)).ok();
        let mut taken = 0;
        while let Some(inc) = next.take() {
            taken += 1;
            if taken < MESSAGES_PER_TURN {
                next = door.rx.try_recv().ok();
            }
            match inc {
                ToEngine::Closed(tag) => {
                    if let Some(p) = peers.remove(&tag) {
                        let _ = engine.remove_peer(p);
                    }
                }
                ToEngine::Msg(tag, m) => {
                    let mut at = Rank {
                        engine: &mut engine,
                        cfg: &cfg,
                        pool: &mut pool,
                        peers: &mut peers,
                        held: &mut held,
                        buf: &mut buf,
                        alloc: &mut alloc,
                    };
                    if let Some(r) = at.handle(tag, m) {
                        door.reply(tag, r);
                    }
                    // The pool moved: STATS sees it now.
                    door.publish(stats(&engine, &pool));
                }
            }
        }
        if engine.is_deaf() {
            engine = rebuild(engine, &cfg, &door, &mut pool, &mut peers, &mut held)?;
            continue;
        }
        out.clear();
        engine.poll(&mut out);
        tally.count(&out);
        log_outcomes(cfg.rank, &out);
        // Done, or not (expired, failed): either way the source blocks are
        // free again.
        let failed = out.failed_sending.iter().map(|f| f.id);
        let done = out.finished_sending.iter().map(|&id| (id, true));
        let not_done = out
            .expired
            .iter()
            .copied()
            .chain(failed)
            .map(|id| (id, false));
        let mut moved = false;
        for (id, done) in done.chain(not_done) {
            if let Some(h) = held.remove(&id.0) {
                moved = true;
                let ns = u64::try_from(h.since.elapsed().as_nanos()).unwrap_or(u64::MAX);
                match h.push_conn {
                    Some(_) => tally.latency.write.record(ns),
                    None => tally.latency.lend.record(ns),
                }
                pool.release(&h.blocks);
                if let Some(tag) = h.push_conn {
                    door.reply(tag, Msg::Pushed { req: id.0, done });
                }
            }
        }
        if moved {
            door.publish(stats(&engine, &pool));
        }
    }
    drop(door);
    engine.shutdown();
    Ok(())
}

/// What went wrong in `out`, at debug level: failed writes and lends with
/// their reason, handle failures, lost peers.
fn log_outcomes(rank: u32, out: &Outcomes) {
    for f in &out.failed_sending {
        tracing::debug!(rank, "request {:#x} failed: {:?}", f.id.0, f.reason);
    }
    for id in &out.expired {
        tracing::debug!(rank, "request {:#x} expired", id.0);
    }
    for (id, h, why) in &out.handle_failures {
        tracing::debug!(rank, "request {:#x}: handle {h} failed: {why:?}", id.0);
    }
    for (peer, why) in &out.peers_lost {
        tracing::debug!(rank, "peer {peer:?} lost: {why:?}");
    }
}

/// Control messages the engine thread handles before it polls the engine
/// again.
const MESSAGES_PER_TURN: usize = 8;

/// A rank's engine (one per rail, with rails) with its layers registered,
/// and its metadata.
fn start_engine(cfg: &ServeConfig) -> Result<(Side, Vec<u8>), RunError> {
    let builder = Engine::builder()
        .block_size(cfg.block_size)
        .ucx(ContextOptions::with_transports(&cfg.tls))
        .faults(cfg.faults)
        .auth_key(cfg.auth.clone());
    let engine = Side::start(builder, &cfg.rails, cfg.layers, cfg.blocks)?;
    let meta = engine
        .local_metadata()
        .map_err(|_| RunError::Stuck("the engine cannot say its metadata"))?;
    Ok((engine, meta))
}

/// Replaces a deaf engine (its UCX worker receives nothing more: a reader
/// was killed inside a shared-memory send to it) with a new one, at a new
/// address: the control port hands out the new metadata and closes every
/// connection, whose clients connect again and learn it. What the old
/// engine held ends with it: it is shut down (a reader still reading one
/// of its lends fails, as from a lender gone), then their blocks go back
/// to the pool and each push still waiting is answered not done.
fn rebuild(
    old: Side,
    cfg: &ServeConfig,
    door: &door::EngineSide,
    pool: &mut Pool,
    peers: &mut HashMap<usize, PeerId>,
    held: &mut HashMap<u64, Held>,
) -> Result<Side, RunError> {
    tracing::warn!(
        rank = cfg.rank,
        lent = held.len(),
        "the engine's UCX worker stopped hearing (a reader died inside a shared-memory send \
         to it): replacing the engine"
    );
    let (engine, meta) = start_engine(cfg)?;
    door.renew(meta);
    // Its writes stop before their destinations hear they were not done
    // (bounded: its poller force-closes what it has open).
    let mut old = old;
    old.shutdown();
    drop(old);
    // The old engine's peers and requests were its own.
    peers.clear();
    for (req, h) in held.drain() {
        pool.release(&h.blocks);
        if let Some(tag) = h.push_conn {
            door.reply(tag, Msg::Pushed { req, done: false });
        }
    }
    door.publish(stats(&engine, pool));
    tracing::warn!(
        rank = cfg.rank,
        "serving from a new engine; clients reconnect for its metadata"
    );
    Ok(engine)
}

/// How often the figures STATS answers with are refreshed when nothing
/// moved the pool.
const STATS_EVERY: Duration = Duration::from_millis(50);

/// What STATS answers: the pool and the engine's counters.
fn stats(engine: &Side, pool: &Pool) -> door::Stats {
    let (busy, idle) = engine.busy_idle();
    let m = engine.metrics();
    door::Stats {
        total: u64::from(pool.total()),
        free: u64::from(pool.free()),
        busy,
        idle,
        transfer_errors: m.handle_failures.transfer,
        release_failures: m.release_failures,
    }
}

/// The engine's counters with this rank's tally of outcomes and latencies.
fn publish(engine: &Side, tally: &MetricsSnapshot, to: &Mutex<MetricsSnapshot>) {
    let mut snap = engine.metrics();
    snap.requests = tally.requests;
    snap.handle_failures = tally.handle_failures;
    snap.latency = tally.latency;
    // A poisoned lock only means a scrape panicked: the data is still whole.
    *to.lock().unwrap_or_else(|p| p.into_inner()) = snap;
}

/// What the engine thread holds while it handles one message.
struct Rank<'a> {
    engine: &'a mut Side,
    cfg: &'a ServeConfig,
    pool: &'a mut Pool,
    peers: &'a mut HashMap<usize, PeerId>,
    held: &'a mut HashMap<u64, Held>,
    buf: &'a mut [u8],
    alloc: &'a mut Vec<BlockId>,
}

impl Rank<'_> {
    /// Handles a message of connection `tag` that needs the engine; the
    /// reply, if one is due now.
    fn handle(&mut self, tag: usize, m: Msg) -> Option<Msg> {
        let Rank {
            engine,
            cfg,
            pool,
            peers,
            held,
            buf,
            alloc,
        } = self;
        match m {
            Msg::Meta(bytes) => match engine.add_reader(&bytes) {
                Ok(peer) => {
                    // The same metadata again is the same peer; another
                    // engine on this connection replaces the old one.
                    if let Some(old) = peers.insert(tag, peer).filter(|&old| old != peer) {
                        let _ = engine.remove_peer(old);
                    }
                    None
                }
                Err(e) => {
                    tracing::warn!(rank = cfg.rank, conn = tag, "peer metadata refused: {e}");
                    Some(Msg::Refused(format!("metadata refused: {e}")))
                }
            },
            Msg::Prepare { req, n } => {
                alloc.clear();
                if !peers.contains_key(&tag)
                    || held.contains_key(&req)
                    || !pool.alloc(n as usize, alloc)
                {
                    return Some(Msg::Busy { req });
                }
                fill(engine, cfg, req, alloc, buf);
                match engine.lend(RequestId(req), alloc, 1, cfg.lease) {
                    Ok(lend) => {
                        held.insert(
                            req,
                            Held {
                                blocks: alloc.clone(),
                                push_conn: None,
                                since: Instant::now(),
                            },
                        );
                        Some(Msg::Ready {
                            req,
                            lease_ms: u32::try_from(cfg.lease.as_millis()).unwrap_or(u32::MAX),
                            lend: lend.0,
                            blocks: alloc.iter().map(|b| b.0).collect(),
                        })
                    }
                    Err(_) => {
                        pool.release(alloc);
                        Some(Msg::Busy { req })
                    }
                }
            }
            Msg::Push { req, lend, blocks } => {
                let peer = peers.get(&tag).copied();
                alloc.clear();
                let Some(peer) =
                    peer.filter(|_| !held.contains_key(&req) && pool.alloc(blocks.len(), alloc))
                else {
                    tracing::debug!(
                        rank = cfg.rank,
                        conn = tag,
                        "push of request {req:#x} refused: peer {peer:?}, held {}",
                        held.contains_key(&req)
                    );
                    return Some(Msg::Pushed { req, done: false });
                };
                fill(engine, cfg, req, alloc, buf);
                let remote: Vec<BlockId> = blocks.iter().map(|&b| BlockId(b)).collect();
                let t = Transfer {
                    peer,
                    local: alloc,
                    remote: &remote,
                    lend: kvpoll::Incarnation(lend),
                };
                let written = engine
                    .one("push mode")
                    .and_then(|e| Ok(e.write(RequestId(req), &[t], 1, cfg.lease)?));
                match written {
                    Ok(()) => {
                        held.insert(
                            req,
                            Held {
                                blocks: alloc.clone(),
                                push_conn: Some(tag),
                                since: Instant::now(),
                            },
                        );
                        None
                    }
                    Err(e) => {
                        tracing::debug!(rank = cfg.rank, "write of request {req:#x} refused: {e}");
                        pool.release(alloc);
                        Some(Msg::Pushed { req, done: false })
                    }
                }
            }
            // Only a `--testing` server's control port passes it on.
            Msg::Stall { ms } => {
                let _ = engine.stall(Duration::from_millis(ms).min(MAX_STALL));
                None
            }
            _ => None,
        }
    }
}

/// Fills the blocks of request `req` with its pattern, in every layer.
fn fill(engine: &Side, cfg: &ServeConfig, req: u64, blocks: &[BlockId], buf: &mut [u8]) {
    for layer in 0..cfg.layers {
        for (i, &b) in blocks.iter().enumerate() {
            kvpoll_cli::pattern::fill(seed(req, layer, cfg.rank), i as u64, buf);
            let _ = engine.write_block(layer, b, buf);
        }
    }
}
