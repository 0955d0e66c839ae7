//! The request protocol as a sans-IO state machine.
//!
//! The [`crate::ledger`] does the atomic handle accounting; this core does
//! everything around it that decides *what happens*: which operations to
//! post on which endpoint, flush before notify, read-done / write-done
//! notifications and acknowledgements counted per remote engine, release
//! retries, aborts that touch only their own request, deadlines that judge a
//! peer stalled and force-close its endpoint, peers lost, shutdown.
//!
//! It never reads a clock, never calls UCX, never spawns a thread: it is fed
//! commands, transport events and `now`, and asked for [`Action`]s (which
//! the driver executes on a [`crate::transport::Transport`], feeding the
//! synchronous results back) and [`Event`]s (which the driver publishes to
//! the engine thread). [`Core::next_deadline`] says when it next needs
//! `advance`. So the simulator, proptest and unit tests reach all of it.
//!
//! Tokens: an operation's `u64` token is its [`HandleKey`] packed with two
//! kind bits (30–31: free because slots are fewer than 2^24): data, flush,
//! notification, and one the transport keeps for its own closes.

pub mod command;

use std::collections::{HashMap, HashSet, VecDeque};

pub use command::Command;

use crate::ledger::{
    Begun, BlockId, Cancel, Cause, Event, HandleKey, Incarnation, Kind, Ledger, Nanos, Outcome,
    PeerId, Reason, Request, RequestId, RequestKey, Slots, MAX_HANDLES,
};
use crate::notification::{NoteKind, Notification, LEN as NOTE_LEN, MAX_PER_MESSAGE};
use crate::transport::{Direction, Ep, PostFailure, TransportEvent, CANCELED};

const KIND_MASK: u64 = 3 << 30;
const T_DATA: u64 = 0;
const T_FLUSH: u64 = 1 << 30;
const T_NOTE: u64 = 2 << 30;
/// The token kind a transport uses for operations of its own (closes); the
/// core never sees their completions.
pub const T_TRANSPORT: u64 = 3 << 30;

/// Most remote engines one request may await notifications from.
pub const MAX_CONSUMERS: usize = 64;

/// Push destinations answered [`NoteKind::WriteQuiet`] that are remembered
/// per asking engine (its oldest is forgotten first): a write submitted
/// that long after its destination gave up on it is not refused locally
/// any more. Per engine, so that one engine's questions never push out
/// the promises made to another.
const QUIET_PER_ENGINE: usize = 16_384;
/// Engines whose promises are remembered; past it, an engine that is not
/// a peer is forgotten first.
const QUIET_ENGINES: usize = 1024;

/// Incarnations of lends and push destinations that ended and are
/// remembered (the oldest is forgotten first): a read's question for one
/// of them is refused at once; for an older one, only once the reader's
/// grace period ran out.
const ENDED_REMEMBERED: usize = 16_384;

/// Notes (a reader's give-up, a writer's word) naming an incarnation not
/// lent yet, held until it is (or the grace period ends); past it, the
/// oldest is dropped (its lend then waits for its lease: safe).
const EARLY_HELD: usize = 1024;

/// A read told [`NoteKind::ReadPending`] asks again after this long,
/// doubling up to [`ASK_MAX`].
const ASK_FIRST: Nanos = Nanos(100_000);
const ASK_MAX: Nanos = Nanos(20_000_000);

/// How often a quarantined push destination asks its silent writers
/// again, at most (an answer can be lost with a closed endpoint).
const REQUERY_MIN: Nanos = Nanos(50_000_000);

/// Whether an operation's status says its peer is gone (unreachable, the
/// connection reset or not connected, a link or endpoint failure — UCX's
/// `UCS_ERR_ENDPOINT_TIMEOUT` for a killed process among them), as opposed
/// to an error of the transfer itself.
fn peer_gone(status: i8) -> bool {
    matches!(status, -6 | -24 | -25 | -89..=-40)
}

/// What the core is told about itself at start.
#[derive(Debug, Clone, Copy)]
pub struct CoreConfig {
    /// This engine's instance id (notifications carry it).
    pub instance: u64,
    /// How long a handle whose release failed waits for its retry.
    pub release_retry: Nanos,
    /// Whether a read finishes only once each lender confirmed that its
    /// lend was live when the data was read (the safe default). Off, a read
    /// finishes when its data landed and then tells its lenders, as for
    /// reads of memory that no lend guards.
    pub confirm_reads: bool,
    /// Whether a push destination's lease is a fence (the safe default):
    /// at its end the blocks are quarantined until every writer that could
    /// still write into them has spoken, answered quiet or been lost. Off,
    /// it is a timer (unsafe; for comparisons only).
    pub fence_push_leases: bool,
    /// How often a read or write still in flight tells its lenders (the
    /// producers it reads from, the destinations it writes into) to keep
    /// their lends (`Nanos(u64::MAX)`: never).
    pub heartbeat: Nanos,
    /// How long a read whose lender does not know the lend yet
    /// ([`NoteKind::ReadPending`]) keeps asking before it fails
    /// (`Cause::LeaseLost`); and how long a note naming a lend not begun
    /// yet is held for it.
    pub lend_grace: Nanos,
}

/// Where an [`Action::Send`] or [`Action::Reply`] finds its notifications:
/// `count` encoded notifications from byte `start` of [`Core::notes`],
/// valid until the next call that changes the core (`next_action`
/// included): use them before asking for the next action.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Notes {
    /// First byte.
    pub start: u32,
    /// Notifications (1 to [`MAX_PER_MESSAGE`]).
    pub count: u32,
}

impl Notes {
    fn range(self) -> std::ops::Range<usize> {
        self.start as usize..self.start as usize + self.count as usize * NOTE_LEN
    }
}

/// Where a batch of notifications goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NoteTarget {
    /// An endpoint generation of a peer.
    Ep(Ep),
    /// The reply handle of a received message.
    Reply(u32),
}

/// Notifications for one target, not yet queued.
struct Batch {
    to: NoteTarget,
    want_reply: bool,
    count: u32,
    bytes: [u8; MAX_PER_MESSAGE * NOTE_LEN],
}

/// Something the driver must do. Executed in order; the results of `Post`,
/// `Flush` and `Release` are fed back before the next input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Post the handle's block pairs ([`Core::pairs`] of `pairs`) on `ep`;
    /// feed the result to [`Core::on_posted`].
    Post {
        /// Endpoint generation to post on.
        ep: Ep,
        /// Get or put.
        dir: Direction,
        /// The handle.
        handle: HandleKey,
        /// Token every operation completes with.
        token: u64,
        /// Range of [`Core::pairs`].
        pairs: (u32, u32),
    },
    /// Flush `ep` (the endpoint the handle's puts travelled on); feed a
    /// failure to [`Core::on_flush_failed`].
    Flush {
        /// Endpoint generation.
        ep: Ep,
        /// The handle.
        handle: HandleKey,
        /// Token the flush completes with.
        token: u64,
    },
    /// Send notifications, as one message; a failure to send is fed to
    /// [`Core::on_send_failed`].
    Send {
        /// Endpoint generation.
        ep: Ep,
        /// The encoded notifications ([`Core::notes`]).
        notes: Notes,
        /// Token it completes with.
        token: u64,
        /// Whether the receiver must be able to answer it (one of them is
        /// a read's question to its lender).
        want_reply: bool,
    },
    /// Answer a received message through its reply handle (before the
    /// transport's next progress), as one message; a failure is fed to
    /// [`Core::on_send_failed`].
    Reply {
        /// The received message's reply handle.
        to: u32,
        /// The encoded notifications ([`Core::notes`]).
        notes: Notes,
        /// Token it completes with.
        token: u64,
    },
    /// Force-close endpoint generation `ep`.
    Close {
        /// Which one.
        ep: Ep,
    },
    /// Release the handle's resources; feed the result to
    /// [`Core::on_released`].
    Release {
        /// The handle.
        handle: HandleKey,
    },
    /// The peer is gone: the transport forgets it.
    ForgetPeer {
        /// Which.
        peer: PeerId,
    },
}

/// What the core knows of a peer.
#[derive(Debug, Clone, Copy)]
struct Peer {
    instance: u64,
    /// Blocks per region, and regions, of the peer (remote block ids are
    /// checked against them before anything is posted).
    blocks: u64,
    regions: usize,
    /// The current endpoint generation; bumped when it is force-closed.
    generation: u32,
    /// Why recent generations were closed, newest first: a completion
    /// cancelled by a close carries the close's reason.
    closes: [(u32, Cause); 4],
}

impl Peer {
    fn ep(&self, id: PeerId) -> Ep {
        Ep {
            peer: id,
            generation: self.generation,
        }
    }

    fn close_cause(&self, generation: u32) -> Option<Cause> {
        self.closes
            .iter()
            .find(|(g, c)| *g == generation && *c != Cause::Transfer)
            .map(|&(_, c)| c)
    }
}

/// Per-handle progress, indexed by `slot * 64 + handle`.
#[derive(Debug, Clone, Copy)]
struct Progress {
    /// The request key's generation this entry belongs to.
    generation: u32,
    /// Operations outstanding (data, then the flush).
    remaining: u32,
    /// The first failure, if any.
    failure: Option<Reason>,
    peer: PeerId,
    /// The endpoint generation the handle's operations travel on.
    ep_generation: u32,
    /// Puts completed; the flush is outstanding.
    flushing: bool,
    /// Ended; waits for (or retries) its release.
    releasing: bool,
    /// Its release failed once: the next success is a retry.
    held: bool,
    /// Whether it ended without error (puts flushed, gets landed).
    ok: bool,
    /// The remote lend or push destination it reads or writes.
    lend: Incarnation,
}

impl Default for Progress {
    fn default() -> Self {
        Progress {
            lend: Incarnation::NONE,
            generation: u32::MAX,
            remaining: 0,
            failure: None,
            peer: PeerId(0),
            ep_generation: 0,
            flushing: false,
            releasing: false,
            held: false,
            ok: false,
        }
    }
}

/// Per-slot facts the core needs after begin.
#[derive(Debug, Clone, Copy)]
struct Info {
    generation: u32,
    id: RequestId,
    /// Its incarnation: a lend's or push destination's token, a read's or
    /// write's nonce.
    token: Incarnation,
    kind: Kind,
    handles: u8,
    /// Distinct engines that notified (their instances are in `notifiers`).
    notified: u8,
    /// A read whose handles all landed asked its lenders whether their
    /// lends were live.
    queried: bool,
    /// A push destination one of whose writers gave up.
    abandoned: bool,
    /// A lend's lease length, ns: a reader's heartbeat extends the lend by
    /// as much from now.
    lease: u64,
    /// A push destination with named writers whose lease ran out while one
    /// of them had not spoken: its blocks wait, quarantined, for that
    /// writer's word or its loss.
    quarantined: bool,
    /// The engine aborted it (a push destination waits for its writers all
    /// the same).
    aborted: bool,
    /// A push destination lent to writers it did not name: at its lease's
    /// end every peer is asked (and its handles name them from then on).
    unnamed: bool,
    /// Writers of a push destination that said done or abandoned.
    words: u8,
}

