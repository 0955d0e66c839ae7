//! The poller: one thread that owns the UCX context, worker and endpoints
//! and the ledger's owner half, and turns commands, completions,
//! notifications, endpoint errors and time into ledger inputs.
//!
//! Loop: drain control messages and commands → post operations → progress
//! the worker → map completions to handles through their tokens → handle
//! notifications and endpoint failures → check deadlines → publish events.
//! Every iteration knows whether it did work; busy and idle iterations are
//! counted.
//!
//! Tokens: a UCX operation carries its [`HandleKey`] packed in a `u64`
//! (generation, slot, handle index); bits 30–31 — free because slots are
//! fewer than 2^24 — say what the operation was (data, flush, notification,
//! close). No lookup maps a completion to its request.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use crate::engine::{EngineError, Faults, IdlePolicy};
use crate::ledger::{
    Begun, BlockId, Cancel, Cause, Event, HandleKey, Kind, Ledger, Nanos, Outcome, PeerId, Reason,
    Request, RequestId, RequestKey, Slots, MAX_HANDLES,
};
use crate::metadata::{BlockLayout, PeerMetadata, RegionDescriptor};
use crate::notification::{NoteKind, Notification};
use crate::ring::{CommandReceiver, EventPublisher};
use crate::transport::ucx::{
    BlockOp, Completion, Context, ContextOptions, Endpoint, EndpointFailure, MemoryRegion,
    PackedRkey, PostError, RemoteKey, UcxError, Worker,
};

/// The active-message id kvpoll's notifications travel on.
pub const NOTIFY_AM_ID: u16 = 0x6b76;

const KIND_MASK: u64 = 3 << 30;
const T_DATA: u64 = 0;
const T_FLUSH: u64 = 1 << 30;
const T_NOTE: u64 = 2 << 30;
const T_CLOSE: u64 = 3 << 30;
/// The status an injected handle error carries (`UCS_ERR_IO_ERROR`).
const INJECTED_ERROR: i8 = -3;

/// What the engine thread and the poller share besides the rings.
pub(crate) struct Shared {
    pub(crate) sleeping: AtomicBool,
    pub(crate) stop: AtomicBool,
    pub(crate) busy_iterations: AtomicU64,
    pub(crate) idle_iterations: AtomicU64,
    pub(crate) rejected_notes: AtomicU64,
    /// The CPU the poller was pinned to and verified on; `u64::MAX` if none.
    pub(crate) pinned_core: AtomicU64,
    pub(crate) epoch: Instant,
    /// The poller thread's kernel thread id (0 until it runs), so that its
    /// CPU time can be read from /proc.
    pub(crate) tid: std::sync::atomic::AtomicI32,
}

pub(crate) struct Config {
    pub(crate) block_size: u64,
    pub(crate) core: Option<usize>,
    pub(crate) idle: IdlePolicy,
    pub(crate) ucx: ContextOptions,
    pub(crate) instance: u64,
    pub(crate) faults: Faults,
}

type Reply<T> = mpsc::Sender<Result<T, EngineError>>;

/// Rare requests from the engine thread, answered on a reply channel.
pub(crate) enum Control {
    Register {
        blocks: u64,
        len: usize,
        /// Caller memory to map (its address), or `None` to let UCX allocate.
        user: Option<usize>,
        reply: Reply<(usize, usize)>,
    },
    Metadata {
        reply: Reply<Vec<u8>>,
    },
    AddPeer {
        meta: PeerMetadata,
        reply: Reply<PeerId>,
    },
    RemovePeer {
        peer: PeerId,
        reply: Reply<()>,
    },
    Shutdown,
}

/// What a request is, as submitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Read,
    PrefixHit,
    Write { acks: u32 },
    Lend { notifications: u32 },
}

