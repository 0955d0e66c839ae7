//! A prefill rank (`kvpoll serve`): an engine with a block pool that fills
//! blocks for each request and lends them to decode readers (pull) or
//! writes them into decode blocks (push).

use std::collections::HashMap;
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvpoll::engine::Faults;
use kvpoll::metrics::MetricsSnapshot;
use kvpoll::{
    BlockId, ContextOptions, Engine, EngineError, LendTo, Outcomes, PeerId, RequestId, Transfer,
};

use super::link::{self, Incoming};
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
    /// Where to publish the engine's metrics (`serve --metrics`), about
    /// every 100 ms.
    pub metrics: Option<Arc<Mutex<MetricsSnapshot>>>,
}

/// How often a serving rank refreshes its published metrics.
const METRICS_EVERY: Duration = Duration::from_millis(100);

struct Conn {
    stream: TcpStream,
    peer: Option<PeerId>,
    /// Whether the client said a hello that matched our layout.
    greeted: bool,
}

/// How long a client connection may stay silent before it is closed.
const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
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
) -> Result<(), EngineError> {
    let mut engine = Engine::builder()
        .block_size(cfg.block_size)
        .ucx(ContextOptions::with_transports(&cfg.tls))
        .faults(cfg.faults)
        .build()?;
    for _ in 0..cfg.layers {
        engine.register(u64::from(cfg.blocks))?;
    }
    let meta = engine.local_metadata()?;
    let ours = Layout {
        block_size: cfg.block_size,
        layers: cfg.layers as u32,
        blocks: cfg.blocks,
    };
    if Msg::Meta(meta.clone()).encode().is_err() {
        return Err(EngineError::Config(
            "engine metadata does not fit in a control frame: fewer layers",
        ));
    }
    let (tx, rx) = mpsc::channel::<Incoming>();
    listener
        .set_nonblocking(false)
        .map_err(|_| EngineError::Config("control listener cannot block"))?;
    std::thread::spawn(move || {
        for (tag, stream) in listener.incoming().enumerate() {
            let Ok(stream) = stream else { continue };
            let _ = stream.set_nodelay(true);
            let _ = stream.set_write_timeout(Some(link::WRITE_TIMEOUT));
            // Opened goes first on the same channel as the lines, so the
            // connection is known before its first line is handled.
            let Ok(writer) = stream.try_clone() else {
                continue;
            };
            if tx.send(Incoming::Opened(tag, writer)).is_err() {
                return;
            }
            let _ = link::spawn_reader(&stream, tag, tx.clone(), Some(IDLE_TIMEOUT), None);
        }
    });

    let mut pool = Pool::new(cfg.blocks);
    let mut conns: HashMap<usize, Conn> = HashMap::new();
    let mut held: HashMap<u64, Held> = HashMap::new();
    let mut out = Outcomes::default();
    let mut buf = vec![0u8; cfg.block_size as usize];
    let mut alloc = Vec::new();
    // Outcomes and latencies seen here; the engine's own counters are read
    // at each refresh.
    let mut tally = MetricsSnapshot::default();
    let mut published: Option<Instant> = None;
    ready();
    while !stop() {
        if let Some(m) = &cfg.metrics {
            if published.is_none_or(|t| t.elapsed() >= METRICS_EVERY) {
                publish(&engine, &tally, m);
                published = Some(Instant::now());
            }
        }
        // Everything that arrived, then the engine; wait a little only when
        // there was nothing.
        let mut first = rx.recv_timeout(Duration::from_micros(500)).ok();
        while let Some(inc) = first.take().or_else(|| rx.try_recv().ok()) {
            match inc {
                Incoming::Opened(tag, stream) => {
                    // Nothing is said before the client's hello.
                    conns.insert(
                        tag,
                        Conn {
                            stream,
                            peer: None,
                            greeted: false,
                        },
                    );
                }
                Incoming::Closed(tag) => close(&mut engine, &mut conns, tag, None),
                Incoming::Bad(tag, why) => {
                    tracing::warn!(rank = cfg.rank, conn = tag, "control link refused: {why}");
                    close(&mut engine, &mut conns, tag, Some(why));
                }
                Incoming::Line(tag, m) if !conns.get(&tag).is_some_and(|c| c.greeted) => {
                    // The handshake: a hello with our layout, or nothing.
                    let Some(c) = conns.get_mut(&tag) else {
                        continue;
                    };
                    match m {
                        Msg::Hello(theirs) if theirs == ours => {
                            c.greeted = true;
                            let ok = link::send(&mut c.stream, &Msg::Hello(ours))
                                && link::send(&mut c.stream, &Msg::Meta(meta.clone()));
                            if !ok {
                                close(&mut engine, &mut conns, tag, None);
                            }
                        }
                        Msg::Hello(theirs) => {
                            // Our hello lets the client name the mismatch.
                            link::send(&mut c.stream, &Msg::Hello(ours));
                            let why = format!("layout mismatch: ours is {ours}, yours is {theirs}");
                            tracing::warn!(rank = cfg.rank, conn = tag, "{why}");
                            close(&mut engine, &mut conns, tag, Some(why));
                        }
                        _ => {
                            let why = "the handshake (HELLO) must come first".to_owned();
                            tracing::warn!(
                                rank = cfg.rank,
                                conn = tag,
                                "control link refused: {why}"
                            );
                            close(&mut engine, &mut conns, tag, Some(why));
                        }
                    }
                }
                Incoming::Line(tag, m) => {
                    let reply = handle(
                        &mut engine,
                        &cfg,
                        &mut pool,
                        &mut conns,
                        &mut held,
                        tag,
                        m,
                        &mut buf,
                        &mut alloc,
                    );
                    if let (Some(r), Some(c)) = (reply, conns.get_mut(&tag)) {
                        link::send(&mut c.stream, &r);
                    }
                }
            }
        }
        out.clear();
        engine.poll(&mut out);
        tally.count(&out);
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
        for (id, done) in done.chain(not_done) {
            if let Some(h) = held.remove(&id.0) {
                let ns = u64::try_from(h.since.elapsed().as_nanos()).unwrap_or(u64::MAX);
                match h.push_conn {
                    Some(_) => tally.latency.write.record(ns),
                    None => tally.latency.lend.record(ns),
                }
                pool.release(&h.blocks);
                if let Some(tag) = h.push_conn {
                    if let Some(c) = conns.get_mut(&tag) {
                        link::send(&mut c.stream, &Msg::Pushed { req: id.0, done });
                    }
                }
            }
        }
    }
    engine.shutdown();
    Ok(())
}