/// A push destination's fence: when its lease ends (or at its abort), when
/// to ask its silent writers again once quarantined, and — lent to writers
/// it did not name — the peers it asked that have not answered yet (every
/// peer it knew then, however many).
#[derive(Debug, Clone)]
struct Fence {
    key: RequestKey,
    due: Nanos,
    asked: Vec<PeerId>,
}

/// The [`NoteKind::WriteQuiet`] promises this engine made, per asking
/// engine: push destinations (by incarnation) it will not write into.
#[derive(Default)]
struct Quiet {
    engines: HashMap<u64, (VecDeque<Incarnation>, HashSet<Incarnation>)>,
}

impl Quiet {
    fn promised(&self, to: u64, lend: Incarnation) -> bool {
        self.engines
            .get(&to)
            .is_some_and(|(_, set)| set.contains(&lend))
    }

    /// Remembers a promise; `known` says whether an engine is a peer (one
    /// that is not is forgotten first when too many engines asked).
    fn promise(&mut self, to: u64, lend: Incarnation, known: impl Fn(u64) -> bool) {
        if !self.engines.contains_key(&to) && self.engines.len() >= QUIET_ENGINES {
            let stranger = self.engines.keys().copied().find(|&e| !known(e));
            let gone = stranger.or_else(|| self.engines.keys().copied().next());
            if let Some(e) = gone {
                self.engines.remove(&e);
            }
        }
        let (order, set) = self.engines.entry(to).or_default();
        if !set.insert(lend) {
            return;
        }
        if order.len() == QUIET_PER_ENGINE {
            if let Some(old) = order.pop_front() {
                set.remove(&old);
            }
        }
        order.push_back(lend);
    }
}

/// Incarnations that ended, the newest [`ENDED_REMEMBERED`].
#[derive(Default)]
struct Ended {
    order: VecDeque<Incarnation>,
    set: HashSet<Incarnation>,
}

impl Ended {
    fn record(&mut self, inc: Incarnation) {
        if inc.is_none() || !self.set.insert(inc) {
            return;
        }
        if self.order.len() == ENDED_REMEMBERED {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
        self.order.push_back(inc);
    }

    fn contains(&self, inc: Incarnation) -> bool {
        self.set.contains(&inc)
    }
}

/// A read asking a lender again whether its lend is live (the lender did
/// not know it yet).
#[derive(Debug, Clone, Copy)]
struct Ask {
    key: RequestKey,
    peer: PeerId,
    /// When to ask again (`u64::MAX`: asked, waiting for the answer).
    due: Nanos,
    /// The grace period's end: a pending answer after it fails the read.
    until: Nanos,
    wait: Nanos,
}

/// Counters, for metrics and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CoreStats {
    /// Notifications that did not decode.
    pub malformed_notifications: u64,
    /// Notifications that decoded but were refused: unknown request, wrong
    /// kind for the request, a duplicate from an engine already counted, or
    /// from an engine that is not a party to the request.
    pub rejected_notifications: u64,
    /// Operations posted.
    pub ops_posted: u64,
    /// Operations completed (data and flush).
    pub ops_completed: u64,
    /// Data operations (one block of one region each) that completed
    /// successfully.
    pub blocks_moved: u64,
    /// Endpoints force-closed because a peer was judged stalled.
    pub stall_closes: u64,
    /// Peers lost (endpoint failures).
    pub peers_lost: u64,
    /// Requests the ledger refused after the engine admitted them (a bug
    /// if ever non-zero).
    pub refused_requests: u64,
    /// Notifications sent and answered.
    pub notifications_sent: u64,
    /// Messages they travelled in (the notifications the core emits to one
    /// endpoint in one go travel together).
    pub notification_messages: u64,
    /// Push destinations whose lease ran out while a named writer had not
    /// spoken: quarantined until it does or is lost (a counter).
    pub quarantined_receives: u64,
    /// Of those, still quarantined now (a gauge).
    pub quarantined_now: u64,
    /// Notes that named an incarnation not lent yet (a read's question
    /// answered [`NoteKind::ReadPending`], a give-up or a writer's word
    /// held for its lend).
    pub early_notes: u64,
    /// Notes that named an incarnation other than the live one of their
    /// request id (a late note of an earlier lend, an answer to an earlier
    /// attempt, a wrong token): refused, never applied. Also counted in
    /// `rejected_notifications`.
    pub stale_notifications: u64,
}

/// The protocol core. See the module docs.
pub struct Core {
    cfg: CoreConfig,
    ledger: Ledger,
    slots: std::sync::Arc<Slots>,
    local_blocks: u64,
    local_regions: usize,
    peers: Vec<Option<Peer>>,
    /// Engine instance → its peer entry. Hashed with the ledger's cheap
    /// hasher: it holds one entry per peer the engine added (a sender
    /// cannot add entries), and it is looked up for every read
    /// confirmation and acknowledgement, where SipHash cost ~200
    /// instructions.
    by_instance: HashMap<u64, PeerId, std::hash::BuildHasherDefault<crate::ledger::IdHasher>>,
    progress: Vec<Progress>,
    info: Vec<Info>,
    notifiers: Vec<u64>,
    /// Aborted requests and their expiry: past it with handles still in
    /// flight, their peers are judged stalled.
    aborted: Vec<(RequestKey, Nanos)>,
    /// Reads in flight and when each next tells its lenders it is alive,
    /// in order of that time (every entry is due `heartbeat` after the
    /// clock it was pushed with, and the clock does not go back): the
    /// next heartbeat is the front's. Entries of reads that ended are
    /// dropped when they reach the front, or all at once when the queue
    /// outgrows twice the slots, so it never holds more than that (it
    /// used to keep every read for a whole heartbeat period, and
    /// `next_deadline` scanned them all).
    beating: VecDeque<(RequestKey, Nanos)>,
    /// Push destinations, and their lease ends (kept here, not in the
    /// ledger: expiry starts a fence, it frees nothing); once quarantined,
    /// when to ask their silent writers again.
    fences: Vec<Fence>,
    /// Push destinations this engine answered [`NoteKind::WriteQuiet`]
    /// for: a write into one of them is refused before anything is posted
    /// (its blocks may be reused).
    quiet: Quiet,
    /// Live lends and push destinations, by incarnation: a note finds the
    /// one it names by its token, never by its request id alone.
    by_token:
        HashMap<Incarnation, RequestKey, std::hash::BuildHasherDefault<crate::ledger::IdHasher>>,
    /// Lends and push destinations that ended, by incarnation.
    ended: Ended,
    /// Notes naming an incarnation not begun yet, and until when they are
    /// held (in order of that time).
    early: VecDeque<(Nanos, Notification)>,
    /// Reads asking their lenders again.
    asking: Vec<Ask>,
    /// Peers removed while a fence still needs their word or puts of ours
    /// to them are in flight: forgotten once neither holds.
    leaving: Vec<PeerId>,
    /// Peers lost or removed since the last [`Core::drain_lost_peers`].
    lost: Vec<(PeerId, Reason)>,
    /// Handles whose release failed, and when to retry.
    held: Vec<(HandleKey, Nanos)>,
    ops_in_flight: u64,
    notes_in_flight: u64,
    actions: VecDeque<Action>,
    events: Vec<Event>,
    /// Pairs of the handles being posted (valid until the next begin).
    pairs: Vec<(BlockId, BlockId)>,
    /// Encoded notifications of the queued sends and replies (emptied when
    /// no action is queued).
    note_bytes: Vec<u8>,
    /// Notifications waiting to travel together, one batch per endpoint
    /// generation or reply handle.
    batches: Vec<Batch>,
    handle_peers: Vec<PeerId>,
    handle_pairs: Vec<u32>,
    handle_lends: Vec<Incarnation>,
    blocks: Vec<BlockId>,
    cancels: Vec<Cancel>,
    stats: CoreStats,
    shutting_down: bool,
    /// Events already looked at by `after_events`.
    scanned: usize,
}

impl Core {
    /// A core over `ledger`, with nothing registered and no peer.
    pub fn new(cfg: CoreConfig, ledger: Ledger) -> Self {
        let slots = ledger.slots().clone();
        let capacity = slots.capacity() as usize;
        Core {
            cfg,
            ledger,
            slots,
            local_blocks: 0,
            local_regions: 0,
            peers: Vec::new(),
            by_instance: HashMap::default(),
            progress: vec![Progress::default(); capacity * MAX_HANDLES],
            info: vec![
                Info {
                    generation: u32::MAX,
                    id: RequestId(0),
                    token: Incarnation::NONE,
                    kind: Kind::Read,
                    handles: 0,
                    notified: 0,
                    queried: false,
                    abandoned: false,
                    lease: 0,
                    quarantined: false,
                    aborted: false,
                    unnamed: false,
                    words: 0,
                };
                capacity
            ],
            notifiers: vec![0; capacity * MAX_CONSUMERS],
            aborted: Vec::with_capacity(64),
            beating: VecDeque::with_capacity(2 * capacity + 1),
            fences: Vec::with_capacity(64),
            quiet: Quiet::default(),
            by_token: HashMap::default(),
            ended: Ended::default(),
            early: VecDeque::with_capacity(64),
            asking: Vec::with_capacity(64),
            leaving: Vec::new(),
            lost: Vec::new(),
            held: Vec::new(),
            ops_in_flight: 0,
            notes_in_flight: 0,
            actions: VecDeque::with_capacity(1024),
            events: Vec::with_capacity(1024),
            pairs: Vec::with_capacity(1024),
            note_bytes: Vec::with_capacity(64 * MAX_PER_MESSAGE * NOTE_LEN),
            batches: Vec::with_capacity(16),
            handle_peers: Vec::with_capacity(MAX_HANDLES),
            handle_pairs: Vec::with_capacity(MAX_HANDLES),
            handle_lends: Vec::with_capacity(MAX_HANDLES),
            blocks: Vec::with_capacity(1024),
            cancels: Vec::with_capacity(64),
            stats: CoreStats::default(),
            shutting_down: false,
            scanned: 0,
        }
    }

    /// The shared ledger slots.
    pub fn slots(&self) -> &std::sync::Arc<Slots> {
        &self.slots
    }

    /// Counters.
    pub fn stats(&self) -> CoreStats {
        self.stats
    }

    /// Ledger counters and occupancy.
    pub fn ledger_stats(&self) -> crate::ledger::Stats {
        self.ledger.stats()
    }

    /// The next action to execute, if any. Notifications waiting in
    /// batches are queued once nothing else is.
    pub fn next_action(&mut self) -> Option<Action> {
        if self.actions.is_empty() {
            while !self.batches.is_empty() {
                self.queue_batch(self.batches.len() - 1);
            }
        }
        self.actions.pop_front()
    }

