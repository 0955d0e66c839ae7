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
//! the driver, `crate::driver::execute`, performs on a transport, feeding
//! the synchronous results back) and [`Event`]s (which the driver
//! publishes to the engine thread). [`Core::next_deadline`] says when it
//! next needs `advance`. So the simulator, proptest and unit tests reach
//! all of it.
//!
//! This file is the dispatcher: the [`Core`], its commands, the routing of
//! each notification to the role it is about (by the incarnation it names),
//! time and shutdown. Each role keeps its own state and handling in its own
//! file: `peers` (the peer table, removal and refresh), `batching`
//! (notifications to one endpoint travel together), `handles` (posting,
//! completions, flushes, releases), `pull` (lends to readers and reads,
//! questions that overtake their lend), `push` (writes and destinations,
//! quiet promises), `fences` (a destination's quarantine).
//!
//! Tokens: an operation's `u64` token is its [`HandleKey`] packed with two
//! kind bits (30–31: free because slots are fewer than 2^24): data, flush,
//! notification, and one the transport keeps for its own closes.

mod batching;
pub mod command;
mod fences;
mod handles;
mod peers;
mod pull;
mod push;

use std::collections::{HashMap, HashSet, VecDeque};

pub use command::{BlockBytes, Command};

use crate::ledger::{
    Begun, BlockId, Cancel, Cause, Event, HandleKey, Incarnation, Kind, Ledger, Nanos, Outcome,
    PeerId, Reason, Request, RequestId, RequestKey, Slots, MAX_HANDLES,
};
use crate::notification::{
    BlocksRead, NoteKind, Notification, Refused, Sealer, LEN as NOTE_LEN, MAX_PER_MESSAGE,
};
use crate::transport::{
    lend_word_of, Direction, Ep, LendWords, PostFailure, TransportEvent, CANCELED, NOT_LENT,
};
pub use crate::transport::{T_TRANSPORT, T_WORD};
use batching::Batch;
use fences::Fence;
use handles::Progress;
use peers::Peer;
use pull::{Ask, Ended};
use push::Quiet;

const KIND_MASK: u64 = 3 << 30;
const T_DATA: u64 = 0;
const T_FLUSH: u64 = 1 << 30;
const T_NOTE: u64 = 2 << 30;
const _: () = assert!(
    T_WORD == T_FLUSH,
    "a read's word check shares the flush kind"
);
/// An [`Info::word`] naming no lend word.
const NO_WORD: u32 = u32::MAX;

/// Most remote engines one request may await notifications from.
pub const MAX_CONSUMERS: usize = 64;

/// Receives answered [`NoteKind::WriteQuiet`] that are remembered
/// per asking engine (its oldest is forgotten first): a write submitted
/// that long after its destination gave up on it is not refused locally
/// any more. Per engine, so that one engine's questions never push out
/// the promises made to another.
const QUIET_PER_ENGINE: usize = 16_384;
/// Engines whose promises are remembered; past it, an engine that is not
/// a peer is forgotten first.
const QUIET_ENGINES: usize = 1024;

/// Incarnations of lends and receives that ended and are
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

/// How often a quarantined receive asks its silent writers
/// again, at most (an answer can be lost with a closed endpoint).
const REQUERY_MIN: Nanos = Nanos(50_000_000);

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
    /// Whether a receive's lease is a fence (the safe default):
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
    /// Bytes of the message: the notifications, and with a key their
    /// trailer ([`crate::notification::TRAILER`]).
    pub len: u32,
}