/// One entry of the command ring. A request is a `Begin` followed by its
/// handles (each followed by its pairs) or its blocks, sent as one batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Entry {
    Begin {
        id: RequestId,
        op: Op,
        handles: u8,
        blocks: u32,
        expires_in: u64,
    },
    Handle {
        peer: PeerId,
        pairs: u32,
    },
    Pair {
        local: BlockId,
        remote: BlockId,
    },
    Block(BlockId),
    Abort(RequestId),
    Heartbeat {
        id: RequestId,
        extend_ns: u64,
    },
    Stall {
        ns: u64,
    },
}

/// A live connection to a peer. Field order is drop order: the rkeys go
/// before the endpoint they were unpacked on.
struct Conn {
    rkeys: Vec<RemoteKey>,
    ep: Endpoint,
}

struct Peer {
    meta: PeerMetadata,
    conn: Option<Conn>,
    /// Bumped at every new connection; endpoint ids carry it so that a
    /// failure of an old endpoint is not taken for the new one's.
    generation: u32,
}

/// Per-handle progress, indexed by `slot * 64 + handle`.
#[derive(Debug, Clone, Copy, Default)]
struct Progress {
    generation: u32,
    remaining: u32,
    error: i8,
    write: bool,
    peer: u32,
}

/// Per-slot facts the poller needs after begin.
#[derive(Debug, Clone, Copy)]
struct SlotInfo {
    id: RequestId,
    handles: u8,
    op: Op,
}

struct Poller {
    cfg: Config,
    // Drop order: connections (in `peers`), then regions, worker, context.
    peers: Vec<Option<Peer>>,
    by_instance: HashMap<u64, PeerId>,
    regions: Vec<MemoryRegion>,
    region_rkeys: Vec<PackedRkey>,
    region_blocks: u64,
    worker: Worker,
    _context: Context,
    ledger: Ledger,
    slots: Arc<Slots>,
    commands: CommandReceiver<Entry>,
    retire: CommandReceiver<RequestKey>,
    events: EventPublisher<Event>,
    control: mpsc::Receiver<Control>,
    shared: Arc<Shared>,
    progress: Vec<Progress>,
    slot_info: Vec<SlotInfo>,
    ops_in_flight: u64,
    // Scratch, reused so that steady state allocates nothing.
    out: Vec<Event>,
    cancels: Vec<Cancel>,
    completions: Vec<Completion>,
    failures: Vec<EndpointFailure>,
    notes: Vec<Result<Notification, ()>>,
    handle_peers: Vec<PeerId>,
    handle_pairs: Vec<u32>,
    pairs: Vec<(BlockId, BlockId)>,
    blocks: Vec<BlockId>,
    ops: Vec<BlockOp>,
    /// Handles whose (injected) release failure awaits its retry.
    held: Vec<(HandleKey, Nanos)>,
    handles_completed: u64,
}

/// The poller's ends of what connects it to the engine thread.
pub(crate) struct Channels {
    pub(crate) commands: CommandReceiver<Entry>,
    pub(crate) retire: CommandReceiver<RequestKey>,
    pub(crate) events: EventPublisher<Event>,
    pub(crate) control: mpsc::Receiver<Control>,
    pub(crate) shared: Arc<Shared>,
}