    /// Executes every pending action on `wire`, feeding back what the
    /// transport answers at once (posts, flushes and sends that could not
    /// go out, releases): the driver's whole job between inputs. `observe`
    /// sees each action first, with the core to look up its pairs or
    /// notifications (tests record them).
    pub fn execute<W: crate::transport::Transport + ?Sized>(
        &mut self,
        wire: &mut W,
        now: Nanos,
        mut observe: impl FnMut(&Action, &Core),
    ) {
        while let Some(action) = self.next_action() {
            observe(&action, self);
            match action {
                Action::Post {
                    ep,
                    dir,
                    handle,
                    token,
                    pairs,
                } => {
                    let r = wire.post(ep, dir, self.pairs(pairs), token);
                    self.on_posted(handle, r);
                }
                Action::Flush { ep, handle, token } => {
                    if let Err(status) = wire.flush(ep, token) {
                        self.on_flush_failed(handle, status);
                    }
                }
                Action::Send {
                    ep,
                    notes,
                    token,
                    want_reply,
                } => {
                    if wire
                        .send(ep, &self.note_bytes[notes.range()], token, want_reply)
                        .is_err()
                    {
                        self.on_send_failed(notes.count);
                    }
                }
                Action::Reply { to, notes, token } => {
                    if wire
                        .reply(to, &self.note_bytes[notes.range()], token)
                        .is_err()
                    {
                        self.on_send_failed(notes.count);
                    }
                }
                Action::Close { ep } => wire.close(ep),
                Action::Release { handle } => {
                    let released = wire.release(handle);
                    self.on_released(handle, released, now);
                }
                Action::ForgetPeer { peer } => wire.forget_peer(peer),
            }
        }
    }

    /// The encoded notifications of an [`Action::Send`] or
    /// [`Action::Reply`].
    pub fn notes(&self, notes: Notes) -> &[u8] {
        &self.note_bytes[notes.range()]
    }

    /// The block pairs of a [`Action::Post`].
    pub fn pairs(&self, range: (u32, u32)) -> &[(BlockId, BlockId)] {
        &self.pairs[range.0 as usize..(range.0 + range.1) as usize]
    }

    /// Hands the events produced so far to `publish`, in order, and
    /// forgets them.
    pub fn drain_events(&mut self, mut publish: impl FnMut(Event)) -> usize {
        let n = self.events.len();
        for &e in &self.events {
            publish(e);
        }
        self.events.clear();
        self.scanned = 0;
        n
    }

    /// Operations (data, flushes) and notifications still outstanding.
    pub fn outstanding(&self) -> u64 {
        self.ops_in_flight + self.notes_in_flight
    }

    // -- control plane ----------------------------------------------------

    /// Local memory now holds `regions` regions of `blocks` blocks each.
    pub fn set_local_layout(&mut self, regions: usize, blocks: u64) {
        self.local_regions = regions;
        self.local_blocks = blocks;
    }

    /// Whether a peer was ever added (registering more memory would leave
    /// those peers with stale metadata).
    pub fn has_peers(&self) -> bool {
        self.peers.iter().any(Option::is_some)
    }

    /// The peer entry of engine `instance`, if it is a peer.
    pub fn peer_of(&self, instance: u64) -> Option<PeerId> {
        self.by_instance.get(&instance).copied()
    }

    /// Adds a peer. An engine re-added under the same instance (its
    /// metadata refreshed) replaces its old entry — but only while nothing
    /// uses that entry: with operations of ours in flight on it, or a push
    /// destination waiting for its word, closing it could cut puts in
    /// flight or drop a fence, so the refresh is refused (`Err` names the
    /// entry in use). The engine is alive (same instance), so push
    /// destinations that named it keep waiting, and name the new entry.
    pub fn add_peer(
        &mut self,
        instance: u64,
        regions: usize,
        blocks: u64,
    ) -> Result<PeerId, PeerId> {
        let replaced = self.by_instance.get(&instance).copied();
        if let Some(old) = replaced {
            if self.in_use(old) {
                return Err(old);
            }
            self.drop_peer(old, Cause::PeerLost, false);
        }
        let id = PeerId(self.peers.len() as u32);
        if let Some(old) = replaced {
            self.rename_writer(old, id);
        }
        self.peers.push(Some(Peer {
            instance,
            blocks,
            regions,
            generation: 1,
            closes: [(0, Cause::Transfer); 4],
        }));
        self.by_instance.insert(instance, id);
        Ok(id)
    }

    /// Removes a peer: its handles in flight fail (deferred, as always),
    /// and nothing new is posted to it. While a push destination still
    /// waits for its word, or puts of ours to it are in flight, it is only
    /// marked as leaving — closing its endpoint could cut those puts or
    /// drop the fence — and forgotten once neither holds. Returns whether
    /// the id was ever issued (a second removal is fine).
    pub fn remove_peer(&mut self, peer: PeerId) -> bool {
        let Some(entry) = self.peers.get(peer.0 as usize) else {
            return false;
        };
        if entry.is_none() || self.leaving.contains(&peer) {
            return true;
        }
        if self.fence_needs(peer) || self.puts_in_flight(peer) {
            self.leaving.push(peer);
        } else {
            self.drop_peer(peer, Cause::PeerLost, true);
        }
        true
    }

    /// Peers removed or lost since the last call, with why (`PeerLost` and
    /// the endpoint's status for a loss).
    pub fn drain_lost_peers(&mut self, mut out: impl FnMut(PeerId, Reason)) {
        for (peer, reason) in self.lost.drain(..) {
            out(peer, reason);
        }
    }

    /// Whether anything of ours is in flight on `peer`'s entry, or a push
    /// destination waits for its word.
    fn in_use(&self, peer: PeerId) -> bool {
        self.fence_needs(peer)
            || self.progress.iter().enumerate().any(|(i, p)| {
                p.peer == peer
                    && (p.remaining > 0 || p.releasing)
                    && self.info[i / MAX_HANDLES].generation == p.generation
                    && self
                        .ledger
                        .is_live(RequestKey::new((i / MAX_HANDLES) as u32, p.generation))
            })
    }

    /// Whether a live push destination could still hear from `peer` (a
    /// writer it named that has not spoken, a peer it asked that has not
    /// answered, or any peer while one lent to unnamed writers is not
    /// quarantined yet: any of them could be writing).
    fn fence_needs(&self, peer: PeerId) -> bool {
        let instance = match self.peers.get(peer.0 as usize) {
            Some(Some(p)) => p.instance,
            _ => return false,
        };
        self.fences.iter().any(|f| {
            if !self.fence_live(f.key) {
                return false;
            }
            let slot = f.key.slot() as usize;
            let info = &self.info[slot];
            if info.unnamed {
                return !info.quarantined || f.asked.contains(&peer);
            }
            let spoke = &self.notifiers[slot * MAX_CONSUMERS..][..usize::from(info.notified)];
            let base = slot * MAX_HANDLES;
            (0..info.handles as usize).any(|h| self.progress[base + h].peer == peer)
                && !spoke.contains(&instance)
        })
    }

    /// Peers marked as leaving that nothing holds any more are forgotten.
    fn retire_leaving(&mut self) {
        let mut i = 0;
        while i < self.leaving.len() {
            let peer = self.leaving[i];
            if self.fence_needs(peer) || self.puts_in_flight(peer) {
                i += 1;
            } else {
                self.leaving.swap_remove(i);
                self.drop_peer(peer, Cause::PeerLost, true);
            }
        }
    }

    /// Push destinations that name writer `old` name `new` instead.
    fn rename_writer(&mut self, old: PeerId, new: PeerId) {
        for slot in 0..self.info.len() {
            let info = self.info[slot];
            if !matches!(info.kind, Kind::Receive { .. }) || info.handles == 0 {
                continue;
            }
            let key = RequestKey::new(slot as u32, info.generation);
            if !self.ledger.is_live(key) {
                continue;
            }
            let base = slot * MAX_HANDLES;
            for p in &mut self.progress[base..base + info.handles as usize] {
                if p.peer == old {
                    p.peer = new;
                }
            }
        }
        for f in &mut self.fences {
            for p in &mut f.asked {
                if *p == old {
                    *p = new;
                }
            }
        }
    }

    /// Forgets `peer`; `gone` says the engine behind it is gone (lost or
    /// removed), not replaced by a newer entry of the same engine.
    fn drop_peer(&mut self, peer: PeerId, cause: Cause, gone: bool) {
        let Some(p) = self.peers.get_mut(peer.0 as usize).and_then(Option::take) else {
            return;
        };
        self.leaving.retain(|&l| l != peer);
        if self.by_instance.get(&p.instance) == Some(&peer) {
            self.by_instance.remove(&p.instance);
        }
        let events = &mut self.events;
        self.ledger
            .peer_lost_with(peer, Reason::of(cause), &mut |e| events.push(e));
        if gone {
            self.writer_lost(peer, p.instance);
        }
        self.push_on(peer, Action::ForgetPeer { peer });
    }

    // -- commands ---------------------------------------------------------

    /// One command from the engine; `next` yields the entries of its batch
    /// that follow (a request's plan).
    pub fn on_command(
        &mut self,
        cmd: Command,
        next: &mut dyn FnMut() -> Option<Command>,
        now: Nanos,
    ) {
        match cmd {
            Command::Begin {
                id,
                kind,
                handles,
                blocks,
                expires_in,
                token,
            } => {
                if self.read_plan(handles, blocks, next) {
                    self.begin(id, kind, token, now, expires_in);
                }
            }
            Command::Abort(id) => self.abort(id, now),
            Command::Heartbeat { id, extend_ns } => {
                let until = now.saturating_add(Nanos(extend_ns));
                self.ledger.heartbeat(id, until);
                if let Some(key) = self.ledger.key(id) {
                    for f in self.fences.iter_mut().filter(|f| f.key == key) {
                        f.due = f.due.max(until);
                    }
                }
            }
            #[cfg(feature = "fault-injection")]
            Command::Stall { .. } => {}
            // Plan entries are consumed with their Begin; a stray one is a
            // bug in the engine's batching and is skipped.
            Command::Handle { .. } | Command::Pair { .. } | Command::Block(_) => {}
        }
    }

    fn read_plan(
        &mut self,
        handles: u8,
        blocks: u32,
        next: &mut dyn FnMut() -> Option<Command>,
    ) -> bool {
        self.handle_peers.clear();
        self.handle_pairs.clear();
        self.handle_lends.clear();
        self.pairs.clear();
        self.blocks.clear();
        for _ in 0..handles {
            let Some(Command::Handle { peer, pairs, lend }) = next() else {
                return false;
            };
            self.handle_peers.push(peer);
            self.handle_pairs.push(pairs);
            self.handle_lends.push(lend);
            for _ in 0..pairs {
                let Some(Command::Pair { local, remote }) = next() else {
                    return false;
                };
                self.pairs.push((local, remote));
                self.blocks.push(local);
            }
        }
        for _ in 0..blocks {
            let Some(Command::Block(b)) = next() else {
                return false;
            };
            self.blocks.push(b);
        }
        true
    }

    /// Frees the slot of a request the engine consumed.
    pub fn retire(&mut self, key: RequestKey) {
        let _ = self.ledger.retire(key);
    }