impl Notes {
    fn range(self) -> std::ops::Range<usize> {
        self.start as usize..self.start as usize + self.len as usize
    }
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
        /// The bytes of each block pair to move; whole blocks if none.
        part: Option<BlockBytes>,
    },
    /// Serve (`lent`) or refuse the read a peer asked this engine to serve
    /// itself ([`TransportEvent::ReadAsked`]).
    ServeRead {
        /// The transport's handle for the request.
        request: u32,
        /// Whether its blocks may leave.
        lent: bool,
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
    /// Read, after the read's data landed, the lender's word that lend
    /// `lend` lives in ([`crate::transport::Transport::read_word`]); a
    /// failure to post is fed to [`Core::on_word_failed`].
    ReadWord {
        /// Endpoint generation (the one the data travelled on, or newer).
        ep: Ep,
        /// The lend whose word is read.
        lend: Incarnation,
        /// The read's handle it is for (its first to that lender).
        handle: HandleKey,
        /// Token it ends with.
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
        /// Removed (not lost) with operations of ours still in flight on
        /// its endpoint: close it gracefully, letting them finish, so that
        /// the peer is not left answering them on a connection cut under
        /// it. Otherwise the close is forced.
        drain: bool,
    },
}

/// Per-slot facts the core needs after begin.
#[derive(Debug, Clone, Copy)]
struct Info {
    generation: u32,
    id: RequestId,
    /// Its incarnation: a lend's or receive's token, a read's or
    /// write's nonce.
    token: Incarnation,
    kind: Kind,
    handles: u8,
    /// Distinct engines that notified (their instances are in `notifiers`).
    notified: u8,
    /// A read whose handles all landed asked its lenders whether their
    /// lends were live.
    queried: bool,
    /// A receive one of whose writers gave up.
    abandoned: bool,
    /// A lend's lease length, ns: a reader's heartbeat extends the lend by
    /// as much from now.
    lease: u64,
    /// A receive with named writers whose lease ran out while one
    /// of them had not spoken: its blocks wait, quarantined, for that
    /// writer's word or its loss.
    quarantined: bool,
    /// The engine aborted it (a receive waits for its writers all
    /// the same).
    aborted: bool,
    /// A receive lent to writers it did not name: at its lease's
    /// end every peer is asked (and its handles name them from then on).
    unnamed: bool,
    /// Writers of a receive that said done or abandoned.
    words: u8,
    /// A lend's own lend word (its index), or [`NO_WORD`].
    word: u32,
    /// A lend's or receive's blocks (all of them): a read done, or a
    /// writer's word, is checked against them.
    lent: BlocksRead,
    /// A receive that takes no writer's word: one wrote blocks that are
    /// not its own, or another receive's writer wrote into its blocks. It
    /// fails `NotLent` once every writer has spoken.
    not_lent: bool,
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
    /// Blocks (one block of one region each) of handles whose data
    /// operations all completed successfully (a run of consecutive blocks
    /// may travel as one operation).
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
    /// Receives whose lease ran out while a named writer had not
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
    /// Reads' lenders whose lend word, read after the data, named the
    /// lend: confirmed without asking the lender.
    pub word_confirmations: u64,
    /// Lend words that did not name the lend (not lent yet, ended, another
    /// lend's, or not readable): the read asked its lender instead.
    pub word_misses: u64,
    /// Lends that found their word taken by another live lend (their
    /// readers ask).
    pub word_collisions: u64,
    /// Reads this engine refused as a lender because it did not lend what
    /// they read under the incarnation they named (another lend's blocks,
    /// blocks not lent, an incarnation it can tell it never lent): answered
    /// [`NoteKind::ReadNotLent`], never counted. Also counted in
    /// `rejected_notifications`.
    pub refused_reads: u64,
    /// Reads of this engine that failed `Cause::NotLent`: a lender refused
    /// them so, or never knew their lend (its grace period or the read's
    /// deadline ran out while it answered pending).
    pub reads_not_lent: u64,
    /// Writers' words this engine refused as a push destination: the
    /// blocks written were not the receive's (another receive's, or none),
    /// or the receive's blocks may hold another write's bytes. Answered
    /// [`NoteKind::WriteNotLent`]; the receive fails `Cause::NotLent`.
    /// Also counted in `rejected_notifications`.
    pub refused_writes: u64,
    /// Writes of this engine that failed `Cause::NotLent`: a destination
    /// did not take their word.
    pub writes_not_lent: u64,
    /// Notification messages dropped whole: no valid tag of this engine's
    /// key (an engine with a key only).
    pub unauthenticated_notifications: u64,
    /// Notification messages dropped whole: a copy of one received before
    /// (an engine with a key only).
    pub replayed_notifications: u64,
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
    /// Receives, and their lease ends (kept here, not in the
    /// ledger: expiry starts a fence, it frees nothing); once quarantined,
    /// when to ask their silent writers again.
    fences: Vec<Fence>,
    /// Receives this engine answered [`NoteKind::WriteQuiet`]
    /// for: a write into one of them is refused before anything is posted
    /// (its blocks may be reused).
    quiet: Quiet,
    /// Live lends and receives, by incarnation: a note finds the
    /// one it names by its token, never by its request id alone.
    by_token:
        HashMap<Incarnation, RequestKey, std::hash::BuildHasherDefault<crate::ledger::IdHasher>>,
    /// Lends and receives that ended, by incarnation.
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
    /// `next_deadline`'s answer, until an input may have changed it.
    deadline: std::cell::Cell<Option<Option<Nanos>>>,
    /// Handles whose release failed, and when to retry.
    held: Vec<(HandleKey, Nanos)>,
    ops_in_flight: u64,
    notes_in_flight: u64,
    actions: VecDeque<Action>,
    /// Which blocks of a run a peer asked to be served were found in the
    /// lend ([`run_within`]): one bit a block, kept for its capacity.
    run_seen: Vec<u64>,
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
    /// A read's lender blocks (a write's destination blocks), on the
    /// first handle to each lender (destination).
    handle_reads: Vec<BlocksRead>,
    /// Scratch: the remote block ids of one lender of a read being begun.
    read_ids: Vec<u32>,
    /// The part of each block each handle moves (none: whole blocks).
    handle_parts: Vec<Option<BlockBytes>>,
    blocks: Vec<BlockId>,
    cancels: Vec<Cancel>,
    stats: CoreStats,
    shutting_down: bool,
    /// Events already looked at by `after_events`.
    scanned: usize,
    /// This engine's lend words, if its transport has them.
    words: Option<LendWords>,
    /// With a key: what tags this engine's messages and checks its
    /// peers' (`crate::auth`).
    sealer: Option<Sealer>,
    /// Reads and writes begun and not yet reported: while there are any,
    /// this engine awaits answers from its peers (data, confirmations,
    /// acknowledgements). Lends and receives await peers too, but on the
    /// peers' own schedule, not as answers to anything this engine sent.
    own_live: u32,
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
                    word: NO_WORD,
                    lent: BlocksRead::NONE,
                    not_lent: false,
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
            deadline: std::cell::Cell::new(None),
            held: Vec::new(),
            ops_in_flight: 0,
            notes_in_flight: 0,
            actions: VecDeque::with_capacity(1024),
            run_seen: Vec::new(),
            events: Vec::with_capacity(1024),
            pairs: Vec::with_capacity(1024),
            note_bytes: Vec::with_capacity(64 * MAX_PER_MESSAGE * NOTE_LEN),
            batches: Vec::with_capacity(16),
            handle_peers: Vec::with_capacity(MAX_HANDLES),
            handle_pairs: Vec::with_capacity(MAX_HANDLES),
            handle_lends: Vec::with_capacity(MAX_HANDLES),
            handle_reads: Vec::with_capacity(MAX_HANDLES),
            read_ids: Vec::with_capacity(1024),
            handle_parts: Vec::with_capacity(MAX_HANDLES),
            blocks: Vec::with_capacity(1024),
            cancels: Vec::with_capacity(64),
            stats: CoreStats::default(),
            shutting_down: false,
            scanned: 0,
            words: None,
            sealer: None,
            own_live: 0,
        }
    }

    /// The core tags every notification message it sends with `key`, and
    /// drops every message that is not tagged with it for this engine, or
    /// that it received before (`crate::auth`).
    pub fn with_auth_key(mut self, key: Option<crate::auth::AuthKey>) -> Self {
        self.sealer = key.map(Sealer::new);
        self
    }

    /// The core writes its lends' incarnations into `words` (see
    /// [`LendWords`]): its readers can then confirm a read with one
    /// one-sided read instead of a question.
    pub fn with_lend_words(mut self, words: Option<LendWords>) -> Self {
        self.words = words;
        self
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

    /// Hands the events produced so far to `publish`, in order, and
    /// forgets them.
    ///
    /// Every lend word of a lend whose end is among them is overwritten
    /// first: the engine may reuse the blocks once it sees the end, and
    /// a reader must not find the incarnation in the word by then.
    pub fn drain_events(&mut self, mut publish: impl FnMut(Event)) -> usize {
        if self.words.is_some() {
            self.clear_ended_words();
        }
        let n = self.events.len();
        for &e in &self.events {
            let info = &self.info[e.key.slot() as usize];
            if e.outcome.is_terminal()
                && info.generation == e.key.generation()
                && matches!(info.kind, Kind::Read | Kind::Write { .. })
            {
                self.own_live = self.own_live.saturating_sub(1);
            }
            publish(e);
        }
        self.events.clear();
        self.scanned = 0;
        n
    }

    /// Whether reads or writes of this engine are live: it awaits its
    /// peers' answers (a lender or a push destination alone does not).
    pub fn awaits_answers(&self) -> bool {
        self.own_live > 0
    }

    /// Operations (data, flushes) and notifications still outstanding.
    pub fn outstanding(&self) -> u64 {
        self.ops_in_flight + self.notes_in_flight
    }

    // -- control plane ----------------------------------------------------

    // -- commands ---------------------------------------------------------

    /// One command from the engine; `next` yields the entries of its batch
    /// that follow (a request's plan).
    pub fn on_command(
        &mut self,
        cmd: Command,
        next: &mut dyn FnMut() -> Option<Command>,
        now: Nanos,
    ) {
        self.touched();
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
            Command::Handle { .. }
            | Command::Part(_)
            | Command::Pair { .. }
            | Command::Block(_) => {}
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
        self.handle_parts.clear();
        self.pairs.clear();
        self.blocks.clear();
        for _ in 0..handles {
            let mut entry = next();
            let part = match entry {
                Some(Command::Part(p)) => {
                    entry = next();
                    Some(p)
                }
                _ => None,
            };
            let Some(Command::Handle { peer, pairs, lend }) = entry else {
                return false;
            };
            self.handle_parts.push(part);
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
        self.touched();
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
        // A receive's lease is the core's (a fence, not a timer);
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
        if matches!(kind, Kind::Read | Kind::Write { .. }) {
            self.own_live += 1;
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
            word: NO_WORD,
            lent: if matches!(kind, Kind::Lend { .. } | Kind::Receive { .. }) {
                BlocksRead::of(self.blocks.iter().copied())
            } else {
                BlocksRead::NONE
            },
            not_lent: false,
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
            self.claim_word(slot, token);
            self.take_early(token, now);
        }
        // Reads and writes in flight tell their lenders (producers, receives
        // ) that they are still at it.
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
        self.handle_reads.clear();
        if matches!(kind, Kind::Read | Kind::Write { .. }) {
            self.name_blocks_read();
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

    // -- transport events ---------------------------------------------------

    /// Something the transport saw.
    pub fn on_transport(&mut self, ev: TransportEvent<'_>, now: Nanos) {
        self.touched();
        match ev {
            TransportEvent::Completion { token, status } => self.on_completion(token, status),
            TransportEvent::Message { payload, reply } => self.on_message(payload, reply, now),
            TransportEvent::Word {
                token,
                status,
                word,
            } => self.on_word(token, status, word),
            TransportEvent::EndpointFailed { ep, status } => self.on_endpoint_failed(ep, status),
            TransportEvent::ReadAsked {
                request,
                lend,
                first,
                last,
            } => self.read_asked(request, lend, first, last),
        }
    }

    /// The lend (or receive) handle `hk` moves blocks of
    /// ([`Incarnation::NONE`]: memory no lend guards).
    pub fn lend_of(&self, hk: HandleKey) -> Incarnation {
        self.progress
            .get(Self::index(hk))
            .map_or(Incarnation::NONE, |p| p.lend)
    }

    /// A peer asks this engine to serve blocks `first..=last` itself under
    /// lend `lend`: refused if `lend` is a live lend here and those blocks
    /// are not all its own (nothing of them leaves; the reader fails
    /// `NotLent`), served otherwise — a lend not known here may still be
    /// on its way (read before lend), and its confirmation decides.
    fn read_asked(&mut self, request: u32, lend: Incarnation, first: BlockId, last: BlockId) {
        let refused = self.live_lend(lend).is_some_and(|key| {
            let info = &self.info[key.slot() as usize];
            // More blocks than the lend has cannot all be its own (and a
            // peer's long range costs nothing to refuse).
            let fits = u64::from(last.0.saturating_sub(first.0)) < u64::from(info.lent.count);
            // A lend another write wrote into serves nothing more.
            info.not_lent
                || !(first.0 <= last.0
                    && fits
                    && run_within(
                        &mut self.run_seen,
                        first.0,
                        last.0,
                        self.slots.blocks_of(key.slot()),
                    ))
        });
        if refused {
            self.stats.refused_reads += 1;
            self.reject();
        }
        self.actions.push_back(Action::ServeRead {
            request,
            lent: !refused,
        });
    }

    fn on_message(&mut self, bytes: &[u8], reply: Option<u32>, now: Nanos) {
        let bytes = match self
            .sealer
            .as_mut()
            .map(|s| s.open(self.cfg.instance, bytes))
        {
            None => bytes,
            Some(Ok(notes)) => notes,
            Some(Err(Refused::Unauthenticated)) => {
                self.stats.unauthenticated_notifications += 1;
                return;
            }
            Some(Err(Refused::Replayed)) => {
                self.stats.replayed_notifications += 1;
                return;
            }
        };
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
            // A writer wrote into a live lend's blocks under its
            // incarnation (it took the lend for a receive), whatever request
            // id it names: its bytes are in them now.
            NoteKind::WriteDone if self.live_lend(note.incarnation).is_some() => {
                // Whatever it wrote, it wrote into the blocks its word names.
                self.taint_blocks(note.blocks, None);
                self.refuse_write(&note);
            }
            NoteKind::WriteNotLent => {
                match live.filter(|&k| self.attempt_of(k, &note, Kind::Write { acks: 0 })) {
                    Some(key) => self.write_not_lent(key, &note),
                    None => self.stale(),
                }
            }
            NoteKind::ReadConfirmed
            | NoteKind::ReadRefused
            | NoteKind::ReadPending
            | NoteKind::ReadNotLent => {
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
            // A live lend's incarnation under another request id: a read
            // that names it read blocks of no lend of its own.
            NoteKind::ReadDone if self.names_another(&note) => {
                self.stats.stale_notifications += 1;
                self.not_lent(reply, &note);
            }
            _ if self.names_another(&note) => self.stale(),
            _ => self.early(&note, reply, now),
        }
    }

    /// Whether `key` is the live lend or receive (`kind`) that
    /// `note` names by its incarnation.
    fn owns(&self, key: Option<RequestKey>, note: &Notification, kind: fn(Kind) -> bool) -> bool {
        key.is_some_and(|k| {
            let info = &self.info[k.slot() as usize];
            kind(info.kind) && info.token == note.incarnation
        })
    }

    /// The live lend of incarnation `token`, if there is one.
    fn live_lend(&self, token: Incarnation) -> Option<RequestKey> {
        self.by_token.get(&token).copied().filter(|&k| {
            let info = &self.info[k.slot() as usize];
            info.generation == k.generation()
                && matches!(info.kind, Kind::Lend { .. })
                && self.ledger.is_live(k)
        })
    }

    /// Whether `note` names a live lend or receive of another
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
        self.touched();
        let mut i = 0;
        while i < self.held.len() {
            if self.held[i].1 <= now {
                let (hk, _) = self.held.swap_remove(i);
                self.actions.push_back(Action::Release { handle: hk });
            } else {
                i += 1;
            }
        }
        // Reads told pending whose deadline came: the lender answered, so
        // it is not stalled; the lend it was asked about never came.
        self.unlent_at_deadline(now);
        self.drop_early(now);
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

    /// When the core next needs [`Core::advance`] (`None`: only when
    /// something happens). Cheap: the driver asks every iteration, and the
    /// answer is worked out once after each input that could change it.
    pub fn next_deadline(&self) -> Option<Nanos> {
        match self.deadline.get() {
            Some(t) => {
                debug_assert_eq!(t, self.earliest(), "a stale next deadline");
                t
            }
            None => {
                let t = self.earliest();
                self.deadline.set(Some(t));
                t
            }
        }
    }

    /// An input may have moved a deadline: the next `next_deadline` looks
    /// again.
    fn touched(&self) {
        self.deadline.set(None);
    }

    /// The earliest of the retries, aborts, heartbeats, fences, questions
    /// and the ledger's expiries.
    fn earliest(&self) -> Option<Nanos> {
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
        if let Some(&(until, _)) = self.early.front() {
            t = t.min(until);
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
            // Reported means quiescent: nothing of it is due any more, so
            // its timers go now rather than when they fall due (they would
            // wake the poller, and `next_deadline` looks at each).
            // Only receives have fences, only reads ask again.
            let key = ev.key;
            if matches!(info.kind, Kind::Receive { .. }) && !self.fences.is_empty() {
                self.fences.retain(|f| f.key != key);
            }
            if !self.aborted.is_empty() {
                self.aborted.retain(|&(k, _)| k != key);
            }
            if info.kind == Kind::Read && !self.asking.is_empty() {
                self.asking.retain(|a| a.key != key);
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
    /// Receives are fences to the end: each is quarantined (its
    /// silent writers asked) and reported once they answered or were lost;
    /// writes are not force-closed under their puts (they complete or
    /// fail on their own, and their word follows them). The driver goes on
    /// until [`Core::quarantined`] and [`Core::outstanding`] are 0, within
    /// its bound.
    pub fn shutdown(&mut self) {
        self.touched();
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

    /// Whether nothing is outstanding any more.
    pub fn quiescent(&self) -> bool {
        self.ops_in_flight == 0 && self.held.is_empty()
    }

    /// The driver can go on no more (its thread died, or shutdown timed
    /// out): every request still tracked is reported failed with `cause`.
    pub fn abandon(&mut self, cause: Cause) {
        self.touched();
        let events = &mut self.events;
        self.ledger
            .fail_all(Reason::of(cause), &mut |e| events.push(e));
    }
}

/// Whether every block of `first..=last` is among `blocks` (a lend's,
/// which may name a block twice): one pass over them, a bit a block of the
/// run in `seen`. The run is no longer than the lend (checked before), so
/// this costs the lend's length, not the run's times it.
fn run_within(
    seen: &mut Vec<u64>,
    first: u32,
    last: u32,
    blocks: impl Iterator<Item = BlockId>,
) -> bool {
    let n = (last - first) as usize + 1;
    seen.clear();
    seen.resize(n.div_ceil(64), 0);
    let mut found = 0;
    for b in blocks {
        let i = b.0.wrapping_sub(first) as usize;
        if b.0 >= first && i < n && seen[i / 64] & (1 << (i % 64)) == 0 {
            seen[i / 64] |= 1 << (i % 64);
            found += 1;
        }
    }
    found == n
}

#[cfg(test)]
mod tests;