/// The poller thread's body.
pub(crate) fn run(
    cfg: Config,
    ledger: Ledger,
    channels: Channels,
    ready: mpsc::Sender<Result<(), EngineError>>,
) {
    let mut poller = match Poller::new(cfg, ledger, channels) {
        Ok(p) => p,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let _ = ready.send(Ok(()));
    poller.run();
}

impl Poller {
    fn new(cfg: Config, ledger: Ledger, channels: Channels) -> Result<Self, EngineError> {
        let Channels {
            commands,
            retire,
            events,
            control,
            shared,
        } = channels;
        if let Some(core) = cfg.core {
            let outcome = crate::placement::pin_current_thread(core, cfg.idle)
                .map_err(|e| EngineError::Config(e.to_string()))?;
            match outcome.warning {
                Some(w) => eprintln!("kvpoll: poller {w}"),
                None => shared.pinned_core.store(core as u64, Ordering::Release),
            }
        }
        let context = Context::new(&cfg.ucx)?;
        let worker = Worker::new(&context)?;
        worker.listen_active_messages(NOTIFY_AM_ID)?;
        let slots = ledger.slots().clone();
        let capacity = slots.capacity() as usize;
        Ok(Self {
            cfg,
            peers: Vec::new(),
            by_instance: HashMap::new(),
            regions: Vec::new(),
            region_rkeys: Vec::new(),
            region_blocks: 0,
            worker,
            _context: context,
            ledger,
            slots,
            commands,
            retire,
            events,
            control,
            shared,
            progress: vec![Progress::default(); capacity * MAX_HANDLES],
            slot_info: vec![
                SlotInfo {
                    id: RequestId(0),
                    handles: 0,
                    op: Op::Read,
                };
                capacity
            ],
            ops_in_flight: 0,
            out: Vec::with_capacity(1024),
            cancels: Vec::with_capacity(64),
            completions: Vec::with_capacity(4096),
            failures: Vec::with_capacity(16),
            notes: Vec::with_capacity(256),
            handle_peers: Vec::with_capacity(MAX_HANDLES),
            handle_pairs: Vec::with_capacity(MAX_HANDLES),
            pairs: Vec::with_capacity(1024),
            blocks: Vec::with_capacity(1024),
            ops: Vec::with_capacity(1024),
            held: Vec::new(),
            handles_completed: 0,
        })
    }

    fn now(&self) -> Nanos {
        Nanos(self.shared.epoch.elapsed().as_nanos() as u64)
    }

    fn run(&mut self) {
        let mut idle_streak = 0u32;
        let (mut busy, mut idle) = (0u64, 0u64);
        let mut iteration = 0u64;
        loop {
            iteration += 1;
            let mut work = 0u32;
            work += self.drain_control();
            if self.shared.stop.load(Ordering::Acquire) {
                break;
            }
            work += self.drain_retired();
            work += self.drain_commands();
            work += self.worker.progress();
            work += self.handle_completions();
            work += self.handle_notifications();
            work += self.handle_failures();
            if iteration % 16 == 0 || work == 0 {
                let now = self.now();
                self.advance(now);
            }
            work += self.dispatch() as u32;
            if self.events.pending() > 0 {
                self.events.flush();
            }
            if work > 0 {
                busy += 1;
                idle_streak = 0;
            } else {
                idle += 1;
                idle_streak = idle_streak.saturating_add(1);
                self.idle_wait(idle_streak);
            }
            if iteration % 1024 == 0 {
                self.publish_counters(&mut busy, &mut idle);
            }
        }
        self.publish_counters(&mut busy, &mut idle);
        self.shutdown();
    }

    fn publish_counters(&self, busy: &mut u64, idle: &mut u64) {
        // Relaxed: monotonic metrics, read for display only.
        self.shared
            .busy_iterations
            .fetch_add(std::mem::take(busy), Ordering::Relaxed);
        self.shared
            .idle_iterations
            .fetch_add(std::mem::take(idle), Ordering::Relaxed);
    }

    fn idle_wait(&self, streak: u32) {
        if self.cfg.idle == IdlePolicy::Busy {
            std::hint::spin_loop();
            return;
        }
        match streak {
            0..=2000 => std::hint::spin_loop(),
            2001..=4000 => std::thread::yield_now(),
            _ => {
                // SeqCst on both sides of the re-check: the engine either sees
                // `sleeping` and unparks, or we see its command and do not
                // park. An unpark before the park makes the park return.
                self.shared.sleeping.store(true, Ordering::SeqCst);
                // The timeout bounds how late a remote-driven event (an
                // incoming notification, a get served over tcp) is noticed:
                // 200 µs at first, 2 ms once the poller has been idle for
                // about 10 ms (a submit still wakes it at once). UCX's own
                // wakeup (an event fd per worker) would remove this trade.
                let nap = if streak < 4050 { 200 } else { 2000 };
                std::thread::park_timeout(Duration::from_micros(nap));
                self.shared.sleeping.store(false, Ordering::SeqCst);
            }
        }
    }

    fn drain_control(&mut self) -> u32 {
        let mut n = 0;
        while let Ok(msg) = self.control.try_recv() {
            n += 1;
            match msg {
                Control::Register {
                    blocks,
                    len,
                    user,
                    reply,
                } => {
                    let _ = reply.send(self.register(blocks, len, user));
                }
                Control::Metadata { reply } => {
                    let _ = reply.send(self.metadata());
                }
                Control::AddPeer { meta, reply } => {
                    let _ = reply.send(Ok(self.add_peer(meta)));
                }
                Control::RemovePeer { peer, reply } => {
                    let r = match self.peers.get(peer.0 as usize) {
                        Some(Some(_)) => {
                            self.drop_peer(peer);
                            Ok(())
                        }
                        _ => Err(EngineError::UnknownPeer(peer)),
                    };
                    let _ = reply.send(r);
                }
                Control::Shutdown => self.shared.stop.store(true, Ordering::Release),
            }
        }
        n
    }

    fn register(
        &mut self,
        blocks: u64,
        len: usize,
        user: Option<usize>,
    ) -> Result<(usize, usize), EngineError> {
        let region = match user {
            // SAFETY: Engine::register_memory's caller guarantees the range
            // stays valid, writable and in place for the engine's lifetime.
            Some(base) => unsafe { MemoryRegion::map(&self._context, base as *mut u8, len)? },
            None => MemoryRegion::allocate(&self._context, len)?,
        };
        let rkey = region.pack_rkey()?;
        let out = (region.as_ptr() as usize, region.len());
        self.region_blocks = blocks;
        self.regions.push(region);
        self.region_rkeys.push(rkey);
        Ok(out)
    }

    fn metadata(&self) -> Result<Vec<u8>, EngineError> {
        let meta = PeerMetadata {
            instance: self.cfg.instance,
            layout: BlockLayout {
                block_size: self.cfg.block_size,
            },
            worker: self.worker.address()?,
            regions: self
                .region_rkeys
                .iter()
                .enumerate()
                .map(|(i, rkey)| RegionDescriptor {
                    id: i as u32,
                    blocks: self.region_blocks,
                    rkey: rkey.clone(),
                })
                .collect(),
        };
        Ok(meta.encode())
    }

    fn add_peer(&mut self, meta: PeerMetadata) -> PeerId {
        let id = PeerId(self.peers.len() as u32);
        // The same engine added again: its old entry goes first.
        if let Some(old) = self.by_instance.get(&meta.instance).copied() {
            self.drop_peer(old);
        }
        self.by_instance.insert(meta.instance, id);
        self.peers.push(Some(Peer {
            meta,
            conn: None,
            generation: 0,
        }));
        id
    }

    /// Fails every handle to `peer` (deferred), closes its endpoint (UCX
    /// completes what was outstanding on it) and forgets it.
    fn drop_peer(&mut self, peer: PeerId) {
        let out = &mut self.out;
        self.ledger.peer_lost(peer, &mut |e| out.push(e));
        if let Some(slot) = self.peers.get_mut(peer.0 as usize) {
            if let Some(p) = slot.take() {
                if self.by_instance.get(&p.meta.instance) == Some(&peer) {
                    self.by_instance.remove(&p.meta.instance);
                }
                drop(p); // force-closes the endpoint
            }
        }
    }

    /// The connection to `peer`, made if needed.
    fn connect(&mut self, peer: PeerId) -> Result<&Conn, Reason> {
        let setup = |status: i8| Reason::new(Cause::Setup, status);
        let Some(Some(p)) = self.peers.get_mut(peer.0 as usize) else {
            return Err(setup(0));
        };
        if p.conn.as_ref().is_some_and(|c| c.ep.is_closed()) {
            p.conn = None;
        }
        if p.conn.is_none() {
            p.generation = p.generation.wrapping_add(1);
            let ep_id = u64::from(peer.0) << 32 | u64::from(p.generation);
            let ep = Endpoint::connect(&self.worker, &p.meta.worker, ep_id)
                .map_err(|e| setup(status_of(&e)))?;
            let mut rkeys = Vec::with_capacity(p.meta.regions.len());
            for r in &p.meta.regions {
                rkeys.push(RemoteKey::unpack(&ep, &r.rkey).map_err(|e| setup(status_of(&e)))?);
            }
            p.conn = Some(Conn { rkeys, ep });
        }
        p.conn.as_ref().ok_or(setup(0))
    }

    /// Frees the slots of requests the engine has consumed.
    fn drain_retired(&mut self) -> u32 {
        let mut n = 0;
        while let Some(key) = self.retire.recv() {
            let _ = self.ledger.retire(key);
            n += 1;
        }
        n
    }

    fn drain_commands(&mut self) -> u32 {
        let mut n = 0;
        while let Some(entry) = self.commands.recv() {
            n += 1;
            match entry {
                Entry::Begin {
                    id,
                    op,
                    handles,
                    blocks,
                    expires_in,
                } => self.begin(id, op, handles, blocks, expires_in),
                Entry::Abort(id) => {
                    let out = &mut self.out;
                    if let Ok(Some(c)) = self.ledger.abort(id, &mut |e| out.push(e)) {
                        self.cancels.push(c);
                    }
                    self.apply_cancels();
                }
                Entry::Heartbeat { id, extend_ns } => {
                    let until = self.now().saturating_add(Nanos(extend_ns));
                    self.ledger.heartbeat(id, until);
                }
                Entry::Stall { ns } => std::thread::sleep(Duration::from_nanos(ns)),
                // Plan entries are consumed by `begin`; a stray one is a bug
                // in the engine's batching and is skipped.
                Entry::Handle { .. } | Entry::Pair { .. } | Entry::Block(_) => {}
            }
        }
        n
    }

    fn begin(&mut self, id: RequestId, op: Op, handles: u8, blocks: u32, expires_in: u64) {
        self.handle_peers.clear();
        self.handle_pairs.clear();
        self.pairs.clear();
        self.blocks.clear();
        for _ in 0..handles {
            let Some(Entry::Handle { peer, pairs }) = self.commands.recv() else {
                debug_assert!(false, "malformed command batch");
                return;
            };
            self.handle_peers.push(peer);
            self.handle_pairs.push(pairs);
            for _ in 0..pairs {
                let Some(Entry::Pair { local, remote }) = self.commands.recv() else {
                    debug_assert!(false, "malformed command batch");
                    return;
                };
                self.pairs.push((local, remote));
                self.blocks.push(local);
            }
        }
        for _ in 0..blocks {
            let Some(Entry::Block(b)) = self.commands.recv() else {
                debug_assert!(false, "malformed command batch");
                return;
            };
            self.blocks.push(b);
        }
        // The engine admitted this request counting the slots it had handed
        // back; those keys were pushed before this command, so they are
        // visible now: free their slots first, or begin could find the
        // ledger full (or the id still indexed) and lose the request.
        self.drain_retired();
        let kind = match op {
            Op::Read => Kind::Read,
            Op::PrefixHit => Kind::PrefixHit,
            Op::Write { acks } => Kind::Write { acks },
            Op::Lend { notifications } => Kind::Lend { notifications },
        };
        let expires = self.now().saturating_add(Nanos(expires_in));
        let req = Request {
            id,
            kind,
            peers: &self.handle_peers,
            blocks: &self.blocks,
            expires,
        };
        let out = &mut self.out;
        let key = match self.ledger.begin(&req, &mut |e| out.push(e)) {
            Ok(Begun::Tracked(key)) => key,
            Ok(Begun::Untracked) => return,
            Err(e) => {
                // The engine validated the request; a refusal here means the
                // engine and the ledger disagree. Nothing was tracked.
                debug_assert!(false, "ledger refused a validated request: {e}");
                eprintln!("kvpoll: poller refused request {id:?}: {e}");
                return;
            }
        };
        self.slot_info[key.slot() as usize] = SlotInfo { id, handles, op };
        let write = matches!(op, Op::Write { .. });
        let mut start = 0usize;
        for h in 0..handles as usize {
            let n = self.handle_pairs[h] as usize;
            self.post_handle(key, h as u8, self.handle_peers[h], start..start + n, write);
            start += n;
        }
    }

    fn post_handle(
        &mut self,
        key: RequestKey,
        handle: u8,
        peer: PeerId,
        pairs: std::ops::Range<usize>,
        write: bool,
    ) {
        let Some(hk) = HandleKey::new(key, handle) else {
            return;
        };
        if self.slots.posting(hk).is_err() {
            return; // cancelled before it was posted: the ledger stopped it
        }
        let bs = self.cfg.block_size;
        let token = hk.to_u64() | T_DATA;
        let local_blocks = self.region_blocks;
        let n_regions = self.regions.len();
        let result = match self.connect(peer) {
            Err(reason) => Err((0, reason)),
            Ok(_) => {
                // Validate the whole handle before posting any of it.
                let Some(Some(p)) = self.peers.get(peer.0 as usize) else {
                    unreachable!("connect succeeded")
                };
                let remote_ok = p.meta.regions.len() == n_regions
                    && self.pairs[pairs.clone()].iter().all(|&(l, r)| {
                        u64::from(l.0) < local_blocks
                            && p.meta.regions.iter().all(|reg| u64::from(r.0) < reg.blocks)
                    });
                if !remote_ok {
                    Err((0, Reason::of(Cause::Setup)))
                } else {
                    let conn = p.conn.as_ref().expect("connected above");
                    let mut posted = 0u32;
                    let mut failure = None;
                    for (region, rkey) in self.regions.iter().zip(&conn.rkeys) {
                        self.ops.clear();
                        self.ops
                            .extend(self.pairs[pairs.clone()].iter().map(|&(l, r)| BlockOp {
                                local_offset: u64::from(l.0) * bs,
                                remote_offset: u64::from(r.0) * bs,
                                len: bs as usize,
                                token,
                            }));
                        let res = if write {
                            conn.ep.put_batch(region, rkey, &self.ops)
                        } else {
                            conn.ep.get_batch(region, rkey, &self.ops)
                        };
                        match res {
                            Ok(()) => posted += self.ops.len() as u32,
                            Err(PostError { posted: k, error }) => {
                                posted += k as u32;
                                failure = Some(status_of(&error));
                                break;
                            }
                        }
                    }
                    match failure {
                        None => Ok(posted),
                        Some(status) if posted == 0 => Err((0, Reason::new(Cause::Setup, status))),
                        Some(status) => Err((posted, Reason::new(Cause::Transfer, status))),
                    }
                }
            }
        };
        let idx = key.slot() as usize * MAX_HANDLES + handle as usize;
        let (remaining, error) = match result {
            Ok(n) => (n, 0),
            Err((n, reason)) => (n, reason.status.min(-1)),
        };
        self.progress[idx] = Progress {
            generation: key.generation(),
            remaining,
            error,
            write,
            peer: peer.0,
        };
        self.ops_in_flight += u64::from(remaining);
        if remaining == 0 {
            let reason = match result {
                Err((_, r)) => r,
                Ok(_) => Reason::of(Cause::Setup),
            };
            let out = &mut self.out;
            let _ = self.slots.setup_failed(hk, reason, &mut |e| out.push(e));
        }
    }

    fn handle_completions(&mut self) -> u32 {
        self.worker.take_completions(&mut self.completions);
        let n = self.completions.len() as u32;
        for i in 0..self.completions.len() {
            let c = self.completions[i];
            self.on_completion(c);
        }
        self.completions.clear();
        n
    }

    fn on_completion(&mut self, c: Completion) {
        let kind = c.token & KIND_MASK;
        if kind == T_NOTE || kind == T_CLOSE {
            return;
        }
        self.ops_in_flight = self.ops_in_flight.saturating_sub(1);
        let hk = HandleKey::from_u64(c.token & !KIND_MASK);
        let idx = hk.key().slot() as usize * MAX_HANDLES + hk.handle() as usize;
        let Some(p) = self.progress.get_mut(idx) else {
            return;
        };
        if p.generation != hk.key().generation() || p.remaining == 0 {
            return; // not ours (cannot happen while slots retire after quiescence)
        }
        if !c.status.is_ok() && p.error == 0 {
            p.error = c.status.0;
        }
        p.remaining -= 1;
        if p.remaining > 0 {
            return;
        }
        let (write, error, peer) = (p.write, p.error, PeerId(p.peer));
        if kind == T_DATA && write && error == 0 {
            // Puts completed: flush before anyone is told (a completed put
            // only means the source is reusable).
            let flushed = match self.connect(peer) {
                Ok(conn) => conn
                    .ep
                    .flush(hk.to_u64() | T_FLUSH)
                    .map_err(|e| status_of(&e)),
                Err(r) => Err(r.status.min(-1)),
            };
            match flushed {
                Ok(()) => {
                    self.progress[idx].remaining = 1;
                    self.ops_in_flight += 1;
                    return;
                }
                Err(status) => self.progress[idx].error = status,
            }
        }
        self.handles_completed += 1;
        let inject = |every: u32| every != 0 && self.handles_completed % u64::from(every) == 0;
        if inject(self.cfg.faults.handle_error_every) && self.progress[idx].error == 0 {
            self.progress[idx].error = INJECTED_ERROR;
        }
        let release_fails = inject(self.cfg.faults.release_failure_every);
        let error = self.progress[idx].error;
        let result = if error == 0 {
            Ok(())
        } else {
            Err(Reason::new(Cause::Transfer, error))
        };
        let out = &mut self.out;
        if release_fails {
            // Injected: releasing the handle failed. It stays held (and its
            // request with it) until the retry.
            let _ = self.slots.release_failed(hk, result, &mut |e| out.push(e));
            let due = self
                .now()
                .saturating_add(Nanos(self.cfg.faults.release_retry_after.as_nanos() as u64));
            self.held.push((hk, due));
        } else {
            let _ = self.slots.completed(hk, result, &mut |e| out.push(e));
        }
        if write && result.is_ok() {
            let id = self.slot_info[hk.key().slot() as usize].id;
            self.notify(peer, NoteKind::WriteDone, id);
        }
    }

    fn notify(&mut self, peer: PeerId, kind: NoteKind, id: RequestId) {
        let note = Notification {
            kind,
            id,
            count: 1,
            sender: self.cfg.instance,
        };
        if let Ok(conn) = self.connect(peer) {
            // A lost notification is not lost work: the other side's lease
            // expires and reports it.
            let _ = conn
                .ep
                .send_active_message(NOTIFY_AM_ID, &note.encode(), T_NOTE);
        }
    }

    fn handle_notifications(&mut self) -> u32 {
        let notes = &mut self.notes;
        self.worker.take_active_messages(|m| {
            notes.push(Notification::decode(m.payload).map_err(|_| ()));
        });
        let n = self.notes.len() as u32;
        for i in 0..self.notes.len() {
            let Ok(note) = self.notes[i] else {
                // Relaxed: a counter, read for display and tests.
                self.shared.rejected_notes.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            let out = &mut self.out;
            let accepted = self
                .ledger
                .notify(note.id, note.count, &mut |e| out.push(e));
            if note.kind == NoteKind::WriteDone && accepted.is_ok() {
                if let Some(&peer) = self.by_instance.get(&note.sender) {
                    self.notify(peer, NoteKind::Ack, note.id);
                }
            }
        }
        self.notes.clear();
        n
    }

    fn handle_failures(&mut self) -> u32 {
        self.worker.take_endpoint_failures(&mut self.failures);
        let n = self.failures.len() as u32;
        for i in 0..self.failures.len() {
            let f = self.failures[i];
            let peer = PeerId((f.endpoint >> 32) as u32);
            let generation = f.endpoint as u32;
            let current = matches!(
                self.peers.get(peer.0 as usize),
                Some(Some(p)) if p.generation == generation && p.conn.is_some()
            );
            if current {
                // DESIGN §2 rule 9: fail its handles (deferred) and drop the
                // peer at once; add_peer with fresh metadata works again.
                self.drop_peer(peer);
            }
        }
        self.failures.clear();
        n
    }

    fn advance(&mut self, now: Nanos) {
        let out = &mut self.out;
        let slots = &self.slots;
        self.held.retain(|&(hk, due)| {
            if due > now {
                return true;
            }
            let _ = slots.release_retried(hk, true, &mut |e| out.push(e));
            false
        });
        let cancels = &mut self.cancels;
        self.ledger
            .advance(now, &mut |e| out.push(e), &mut |c| cancels.push(c));
        self.apply_cancels();
    }

    /// Force-closes the endpoints carrying cancelled handles; UCX completes
    /// their operations with `UCS_ERR_CANCELED`, which stops the handles.
    fn apply_cancels(&mut self) {
        while let Some(c) = self.cancels.pop() {
            let mut bits = c.handles;
            while bits != 0 {
                let h = bits.trailing_zeros() as u8;
                bits &= bits - 1;
                let Some(hk) = HandleKey::new(c.key, h) else {
                    continue;
                };
                if let Some(peer) = self.ledger.peer(hk) {
                    if let Some(Some(p)) = self.peers.get_mut(peer.0 as usize) {
                        if let Some(conn) = p.conn.take() {
                            let _ = conn.ep.force_close(T_CLOSE);
                        }
                    }
                }
            }
        }
    }

    /// Sends what follows from reports (a finished read notifies its
    /// producers), then publishes them.
    fn dispatch(&mut self) -> usize {
        let n = self.out.len();
        for i in 0..n {
            let ev = self.out[i];
            if ev.outcome == Outcome::Finished {
                let info = self.slot_info[ev.key.slot() as usize];
                if info.op == Op::Read {
                    for h in 0..info.handles {
                        if let Some(peer) =
                            HandleKey::new(ev.key, h).and_then(|hk| self.ledger.peer(hk))
                        {
                            self.notify(peer, NoteKind::ReadDone, ev.id);
                        }
                    }
                }
            }
            // Backpressure only means the overflow is past its bound; the
            // event is kept either way, nothing is dropped.
            let _ = self.events.publish(ev);
        }
        self.out.clear();
        n
    }

    /// Cancels everything in flight, waits until UCX completed every
    /// outstanding operation (bounded), publishes the reports and releases
    /// endpoints, regions, worker and context (in that order, by drop).
    fn shutdown(&mut self) {
        self.advance(Nanos(u64::MAX));
        for p in self.peers.iter_mut().flatten() {
            if let Some(conn) = p.conn.take() {
                let _ = conn.ep.force_close(T_CLOSE);
            }
        }
        let start = Instant::now();
        while self.ops_in_flight > 0 && start.elapsed() < Duration::from_secs(10) {
            self.worker.progress();
            self.handle_completions();
            self.dispatch();
        }
        self.dispatch();
        // The engine drains the ring while it waits for this thread.
        while self.events.flush() > 0 {
            std::thread::yield_now();
        }
        self.peers.clear();
    }
}

/// The status to record for a failed UCX call; `UCS_ERR_INVALID_PARAM`
/// when kvpoll refused the operation before UCX saw it.
fn status_of(e: &UcxError) -> i8 {
    e.status()
        .map_or(ucx_sys::ucs_status_t::UCS_ERR_INVALID_PARAM, |s| s.0)
}