    fn begin(&mut self, id: RequestId, kind: Kind, token: Incarnation, now: Nanos, lease_ns: u64) {
        let expires = now.saturating_add(Nanos(lease_ns));
        if kind == Kind::NotifyOnly {
            // Nothing to read, nothing tracked: each producer engine (once
            // per engine, whatever the handle count) hears that it may
            // release its lend.
            for i in 0..self.handle_peers.len() {
                let peer = self.handle_peers[i];
                if !self.handle_peers[..i].contains(&peer) {
                    let lend = self.handle_lends[i];
                    self.send_note(peer, None, NoteKind::GaveUp, id, lend, token, false);
                }
            }
            return;
        }
        // A push destination's lease is the core's (a fence, not a timer);
        // its handles, if any, name its writers: nothing is posted for them.
        let receive = matches!(kind, Kind::Receive { .. });
        if receive && !self.cfg.fence_push_leases {
            // A timer: its writers are not waited for (unsafe).
            self.handle_peers.clear();
            self.handle_pairs.clear();
            self.handle_lends.clear();
        }
        let fenced = receive && self.cfg.fence_push_leases;
        let named = fenced && !self.handle_peers.is_empty();
        if named {
            // Each writer engine counts once.
            let mut i = 0;
            while i < self.handle_peers.len() {
                if self.handle_peers[..i].contains(&self.handle_peers[i]) {
                    self.handle_peers.remove(i);
                    self.handle_lends.remove(i);
                } else {
                    i += 1;
                }
            }
        }
        let req = Request {
            id,
            kind,
            peers: if fenced { &[] } else { &self.handle_peers },
            blocks: &self.blocks,
            expires: if fenced { Nanos(u64::MAX) } else { expires },
        };
        let events = &mut self.events;
        let key = match self.ledger.begin(&req, &mut |e| events.push(e)) {
            Ok(Begun::Tracked(key)) => key,
            Ok(Begun::Untracked) => return,
            Err(_) => {
                // The engine validated the request; a refusal means the two
                // disagree (a bug). Nothing was tracked; it is counted.
                self.stats.refused_requests += 1;
                return;
            }
        };
        let slot = key.slot() as usize;
        if matches!(kind, Kind::Lend { .. } | Kind::Receive { .. }) {
            self.by_token.insert(token, key);
        }
        self.info[slot] = Info {
            generation: key.generation(),
            id,
            token,
            kind,
            handles: self.handle_peers.len() as u8,
            notified: 0,
            queried: false,
            abandoned: false,
            lease: lease_ns,
            quarantined: false,
            aborted: false,
            unnamed: receive && !named,
            words: 0,
        };
        if fenced {
            let base = slot * MAX_HANDLES;
            for h in 0..self.handle_peers.len() {
                self.progress[base + h] = Progress {
                    generation: key.generation(),
                    peer: self.handle_peers[h],
                    lend: token,
                    ..Progress::default()
                };
            }
            self.fences.push(Fence {
                key,
                due: expires,
                asked: Vec::new(),
            });
            // Open an endpoint to each writer now, so that its loss is seen
            // (UCX reports a failed endpoint) even if it never writes.
            self.each_peer_once(key, NoteKind::Heartbeat, false);
            self.take_early(token, now);
            self.after_events();
            return;
        }
        if matches!(kind, Kind::Lend { .. }) {
            self.take_early(token, now);
        }
        // Reads and writes in flight tell their lenders (producers, push
        // destinations) that they are still at it.
        if matches!(kind, Kind::Read | Kind::Write { .. }) && self.cfg.heartbeat != Nanos(u64::MAX)
        {
            // Reads that ended leave from the front as new ones come in;
            // a long read at the front can hold others behind it, so the
            // whole queue is swept if it grows past twice the slots.
            while self
                .beating
                .front()
                .is_some_and(|&(k, _)| !self.ledger.is_live(k))
            {
                self.beating.pop_front();
            }
            if self.beating.len() >= 2 * self.info.len() {
                // At most one live entry per slot: what goes is ended.
                let ledger = &self.ledger;
                self.beating.retain(|&(k, _)| ledger.is_live(k));
            }
            self.beating
                .push_back((key, now.saturating_add(self.cfg.heartbeat)));
        }
        if kind == Kind::Read && self.cfg.confirm_reads {
            // Finished only once each lender engine confirmed its lend was
            // live when the data was read.
            let distinct = (0..self.handle_peers.len())
                .filter(|&h| !self.handle_peers[..h].contains(&self.handle_peers[h]))
                .count();
            self.ledger.expect(key, distinct as u32);
        }
        let dir = match kind {
            Kind::Write { .. } => Direction::Put,
            _ => Direction::Get,
        };
        let mut start = 0u32;
        for h in 0..self.handle_peers.len() {
            let n = self.handle_pairs[h];
            self.start_handle(key, h as u8, dir, (start, n));
            start += n;
        }
        self.after_events();
    }

    fn start_handle(&mut self, key: RequestKey, h: u8, dir: Direction, range: (u32, u32)) {
        let Some(hk) = HandleKey::new(key, h) else {
            return;
        };
        let peer_id = self.handle_peers[h as usize];
        let lend = self.handle_lends[h as usize];
        let idx = Self::index(hk);
        self.progress[idx] = Progress {
            generation: key.generation(),
            peer: peer_id,
            lend,
            ..Progress::default()
        };
        if self.slots.posting(hk).is_err() {
            return; // cancelled before it was posted: the ledger stopped it
        }
        let leaving = !self.leaving.is_empty() && self.leaving.contains(&peer_id);
        let valid = match self.peers.get(peer_id.0 as usize).and_then(|p| p.as_ref()) {
            Some(_) if leaving => None,
            Some(p) => {
                let pairs = &self.pairs[range.0 as usize..(range.0 + range.1) as usize];
                let ok = p.regions == self.local_regions
                    && pairs.iter().all(|&(l, r)| {
                        u64::from(l.0) < self.local_blocks && u64::from(r.0) < p.blocks
                    });
                ok.then_some(p.ep(peer_id))
            }
            None => None,
        };
        let Some(ep) = valid else {
            let events = &mut self.events;
            let _ = self
                .slots
                .setup_failed(hk, Reason::of(Cause::Setup), &mut |e| events.push(e));
            return;
        };
        if dir == Direction::Put {
            // The destination already asked whether we would write this
            // and was told no: its blocks may hold another request now.
            let to = self.peers[peer_id.0 as usize].map(|p| p.instance);
            let quiet = to.is_some_and(|to| self.quiet.promised(to, lend));
            if quiet {
                let events = &mut self.events;
                let _ = self
                    .slots
                    .setup_failed(hk, Reason::of(Cause::LeaseLost), &mut |e| events.push(e));
                return;
            }
        }
        self.progress[idx].ep_generation = ep.generation;
        self.push_on(
            ep.peer,
            Action::Post {
                ep,
                dir,
                handle: hk,
                token: hk.to_u64() | T_DATA,
                pairs: range,
            },
        );
    }

    fn index(hk: HandleKey) -> usize {
        hk.key().slot() as usize * MAX_HANDLES + usize::from(hk.handle())
    }

    /// The result of an [`Action::Post`].
    pub fn on_posted(&mut self, hk: HandleKey, result: Result<u32, PostFailure>) {
        let idx = Self::index(hk);
        let (n, failure) = match result {
            Ok(n) => (n, None),
            Err(f) => (f.posted, Some(f.status)),
        };
        self.stats.ops_posted += u64::from(n);
        self.ops_in_flight += u64::from(n);
        let p = &mut self.progress[idx];
        p.remaining = n;
        if let Some(status) = failure {
            let cause = if n == 0 {
                Cause::Setup
            } else {
                Cause::Transfer
            };
            p.failure = Some(Reason::new(cause, status.min(-1)));
        }
        if n == 0 {
            let reason = p.failure.unwrap_or(Reason::of(Cause::Setup));
            let events = &mut self.events;
            let _ = self.slots.setup_failed(hk, reason, &mut |e| events.push(e));
            self.after_events();
        }
    }

    /// An [`Action::Flush`] could not be posted.
    pub fn on_flush_failed(&mut self, hk: HandleKey, status: i8) {
        let idx = Self::index(hk);
        let p = &mut self.progress[idx];
        if p.generation != hk.key().generation() || !p.flushing {
            return;
        }
        p.remaining = 0;
        p.flushing = false;
        let (peer, generation) = (p.peer, p.ep_generation);
        self.ops_in_flight = self.ops_in_flight.saturating_sub(1);
        let reason = self.cancel_reason(peer, generation, status);
        self.progress[idx].failure.get_or_insert(reason);
        self.handle_ended(hk);
    }

    /// An [`Action::Send`] or [`Action::Reply`] of `count` notifications
    /// could not be posted (they are lost; the other side's lease decides).
    pub fn on_send_failed(&mut self, count: u32) {
        self.notes_in_flight = self.notes_in_flight.saturating_sub(u64::from(count));
    }

    /// The result of an [`Action::Release`].
    pub fn on_released(&mut self, hk: HandleKey, released: bool, now: Nanos) {
        let idx = Self::index(hk);
        let p = self.progress[idx];
        if p.generation != hk.key().generation() || !p.releasing {
            return;
        }
        let result = match p.failure {
            None => Ok(()),
            Some(r) => Err(r),
        };
        let events = &mut self.events;
        let mut out = |e| events.push(e);
        if p.held {
            let _ = self.slots.release_retried(hk, released, &mut out);
        } else if released {
            let _ = self.slots.completed(hk, result, &mut out);
        } else {
            let _ = self.slots.release_failed(hk, result, &mut out);
        }
        if released {
            self.progress[idx].releasing = false;
            match self.info[hk.key().slot() as usize].kind {
                Kind::Write { .. } if p.ok => self.write_landed(hk),
                Kind::Read if self.cfg.confirm_reads => self.maybe_query(hk.key()),
                _ => {}
            }
        } else {
            self.progress[idx].held = true;
            self.held
                .push((hk, now.saturating_add(self.cfg.release_retry)));
        }
        self.after_events();
    }

    // -- transport events ---------------------------------------------------

    /// Something the transport saw.
    pub fn on_transport(&mut self, ev: TransportEvent<'_>, now: Nanos) {
        match ev {
            TransportEvent::Completion { token, status } => self.on_completion(token, status),
            TransportEvent::Message { payload, reply } => self.on_message(payload, reply, now),
            TransportEvent::EndpointFailed { ep, status } => self.on_endpoint_failed(ep, status),
        }
    }