/// Closes connection `tag`, telling the client why first if there is a
/// reason, and forgets its peer.
fn close(engine: &mut Engine, conns: &mut HashMap<usize, Conn>, tag: usize, why: Option<String>) {
    if let Some(mut c) = conns.remove(&tag) {
        if let Some(why) = why {
            link::send(&mut c.stream, &Msg::Refused(why));
        }
        let _ = c.stream.shutdown(std::net::Shutdown::Both);
        if let Some(p) = c.peer {
            let _ = engine.remove_peer(p);
        }
    }
}

/// The engine's counters with this rank's tally of outcomes and latencies.
fn publish(engine: &Engine, tally: &MetricsSnapshot, to: &Mutex<MetricsSnapshot>) {
    let mut snap = engine.metrics();
    snap.requests = tally.requests;
    snap.handle_failures = tally.handle_failures;
    snap.latency = tally.latency;
    // A poisoned lock only means a scrape panicked: the data is still whole.
    *to.lock().unwrap_or_else(|p| p.into_inner()) = snap;
}

#[allow(clippy::too_many_arguments)]
fn handle(
    engine: &mut Engine,
    cfg: &ServeConfig,
    pool: &mut Pool,
    conns: &mut HashMap<usize, Conn>,
    held: &mut HashMap<u64, Held>,
    tag: usize,
    m: Msg,
    buf: &mut [u8],
    alloc: &mut Vec<BlockId>,
) -> Option<Msg> {
    match m {
        Msg::Meta(bytes) => match engine.add_peer(&bytes) {
            Ok(peer) => {
                if let Some(c) = conns.get_mut(&tag) {
                    c.peer = Some(peer);
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
            if held.contains_key(&req) || !pool.alloc(n as usize, alloc) {
                return Some(Msg::Busy { req });
            }
            fill(engine, cfg, req, alloc, buf);
            match engine.lend(RequestId(req), alloc, LendTo::Readers(1), cfg.lease) {
                Ok(()) => {
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
                        blocks: alloc.iter().map(|b| b.0).collect(),
                    })
                }
                Err(_) => {
                    pool.release(alloc);
                    Some(Msg::Busy { req })
                }
            }
        }
        Msg::Push { req, blocks } => {
            let peer = conns.get(&tag).and_then(|c| c.peer);
            alloc.clear();
            let Some(peer) =
                peer.filter(|_| !held.contains_key(&req) && pool.alloc(blocks.len(), alloc))
            else {
                return Some(Msg::Pushed { req, done: false });
            };
            fill(engine, cfg, req, alloc, buf);
            let remote: Vec<BlockId> = blocks.iter().map(|&b| BlockId(b)).collect();
            let t = Transfer {
                peer,
                local: alloc,
                remote: &remote,
            };
            match engine.write(RequestId(req), &[t], 1, cfg.lease) {
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
                Err(_) => {
                    pool.release(alloc);
                    Some(Msg::Pushed { req, done: false })
                }
            }
        }
        Msg::Stall { ms } if cfg.testing => {
            let _ = engine.stall(Duration::from_millis(ms).min(MAX_STALL));
            None
        }
        Msg::Stall { .. } => {
            tracing::warn!(rank = cfg.rank, conn = tag, "STALL refused (not --testing)");
            Some(Msg::Refused(
                "STALL refused: this server was not started with --testing".into(),
            ))
        }
        Msg::Stats => {
            let s = engine.poller_stats();
            let m = engine.metrics();
            Some(Msg::StatsReply {
                total: u64::from(pool.total()),
                free: u64::from(pool.free()),
                busy: s.busy_ns,
                idle: s.idle_ns,
                transfer_errors: m.handle_failures.transfer,
                release_failures: m.release_failures,
            })
        }
        // Messages a prefill rank does not take are ignored.
        Msg::Hello(_)
        | Msg::Ready { .. }
        | Msg::Busy { .. }
        | Msg::Pushed { .. }
        | Msg::StatsReply { .. }
        | Msg::Refused(_) => None,
    }
}

/// Fills the blocks of request `req` with its pattern, in every layer.
fn fill(engine: &Engine, cfg: &ServeConfig, req: u64, blocks: &[BlockId], buf: &mut [u8]) {
    for layer in 0..cfg.layers {
        for (i, &b) in blocks.iter().enumerate() {
            kvpoll_cli::pattern::fill(seed(req, layer, cfg.rank), i as u64, buf);
            let _ = engine.write_block(layer, b, buf);
        }
    }
}