    fn on_completion(&mut self, token: u64, status: i8) {
        let kind = token & KIND_MASK;
        if kind == T_NOTE {
            // A message completes for every notification it carried.
            let count = (token & !KIND_MASK).max(1);
            self.notes_in_flight = self.notes_in_flight.saturating_sub(count);
            return;
        }
        if kind == T_TRANSPORT {
            return;
        }
        self.ops_in_flight = self.ops_in_flight.saturating_sub(1);
        self.stats.ops_completed += 1;
        if kind == T_DATA && status == 0 {
            self.stats.blocks_moved += 1;
        }
        let hk = HandleKey::from_u64(token & !KIND_MASK);
        let idx = Self::index(hk);
        let Some(p) = self.progress.get(idx).copied() else {
            return;
        };
        if p.generation != hk.key().generation() || p.remaining == 0 || p.releasing {
            return; // not ours (cannot happen while slots retire after quiescence)
        }
        if status != 0 && p.failure.is_none() {
            let reason = self.cancel_reason(p.peer, p.ep_generation, status);
            self.progress[idx].failure = Some(reason);
        }
        self.progress[idx].remaining -= 1;
        if self.progress[idx].remaining > 0 {
            return;
        }
        let p = self.progress[idx];
        if kind == T_DATA && self.is_write(hk) {
            // Puts completed: flush the endpoint they travelled on before
            // anyone is told (a completed put only frees the source), even
            // if one failed (the others may still be landing, and the
            // destination's word about them must come after them). Never
            // a fresh endpoint: if that one is closed, the flush fails.
            let ep = Ep {
                peer: p.peer,
                generation: p.ep_generation,
            };
            self.progress[idx].flushing = true;
            self.progress[idx].remaining = 1;
            self.ops_in_flight += 1;
            self.push_on(
                ep.peer,
                Action::Flush {
                    ep,
                    handle: hk,
                    token: hk.to_u64() | T_FLUSH,
                },
            );
            return;
        }
        self.handle_ended(hk);
    }

    fn is_write(&self, hk: HandleKey) -> bool {
        matches!(self.info[hk.key().slot() as usize].kind, Kind::Write { .. })
    }

    /// The reason of an operation on `peer`'s endpoint generation that
    /// ended with `status`: a cancellation by our own forced close carries
    /// the close's cause (the peer stalled, the engine shut down).
    fn cancel_reason(&self, peer: PeerId, generation: u32, status: i8) -> Reason {
        let closed = self
            .peers
            .get(peer.0 as usize)
            .and_then(|p| p.as_ref())
            .and_then(|p| p.close_cause(generation));
        match closed {
            Some(cause) if status == CANCELED => Reason::new(cause, status),
            _ if peer_gone(status) => Reason::new(Cause::PeerLost, status),
            _ => Reason::new(Cause::Transfer, status.min(-1)),
        }
    }

    /// A handle's operations are all done: release it.
    fn handle_ended(&mut self, hk: HandleKey) {
        let idx = Self::index(hk);
        let p = &mut self.progress[idx];
        p.flushing = false;
        p.remaining = 0;
        p.releasing = true;
        p.ok = p.failure.is_none();
        self.actions.push_back(Action::Release { handle: hk });
    }

    /// A write handle ended well: once every handle of the request to the
    /// same destination engine did, that engine hears (once) that its
    /// blocks hold the data.
    fn write_landed(&mut self, hk: HandleKey) {
        let key = hk.key();
        let info = self.info[key.slot() as usize];
        let peer = self.progress[Self::index(hk)].peer;
        let base = key.slot() as usize * MAX_HANDLES;
        let all = (0..info.handles as usize).all(|h| {
            let p = &self.progress[base + h];
            p.peer != peer || (p.ok && !p.releasing && p.remaining == 0)
        });
        if all {
            let p = self.progress[Self::index(hk)];
            let on = Some(p.ep_generation);
            self.send_note(
                peer,
                on,
                NoteKind::WriteDone,
                info.id,
                p.lend,
                info.token,
                false,
            );
        }
    }

    /// A write ended without success: each destination engine not already
    /// told that its blocks hold the data hears that the write gave up, on
    /// the endpoint its puts travelled (after their flush), so that the
    /// word cannot overtake them.
    fn abandon_write(&mut self, key: RequestKey) {
        let slot = key.slot() as usize;
        let info = self.info[slot];
        let base = slot * MAX_HANDLES;
        for h in 0..info.handles as usize {
            let p = self.progress[base + h];
            if (0..h).any(|g| self.progress[base + g].peer == p.peer) {
                continue;
            }
            let done = (0..info.handles as usize).all(|g| {
                let q = &self.progress[base + g];
                q.peer != p.peer || q.ok
            });
            if !done {
                self.send_note(
                    p.peer,
                    // Never posted: nothing of it is on any endpoint.
                    Some(p.ep_generation).filter(|&g| g != 0),
                    NoteKind::WriteAbandoned,
                    info.id,
                    p.lend,
                    info.token,
                    false,
                );
            }
        }
    }

    /// Once every handle of read `key` landed without error, asks each of
    /// its lender engines (once) whether its lend was live: the read
    /// finishes only on their confirmations.
    fn maybe_query(&mut self, key: RequestKey) {
        let slot = key.slot() as usize;
        let info = self.info[slot];
        if info.queried || info.generation != key.generation() {
            return;
        }
        if !self.ledger.all_stopped_clean(key) {
            return;
        }
        self.info[slot].queried = true;
        self.each_peer_once(key, NoteKind::ReadDone, true);
    }

    /// Sends `kind` about request `key` once to each distinct peer of its
    /// handles, naming the incarnation each handle works on (and, for a
    /// read or a write, the request's own).
    fn each_peer_once(&mut self, key: RequestKey, kind: NoteKind, want_reply: bool) {
        let slot = key.slot() as usize;
        let info = self.info[slot];
        let nonce = match info.kind {
            Kind::Receive { .. } => Incarnation::NONE,
            _ => info.token,
        };
        let base = slot * MAX_HANDLES;
        for h in 0..info.handles as usize {
            let Progress { peer, lend, .. } = self.progress[base + h];
            let dup = (0..h).any(|g| self.progress[base + g].peer == peer);
            // A read of memory no lend guards has nobody to tell.
            if !dup && !lend.is_none() {
                self.send_note(peer, None, kind, info.id, lend, nonce, want_reply);
            }
        }
    }

    fn note(
        &self,
        kind: NoteKind,
        id: RequestId,
        incarnation: Incarnation,
        nonce: Incarnation,
    ) -> [u8; NOTE_LEN] {
        Notification {
            kind,
            id,
            incarnation,
            nonce,
            sender: self.cfg.instance,
        }
        .encode()
    }

    /// Adds `note` to the batch waiting for `to` (a new one if none, or if
    /// that one is full: it is queued first). Batches become actions when a
    /// post, flush, close or forget of their peer is queued (so nothing of
    /// that peer is reordered with them) or when the queue runs dry.
    fn enqueue_note(&mut self, to: NoteTarget, note: &[u8; NOTE_LEN], want_reply: bool) {
        self.notes_in_flight += 1;
        self.stats.notifications_sent += 1;
        let i = match self.batches.iter().position(|b| b.to == to) {
            Some(i) if self.batches[i].count as usize == MAX_PER_MESSAGE => {
                self.queue_batch(i);
                self.new_batch(to)
            }
            Some(i) => i,
            None => self.new_batch(to),
        };
        let b = &mut self.batches[i];
        let at = b.count as usize * NOTE_LEN;
        b.bytes[at..at + NOTE_LEN].copy_from_slice(note);
        b.count += 1;
        // Asking for answers costs nothing to the others.
        b.want_reply |= want_reply;
    }

    fn new_batch(&mut self, to: NoteTarget) -> usize {
        let fresh = Batch {
            to,
            want_reply: false,
            count: 0,
            bytes: [0; MAX_PER_MESSAGE * NOTE_LEN],
        };
        self.batches.push(fresh);
        self.batches.len() - 1
    }

    /// Queues batch `i` as one [`Action::Send`] or [`Action::Reply`].
    fn queue_batch(&mut self, i: usize) {
        let b = self.batches.swap_remove(i);
        if self.actions.is_empty() {
            // No queued action refers to these bytes any more.
            self.note_bytes.clear();
        }
        let notes = Notes {
            start: self.note_bytes.len() as u32,
            count: b.count,
        };
        self.note_bytes
            .extend_from_slice(&b.bytes[..b.count as usize * NOTE_LEN]);
        self.stats.notification_messages += 1;
        let token = T_NOTE | u64::from(b.count);
        self.actions.push_back(match b.to {
            NoteTarget::Ep(ep) => Action::Send {
                ep,
                notes,
                token,
                want_reply: b.want_reply,
            },
            NoteTarget::Reply(to) => Action::Reply { to, notes, token },
        });
    }

    /// Queues the notification batches to `peer` (before an action that
    /// must not overtake them).
    fn queue_batches_to(&mut self, peer: PeerId) {
        let mut i = 0;
        while i < self.batches.len() {
            if matches!(self.batches[i].to, NoteTarget::Ep(ep) if ep.peer == peer) {
                self.queue_batch(i);
            } else {
                i += 1;
            }
        }
    }

    /// Queues `action` on `peer`'s endpoint, after what was to be sent there.
    fn push_on(&mut self, peer: PeerId, action: Action) {
        if !self.batches.is_empty() {
            self.queue_batches_to(peer);
        }
        self.actions.push_back(action);
    }

    /// Queues a notification to `peer`, on endpoint generation `on` if given
    /// (a write-done must follow its flush) or the current one.
    #[allow(clippy::too_many_arguments)]
    fn send_note(
        &mut self,
        peer: PeerId,
        on: Option<u32>,
        kind: NoteKind,
        id: RequestId,
        incarnation: Incarnation,
        nonce: Incarnation,
        want_reply: bool,
    ) {
        let Some(p) = self.peers.get(peer.0 as usize).and_then(|p| p.as_ref()) else {
            return;
        };
        let ep = Ep {
            peer,
            generation: on.unwrap_or(p.generation),
        };
        let note = self.note(kind, id, incarnation, nonce);
        self.enqueue_note(NoteTarget::Ep(ep), &note, want_reply);
    }

    /// Answers received note `to_note` through its reply handle, if its
    /// sender asked for answers, naming the same incarnation and nonce.
    fn answer(&mut self, reply: Option<u32>, kind: NoteKind, to_note: &Notification) {
        if let Some(to) = reply {
            let note = self.note(kind, to_note.id, to_note.incarnation, to_note.nonce);
            self.enqueue_note(NoteTarget::Reply(to), &note, false);
        }
    }

    /// Acknowledges writer engine `done.sender`'s push, through its
    /// endpoint, naming the write's nonce.
    fn acknowledge(&mut self, done: &Notification) {
        if let Some(&peer) = self.by_instance.get(&done.sender) {
            let (id, inc, nonce) = (done.id, done.incarnation, done.nonce);
            self.send_note(peer, None, NoteKind::Ack, id, inc, nonce, false);
        }
    }

    fn on_message(&mut self, bytes: &[u8], reply: Option<u32>, now: Nanos) {
        let Ok(notes) = crate::notification::split(bytes) else {
            self.stats.malformed_notifications += 1;
            return;
        };
        for b in notes {
            match Notification::decode(b) {
                Ok(note) => self.accept(note, reply, now),
                Err(_) => self.stats.malformed_notifications += 1,
            }
        }
        self.after_events();
    }

    fn reject(&mut self) {
        self.stats.rejected_notifications += 1;
        self.slots.count_rejected_notification();
    }

    /// Checks a notification against the request and incarnation it names
    /// and hands it to the role it is for; each remote engine counts once
    /// per request. Refusals are counted; a note naming an incarnation
    /// other than the live one never touches it.
    fn accept(&mut self, note: Notification, reply: Option<u32>, now: Nanos) {
        let live = self.ledger.key(note.id).filter(|k| {
            let info = &self.info[k.slot() as usize];
            info.generation == k.generation()
        });
        match note.kind {
            NoteKind::ReadDone | NoteKind::GaveUp | NoteKind::Heartbeat
                if self.owns(live, &note, |k| matches!(k, Kind::Lend { .. })) =>
            {
                self.lend_note(live.expect("owned"), &note, reply, now)
            }
            NoteKind::WriteDone
            | NoteKind::WriteAbandoned
            | NoteKind::WriteQuiet
            | NoteKind::Heartbeat
                if self.owns(live, &note, |k| matches!(k, Kind::Receive { .. })) =>
            {
                self.receive_note(live.expect("owned"), &note, now)
            }
            NoteKind::ReadConfirmed | NoteKind::ReadRefused | NoteKind::ReadPending => {
                match live.filter(|&k| self.attempt_of(k, &note, Kind::Read)) {
                    Some(key) => self.read_answer(key, &note, now),
                    None => self.stale(),
                }
            }
            NoteKind::Ack => {
                match live.filter(|&k| self.attempt_of(k, &note, Kind::Write { acks: 0 })) {
                    Some(key) => {
                        // Only an engine this write wrote to can acknowledge it.
                        let slot = key.slot() as usize;
                        if self.seen(slot, note.sender) {
                            return self.reject();
                        }
                        if self.ledger_notify(note.id) {
                            self.counted(slot, note.sender);
                        }
                    }
                    None => self.stale(),
                }
            }
            NoteKind::WriteQuery => self.write_query(live, &note, reply),
            // A destination opened its endpoint to a writer: nothing to do.
            NoteKind::Heartbeat => {}
            // About the live request of that incarnation, but of a kind it
            // does not take.
            _ if live.is_some_and(|k| self.info[k.slot() as usize].token == note.incarnation) => {
                self.reject()
            }
            _ if self.names_another(&note) => self.stale(),
            _ => self.early(&note, reply, now),
        }
    }

    /// Whether `key` is the live lend or push destination (`kind`) that
    /// `note` names by its incarnation.
    fn owns(&self, key: Option<RequestKey>, note: &Notification, kind: fn(Kind) -> bool) -> bool {
        key.is_some_and(|k| {
            let info = &self.info[k.slot() as usize];
            kind(info.kind) && info.token == note.incarnation
        })
    }

    /// Whether `note` names a live lend or push destination of another
    /// request id (a note that mixes one request's id with another's
    /// incarnation).
    fn names_another(&self, note: &Notification) -> bool {
        self.by_token
            .get(&note.incarnation)
            .is_some_and(|k| self.info[k.slot() as usize].id != note.id)
    }

    /// Whether `note` answers live read or write `key`'s own attempt (its
    /// nonce) from an engine one of its handles works with, about the
    /// incarnation that handle names.
    fn attempt_of(&self, key: RequestKey, note: &Notification, kind: Kind) -> bool {
        let slot = key.slot() as usize;
        let info = &self.info[slot];
        if std::mem::discriminant(&info.kind) != std::mem::discriminant(&kind)
            || info.token != note.nonce
        {
            return false;
        }
        let Some(&peer) = self.by_instance.get(&note.sender) else {
            return false;
        };
        let base = slot * MAX_HANDLES;
        (0..info.handles as usize).any(|h| {
            let p = &self.progress[base + h];
            p.peer == peer && p.lend == note.incarnation
        })
    }

    /// Whether engine `sender` was counted for the request in `slot`.
    fn seen(&self, slot: usize, sender: u64) -> bool {
        let n = usize::from(self.info[slot].notified);
        self.notifiers[slot * MAX_CONSUMERS..slot * MAX_CONSUMERS + n].contains(&sender)
    }

    /// A note that names no live incarnation of its request: refused.
    fn stale(&mut self) {
        self.stats.stale_notifications += 1;
        self.reject();
    }

    /// A note for a lend or push destination this engine does not hold
    /// under that incarnation. One that ended: refused. One not begun yet
    /// (the note overtook the lend on its way to this poller): a read's
    /// question is answered pending (the reader asks again); a give-up or a
    /// writer's word is held until the lend begins or the grace period
    /// ends.
    fn early(&mut self, note: &Notification, reply: Option<u32>, now: Nanos) {
        let ended = self.ended.contains(note.incarnation);
        match note.kind {
            NoteKind::ReadDone if ended => self.answer(reply, NoteKind::ReadRefused, note),
            NoteKind::ReadDone => {
                self.stats.early_notes += 1;
                self.answer(reply, NoteKind::ReadPending, note);
            }
            NoteKind::GaveUp | NoteKind::WriteDone | NoteKind::WriteAbandoned if !ended => {
                self.stats.early_notes += 1;
                while self.early.front().is_some_and(|&(t, _)| t <= now) {
                    self.early.pop_front();
                }
                if self.early.len() == EARLY_HELD {
                    self.early.pop_front();
                }
                self.early
                    .push_back((now.saturating_add(self.cfg.lend_grace), *note));
            }
            // A reader that gave up on a lend that ended, a heartbeat for
            // one: nothing to do.
            NoteKind::GaveUp => {}
            _ => self.stale(),
        }
    }

    /// The notes held for incarnation `token`, which just began, are taken
    /// as if they arrived now.
    fn take_early(&mut self, token: Incarnation, now: Nanos) {
        if self.early.is_empty() {
            return;
        }
        let mut i = 0;
        while i < self.early.len() {
            let (until, note) = self.early[i];
            if note.incarnation == token && until > now {
                self.early.remove(i);
                self.accept(note, None, now);
            } else {
                i += 1;
            }
        }
    }

    /// A reader's note about lend `key` (the incarnation it names).
    fn lend_note(&mut self, key: RequestKey, note: &Notification, reply: Option<u32>, now: Nanos) {
        let slot = key.slot() as usize;
        let info = self.info[slot];
        let (seen, n) = (self.seen(slot, note.sender), usize::from(info.notified));
        match note.kind {
            NoteKind::ReadDone => {
                // The read happened before this question, and after the
                // engine lent the blocks (the reader holds the lend's
                // token, which the engine drew then): the lend was live
                // for it if it is live now and this engine has not been
                // counted (a second read of a consumed lend is refused).
                let confirmed = if seen || n == MAX_CONSUMERS {
                    self.reject();
                    false
                } else if self.ledger_notify(note.id) {
                    true
                } else {
                    // Not live any more: the ledger counted the refusal.
                    self.stats.rejected_notifications += 1;
                    false
                };
                if confirmed {
                    self.counted(slot, note.sender);
                    self.answer(reply, NoteKind::ReadConfirmed, note);
                } else {
                    self.answer(reply, NoteKind::ReadRefused, note);
                }
            }
            NoteKind::Heartbeat => {
                // A reader is still at it: keep the lend as long again.
                let until = now.saturating_add(Nanos(info.lease));
                self.ledger.heartbeat(note.id, until);
            }
            _ => {
                // That engine will not read (its read stopped): stop waiting.
                if !seen && n < MAX_CONSUMERS && self.ledger_notify(note.id) {
                    self.counted(slot, note.sender);
                }
            }
        }
    }

    /// A writer's note about push destination `key`.
    fn receive_note(&mut self, key: RequestKey, note: &Notification, now: Nanos) {
        let slot = key.slot() as usize;
        let info = self.info[slot];
        let Kind::Receive { writers } = info.kind else {
            return;
        };
        let (seen, n) = (self.seen(slot, note.sender), usize::from(info.notified));
        let sender = self.by_instance.get(&note.sender).copied();
        match note.kind {
            NoteKind::WriteDone | NoteKind::WriteAbandoned => {
                let named = !info.unnamed;
                if seen || n == MAX_CONSUMERS || (named && !self.is_party(slot, note.sender)) {
                    return self.reject();
                }
                self.counted(slot, note.sender);
                self.answered(key, sender);
                let words = info.words.saturating_add(1);
                self.info[slot].words = words;
                let abandoned = info.abandoned || note.kind == NoteKind::WriteAbandoned;
                self.info[slot].abandoned = abandoned;
                let counted = if abandoned && u32::from(words) >= writers {
                    // Every writer has spoken and one gave up: nothing more
                    // lands; the blocks hold partial data.
                    self.ledger_fail(key, Cause::LeaseLost);
                    false
                } else {
                    self.ledger_notify(note.id)
                };
                // Acknowledged only if its data counted: a destination that
                // failed (or whose lease ran out) does not hold it.
                if note.kind == NoteKind::WriteDone && counted {
                    self.acknowledge(note);
                }
                self.lift_fence(key);
            }
            NoteKind::WriteQuiet => {
                // A writer this destination asked: nothing of it will land.
                let asked = info.unnamed
                    && sender
                        .is_some_and(|p| self.fence_of(key).is_some_and(|f| f.asked.contains(&p)));
                if !asked && (seen || n == MAX_CONSUMERS || !self.is_party(slot, note.sender)) {
                    return self.reject();
                }
                if !info.unnamed {
                    self.counted(slot, note.sender);
                }
                self.answered(key, sender);
                self.lift_fence(key);
            }
            _ => {
                // A writer still at it: keep the lease as long again.
                let until = now.saturating_add(Nanos(info.lease));
                if !info.quarantined {
                    for f in self.fences.iter_mut().filter(|f| f.key == key) {
                        f.due = f.due.max(until);
                    }
                }
            }
        }
    }

    fn fence_of(&self, key: RequestKey) -> Option<&Fence> {
        self.fences.iter().find(|f| f.key == key)
    }

    /// Peer `peer` answered push destination `key`'s question (or spoke):
    /// it is not waited for any more.
    fn answered(&mut self, key: RequestKey, peer: Option<PeerId>) {
        let Some(peer) = peer else {
            return;
        };
        for f in self.fences.iter_mut().filter(|f| f.key == key) {
            f.asked.retain(|&p| p != peer);
        }
    }

    /// A lender's answer to read `key`'s question.
    fn read_answer(&mut self, key: RequestKey, note: &Notification, now: Nanos) {
        let slot = key.slot() as usize;
        if self.seen(slot, note.sender) {
            return self.reject();
        }
        let Some(&peer) = self.by_instance.get(&note.sender) else {
            return self.reject();
        };
        match note.kind {
            NoteKind::ReadConfirmed => {
                self.counted(slot, note.sender);
                self.asking.retain(|a| a.key != key || a.peer != peer);
                self.ledger_confirm(note.id, key);
            }
            NoteKind::ReadRefused => {
                self.counted(slot, note.sender);
                self.ledger_fail(key, Cause::LeaseLost);
            }
            _ => {
                // The lender does not know the lend yet: ask again, later,
                // until the grace period ends.
                let grace = self.cfg.lend_grace;
                let i = match self
                    .asking
                    .iter()
                    .position(|a| a.key == key && a.peer == peer)
                {
                    Some(i) => i,
                    None => {
                        self.asking.push(Ask {
                            key,
                            peer,
                            due: Nanos(u64::MAX),
                            until: now.saturating_add(grace),
                            wait: Nanos(ASK_FIRST.0 / 2),
                        });
                        self.asking.len() - 1
                    }
                };
                let a = &mut self.asking[i];
                if now >= a.until {
                    self.asking.swap_remove(i);
                    self.counted(slot, note.sender);
                    self.ledger_fail(key, Cause::LeaseLost);
                } else {
                    a.wait = Nanos((a.wait.0 * 2).min(ASK_MAX.0));
                    a.due = now.saturating_add(a.wait);
                }
            }
        }
    }

    /// A push destination asks whether anything of ours will still land in
    /// it (the incarnation it names): quiet unless a write of ours has puts
    /// in flight to the asking engine for that incarnation — then its word
    /// follows them. A quiet answer is a promise: no write into that
    /// incarnation is posted from now on.
    fn write_query(&mut self, live: Option<RequestKey>, note: &Notification, reply: Option<u32>) {
        let asker = self.by_instance.get(&note.sender).copied();
        if let (Some(key), Some(peer)) = (live, asker) {
            let slot = key.slot() as usize;
            let info = self.info[slot];
            let base = slot * MAX_HANDLES;
            let in_flight = matches!(info.kind, Kind::Write { .. })
                && (0..info.handles as usize).any(|h| {
                    let p = &self.progress[base + h];
                    p.peer == peer && p.lend == note.incarnation && p.remaining > 0
                });
            if in_flight {
                return;
            }
        }
        let by_instance = &self.by_instance;
        self.quiet.promise(note.sender, note.incarnation, |e| {
            by_instance.contains_key(&e)
        });
        self.answer(reply, NoteKind::WriteQuiet, note);
    }

    fn ledger_notify(&mut self, id: RequestId) -> bool {
        let events = &mut self.events;
        self.ledger.notify(id, 1, &mut |e| events.push(e)).is_ok()
    }

    fn ledger_confirm(&mut self, id: RequestId, key: RequestKey) {
        let events = &mut self.events;
        let _ = self.ledger.confirm(id, key, &mut |e| events.push(e));
    }

    fn ledger_fail(&mut self, key: RequestKey, cause: Cause) {
        let events = &mut self.events;
        self.ledger.fail(key, cause, &mut |e| events.push(e));
    }

    /// A quarantined push destination is released once nothing can land
    /// in it any more: every writer it asked (or named) has spoken,
    /// answered quiet or was lost — or, lent to unnamed writers, as many
    /// as it was lent to have spoken.
    fn lift_fence(&mut self, key: RequestKey) {
        let slot = key.slot() as usize;
        let info = self.info[slot];
        if !info.quarantined || info.generation != key.generation() {
            return;
        }
        let base = slot * MAX_HANDLES;
        let spoke = &self.notifiers[slot * MAX_CONSUMERS..][..usize::from(info.notified)];
        let all_fenced = if info.unnamed {
            // Every peer it asked answered, spoke or was lost.
            self.fence_of(key).is_none_or(|f| f.asked.is_empty())
        } else {
            (0..info.handles as usize).all(|h| {
                // A peer no longer known was lost (and counted then), or
                // replaced under a new id that its handle names now.
                let peer = self.progress[base + h].peer;
                match self.peers.get(peer.0 as usize).and_then(|p| p.as_ref()) {
                    Some(p) => spoke.contains(&p.instance),
                    None => true,
                }
            })
        };
        let enough = info.unnamed
            && matches!(info.kind, Kind::Receive { writers } if u32::from(info.words) >= writers);
        if all_fenced || enough {
            self.info[slot].quarantined = false;
            self.stats.quarantined_now = self.stats.quarantined_now.saturating_sub(1);
            let cause = if self.shutting_down {
                Cause::Shutdown
            } else if info.aborted {
                Cause::Aborted
            } else if info.abandoned {
                Cause::LeaseLost
            } else {
                Cause::LeaseExpired
            };
            self.ledger_fail(key, cause);
        }
    }

    /// Push destinations whose lease ran out are quarantined (their
    /// writers asked); quarantined ones whose writers are still silent are
    /// asked again.
    fn expire_fences(&mut self, now: Nanos) {
        let mut i = 0;
        while i < self.fences.len() {
            let (key, due) = (self.fences[i].key, self.fences[i].due);
            if !self.fence_live(key) {
                self.fences.swap_remove(i);
                continue;
            }
            if due <= now {
                if self.info[key.slot() as usize].quarantined {
                    self.query_writers(key);
                } else {
                    self.quarantine(key);
                }
                if !self.fence_live(key) {
                    self.fences.swap_remove(i);
                    continue;
                }
                let lease = Nanos(self.info[key.slot() as usize].lease);
                self.fences[i].due = now.saturating_add(lease.max(REQUERY_MIN));
            }
            i += 1;
        }
    }

    fn fence_live(&self, key: RequestKey) -> bool {
        self.info[key.slot() as usize].generation == key.generation() && self.ledger.is_live(key)
    }

    /// Push destination `key` stops being a timer and becomes a fence: its
    /// blocks are held (not reported) until every writer that could still
    /// write into them has spoken, answered quiet or been lost. Unnamed
    /// writers could be any peer: every peer is asked.
    fn quarantine(&mut self, key: RequestKey) {
        let slot = key.slot() as usize;
        self.info[slot].quarantined = true;
        self.stats.quarantined_receives += 1;
        self.stats.quarantined_now += 1;
        if self.info[slot].unnamed {
            // Every peer known now, however many, that has not spoken.
            let spoke =
                &self.notifiers[slot * MAX_CONSUMERS..][..usize::from(self.info[slot].notified)];
            let asked: Vec<PeerId> = self
                .peers
                .iter()
                .enumerate()
                .filter_map(|(i, p)| {
                    p.filter(|p| !spoke.contains(&p.instance))
                        .map(|_| PeerId(i as u32))
                })
                .collect();
            if let Some(f) = self.fences.iter_mut().find(|f| f.key == key) {
                f.asked = asked;
            }
        }
        self.query_writers(key);
        self.lift_fence(key);
    }

    /// Asks each writer of quarantined push destination `key` that has not
    /// spoken whether anything of it will still land.
    fn query_writers(&mut self, key: RequestKey) {
        let slot = key.slot() as usize;
        let info = self.info[slot];
        if info.unnamed {
            let asked = self
                .fence_of(key)
                .map(|f| f.asked.clone())
                .unwrap_or_default();
            for peer in asked {
                self.send_note(
                    peer,
                    None,
                    NoteKind::WriteQuery,
                    info.id,
                    info.token,
                    Incarnation::NONE,
                    true,
                );
            }
            return;
        }
        let base = slot * MAX_HANDLES;
        for h in 0..info.handles as usize {
            let peer = self.progress[base + h].peer;
            let Some(instance) = self
                .peers
                .get(peer.0 as usize)
                .and_then(|p| p.map(|p| p.instance))
            else {
                continue;
            };
            let spoke = self.notifiers[slot * MAX_CONSUMERS..]
                [..usize::from(self.info[slot].notified)]
                .contains(&instance);
            if !spoke && !(0..h).any(|g| self.progress[base + g].peer == peer) {
                let (id, inc) = (info.id, info.token);
                self.send_note(
                    peer,
                    None,
                    NoteKind::WriteQuery,
                    id,
                    inc,
                    Incarnation::NONE,
                    true,
                );
            }
        }
    }

    /// Writer `instance` (peer `peer`) is gone: the push destinations that
    /// named it and did not hear from it count it as having given up.
    fn writer_lost(&mut self, peer: PeerId, instance: u64) {
        // Destinations lent to unnamed writers that asked it stop waiting.
        let mut lifted = Vec::new();
        for f in &mut self.fences {
            if f.asked.contains(&peer) {
                f.asked.retain(|&p| p != peer);
                lifted.push(f.key);
            }
        }
        for key in lifted {
            self.lift_fence(key);
        }
        for slot in 0..self.info.len() {
            let info = self.info[slot];
            if !matches!(info.kind, Kind::Receive { .. }) || info.handles == 0 || info.unnamed {
                continue;
            }
            let key = RequestKey::new(slot as u32, info.generation);
            if self.ledger.expiry(key).is_none() {
                continue;
            }
            let base = slot * MAX_HANDLES;
            let named = (0..info.handles as usize).any(|h| self.progress[base + h].peer == peer);
            let n = usize::from(info.notified);
            let spoke =
                self.notifiers[slot * MAX_CONSUMERS..slot * MAX_CONSUMERS + n].contains(&instance);
            if named && !spoke {
                self.counted(slot, instance);
                self.info[slot].abandoned = true;
                if self.info[slot].quarantined {
                    self.lift_fence(key);
                } else if usize::from(self.info[slot].notified) >= usize::from(info.handles) {
                    self.ledger_fail(key, Cause::PeerLost);
                }
            }
        }
    }

    /// Remembers that engine `sender` was counted for the request in `slot`.
    fn counted(&mut self, slot: usize, sender: u64) {
        let n = usize::from(self.info[slot].notified);
        if n < MAX_CONSUMERS {
            self.notifiers[slot * MAX_CONSUMERS + n] = sender;
            self.info[slot].notified += 1;
        }
    }

    /// Whether engine `instance` is the peer of one of the request's handles.
    fn is_party(&self, slot: usize, instance: u64) -> bool {
        let Some(&peer) = self.by_instance.get(&instance) else {
            return false;
        };
        let base = slot * MAX_HANDLES;
        (0..self.info[slot].handles as usize).any(|h| self.progress[base + h].peer == peer)
    }

    fn on_endpoint_failed(&mut self, ep: Ep, status: i8) {
        let current = matches!(
            self.peers.get(ep.peer.0 as usize),
            Some(Some(p)) if p.generation == ep.generation
        );
        if current {
            // Rule 9: fail its handles (deferred) and drop the peer at once;
            // add_peer with fresh metadata works again. The engine hears
            // of it.
            self.stats.peers_lost += 1;
            self.lost
                .push((ep.peer, Reason::new(Cause::PeerLost, status.min(-1))));
            self.drop_peer(ep.peer, Cause::PeerLost, true);
            self.after_events();
        }
    }

    // -- aborts, deadlines, time -----------------------------------------

    fn abort(&mut self, id: RequestId, now: Nanos) {
        if let Some(key) = self.ledger.key(id) {
            let slot = key.slot() as usize;
            let info = self.info[slot];
            let fenced = matches!(info.kind, Kind::Receive { .. });
            // A destination already reported (not yet polled) stays as it
            // was reported: nothing to fence again.
            if fenced && info.generation == key.generation() && !self.ledger.is_live(key) {
                return;
            }
            if fenced && info.generation == key.generation() {
                // Its writers may still be writing: fence them first, as at
                // the lease's end.
                self.info[slot].aborted = true;
                if !info.quarantined {
                    self.quarantine(key);
                    let requery = now.saturating_add(Nanos(info.lease).max(REQUERY_MIN));
                    for f in self.fences.iter_mut().filter(|f| f.key == key) {
                        f.due = requery;
                    }
                }
                self.after_events();
                return;
            }
        }
        let events = &mut self.events;
        // An abort touches only its own request: what is not posted stops
        // now, what is posted completes (or fails) on its own. Nothing is
        // force-closed, so no sibling on the same endpoint is hurt.
        if let Ok(Some(c)) = self.ledger.abort(id, &mut |e| events.push(e)) {
            let expires = self.ledger.expiry(c.key).unwrap_or(now);
            self.aborted.push((c.key, expires));
        }
        self.after_events();
    }

    /// Time is now `now`: retries that are due, deadlines and leases that
    /// passed.
    pub fn advance(&mut self, now: Nanos) {
        let mut i = 0;
        while i < self.held.len() {
            if self.held[i].1 <= now {
                let (hk, _) = self.held.swap_remove(i);
                self.actions.push_back(Action::Release { handle: hk });
            } else {
                i += 1;
            }
        }
        let events = &mut self.events;
        let cancels = &mut self.cancels;
        self.ledger
            .advance(now, &mut |e| events.push(e), &mut |c| cancels.push(c));
        // An aborted request past its own expiry with operations still out:
        // their peer is stalled too.
        let mut i = 0;
        while i < self.aborted.len() {
            let (key, expires) = self.aborted[i];
            let in_flight = self.ledger.in_flight(key);
            if in_flight == 0 {
                self.aborted.swap_remove(i);
            } else if expires <= now {
                self.cancels.push(Cancel {
                    key,
                    handles: in_flight,
                });
                self.aborted.swap_remove(i);
            } else {
                i += 1;
            }
        }
        self.apply_cancels(Cause::PeerStalled);
        self.beat(now);
        self.ask_again(now);
        self.expire_fences(now);
        self.after_events();
    }

    /// Reads told their lend is not known yet ask again when due.
    fn ask_again(&mut self, now: Nanos) {
        let mut i = 0;
        while i < self.asking.len() {
            let a = self.asking[i];
            if !self.ledger.is_live(a.key)
                || self.info[a.key.slot() as usize].generation != a.key.generation()
            {
                self.asking.swap_remove(i);
                continue;
            }
            if a.due <= now {
                self.asking[i].due = Nanos(u64::MAX);
                let slot = a.key.slot() as usize;
                let info = self.info[slot];
                let base = slot * MAX_HANDLES;
                let lend = (0..info.handles as usize)
                    .map(|h| self.progress[base + h])
                    .find(|p| p.peer == a.peer)
                    .map_or(Incarnation::NONE, |p| p.lend);
                self.send_note(
                    a.peer,
                    None,
                    NoteKind::ReadDone,
                    info.id,
                    lend,
                    info.token,
                    true,
                );
            }
            i += 1;
        }
    }

    /// Reads still in flight whose heartbeat is due tell their lenders.
    fn beat(&mut self, now: Nanos) {
        // Due entries are at the front; one that beats goes to the back
        // (due a period from now: no earlier than any entry there).
        let mut due_now = 0;
        for &(_, due) in &self.beating {
            if due > now {
                break;
            }
            due_now += 1;
        }
        for _ in 0..due_now {
            let Some((key, _)) = self.beating.pop_front() else {
                break;
            };
            if !self.ledger.is_live(key) {
                continue;
            }
            self.each_peer_once(key, NoteKind::Heartbeat, false);
            self.beating
                .push_back((key, now.saturating_add(self.cfg.heartbeat)));
        }
    }

    /// When the core next needs [`Core::advance`] (`None`: only when
    /// something happens).
    pub fn next_deadline(&self) -> Option<Nanos> {
        let mut t = self.ledger.next_expiry();
        for &(_, due) in &self.held {
            t = t.min(due);
        }
        for &(_, due) in &self.aborted {
            t = t.min(due);
        }
        if let Some(&(_, due)) = self.beating.front() {
            t = t.min(due);
        }
        for f in &self.fences {
            t = t.min(f.due);
        }
        for a in &self.asking {
            t = t.min(a.due);
        }
        (t != Nanos(u64::MAX)).then_some(t)
    }

    /// Force-closes the endpoints carrying cancelled handles: UCX completes
    /// their operations with `UCS_ERR_CANCELED`, which stops the handles;
    /// every other request on those endpoints fails with `cause`.
    ///
    /// A write is never force-closed at its lease's end: its puts already
    /// on the wire could land after a message on a fresh endpoint, so the
    /// destination could not tell when they stopped. It waits for them to
    /// complete or fail; its word (done or abandoned) then follows them on
    /// the same endpoint, after a flush.
    fn apply_cancels(&mut self, cause: Cause) {
        while let Some(c) = self.cancels.pop() {
            if matches!(self.info[c.key.slot() as usize].kind, Kind::Write { .. }) {
                continue;
            }
            let base = c.key.slot() as usize * MAX_HANDLES;
            for h in crate::ledger::bits(c.handles) {
                let p = self.progress[base + usize::from(h)];
                self.close(p.peer, p.ep_generation, cause);
            }
        }
    }

    /// Force-closes `peer`'s endpoint generation `generation` if it is the
    /// current one; later operations go to a fresh endpoint.
    fn close(&mut self, peer: PeerId, generation: u32, cause: Cause) {
        let Some(Some(p)) = self.peers.get_mut(peer.0 as usize) else {
            return;
        };
        if p.generation != generation {
            return; // closed already
        }
        p.closes.rotate_right(1);
        p.closes[0] = (generation, cause);
        p.generation = generation.wrapping_add(1);
        if cause == Cause::PeerStalled {
            self.stats.stall_closes += 1;
        }
        self.push_on(
            peer,
            Action::Close {
                ep: Ep { peer, generation },
            },
        );
    }

    /// After events were produced: a read or write that ended without
    /// success tells the engines it was working with, once each, so that
    /// they stop waiting for it (their lends and receives are released at
    /// once instead of at their lease's end). The report means quiescence:
    /// nothing of this request is in flight any more.
    fn after_events(&mut self) {
        while self.scanned < self.events.len() {
            let ev = self.events[self.scanned];
            self.scanned += 1;
            if !ev.outcome.is_terminal() {
                continue;
            }
            let slot = ev.key.slot() as usize;
            let info = self.info[slot];
            if info.generation != ev.key.generation() {
                continue;
            }
            if matches!(info.kind, Kind::Lend { .. } | Kind::Receive { .. }) {
                // Its incarnation is over: a late question about it is
                // refused at once.
                self.by_token.remove(&info.token);
                self.ended.record(info.token);
            }
            if ev.outcome == Outcome::Finished {
                if info.kind == Kind::Read && !self.cfg.confirm_reads {
                    // Unconfirmed reads tell their lenders afterwards.
                    self.each_peer_once(ev.key, NoteKind::ReadDone, false);
                }
                continue;
            }
            let unsuccessful = matches!(ev.outcome, Outcome::Failed(_) | Outcome::SendExpired);
            match info.kind {
                Kind::Read if unsuccessful => self.each_peer_once(ev.key, NoteKind::GaveUp, false),
                Kind::Write { .. } if unsuccessful => self.abandon_write(ev.key),
                _ => {}
            }
        }
        if !self.leaving.is_empty() {
            self.retire_leaving();
        }
        if self.shutting_down {
            // Endpoints left open at shutdown for puts that have ended now.
            self.close_all(Cause::Shutdown);
        }
    }

    // -- the end --------------------------------------------------------------

    /// Shutdown: every request still tracked is cancelled (cause
    /// `Shutdown`) and every endpoint force-closed. The driver then
    /// progresses until [`Core::outstanding`] is 0 and publishes the reports.
    ///
    /// Push destinations are fences to the end: each is quarantined (its
    /// silent writers asked) and reported once they answered or were lost;
    /// writes are not force-closed under their puts (they complete or
    /// fail on their own, and their word follows them). The driver goes on
    /// until [`Core::quarantined`] and [`Core::outstanding`] are 0, within
    /// its bound.
    pub fn shutdown(&mut self) {
        if self.shutting_down {
            return;
        }
        self.shutting_down = true;
        let fences: Vec<RequestKey> = self.fences.iter().map(|f| f.key).collect();
        for key in fences {
            if self.fence_live(key) && !self.info[key.slot() as usize].quarantined {
                self.quarantine(key);
            }
        }
        let info = &self.info;
        let events = &mut self.events;
        let cancels = &mut self.cancels;
        self.ledger.cancel_all_but(
            Cause::Shutdown,
            |slot| matches!(info[slot as usize].kind, Kind::Receive { .. }),
            &mut |e| events.push(e),
            &mut |c| cancels.push(c),
        );
        self.cancels.clear();
        self.close_all(Cause::Shutdown);
        self.after_events();
    }

    /// Push destinations quarantined now (waiting for writers to answer).
    pub fn quarantined(&self) -> u64 {
        self.stats.quarantined_now
    }

    /// Whether a write has puts (or their flush) in flight to `peer`.
    fn puts_in_flight(&self, peer: PeerId) -> bool {
        self.progress.iter().enumerate().any(|(i, p)| {
            p.peer == peer
                && p.remaining > 0
                && matches!(self.info[i / MAX_HANDLES].kind, Kind::Write { .. })
                && self.info[i / MAX_HANDLES].generation == p.generation
        })
    }

    /// Force-closes every open endpoint: whatever is outstanding completes
    /// (cancelled) and nothing more can reach a peer's memory through them.
    ///
    /// At shutdown, an endpoint carrying puts is closed only once they
    /// completed (or failed): a cancelled put may still land, after any
    /// word of ours on another endpoint.
    pub fn close_all(&mut self, cause: Cause) {
        for i in 0..self.peers.len() {
            if let Some(p) = self.peers[i] {
                let peer = PeerId(i as u32);
                let closed = p.closes[0] == (p.generation.wrapping_sub(1), Cause::Shutdown);
                if cause == Cause::Shutdown && (closed || self.puts_in_flight(peer)) {
                    continue;
                }
                self.close(peer, p.generation, cause);
            }
        }
    }

    /// Whether nothing is outstanding any more.
    pub fn quiescent(&self) -> bool {
        self.ops_in_flight == 0 && self.held.is_empty()
    }

    /// The driver can go on no more (its thread died, or shutdown timed
    /// out): every request still tracked is reported failed with `cause`.
    pub fn abandon(&mut self, cause: Cause) {
        let events = &mut self.events;
        self.ledger
            .fail_all(Reason::of(cause), &mut |e| events.push(e));
    }
}

#[cfg(test)]
mod tests;
