//! The engine-thread side of kvpoll: what a serving engine embeds.
//!
//! [`Engine::builder`] starts one poller thread, which owns the UCX context,
//! worker and endpoints and the ledger's owner half. The engine thread
//! submits requests over a bounded SPSC command ring (a request and its plan
//! are one all-or-nothing batch of small `Copy` entries) and collects reports
//! with [`Engine::poll`], which drains the event ring and retires each
//! terminal request in the shared ledger slots.
//!
//! Blocks: every registered region is one layer of the KV cache, laid out
//! as `blocks × block_size` bytes; a [`BlockId`] names the same block in
//! every region, so moving one block moves it in every layer (one UCX
//! operation per region). Two engines must agree on the block size and the
//! number of regions ([`crate::metadata::MetadataError::IncompatibleLayout`]),
//! unless the peer was added with [`Engine::add_peer_any_block_size`]: then
//! only part transfers ([`Transfer::part`]) reach it, each moving a byte
//! range of every block (the heads one tensor-parallel rank holds), as
//! NIXL's descriptors address them.
//!
//! Control-plane calls (registering memory, adding peers, metadata) are
//! rare; they travel over a channel to the poller and wait for its answer.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::auth::AuthKey;
pub use crate::core::BlockBytes;
use crate::core::{Command, MAX_CONSUMERS};
use crate::driver::{self, Control, Shared};
use crate::ledger::{
    BlockId, Cause, Event, Incarnation, Kind, LedgerConfig, Outcome, PeerId, Reason, RequestId,
    RequestKey, Slots, MAX_HANDLES,
};
use crate::metrics::{MetricsSnapshot, PollerMetrics, RejectedInputs, RingMetrics, SlotUse};
use crate::ring::{self, CommandSender, EventReceiver};
use crate::transport::ucx::ContextOptions;

pub use crate::error::{
    BuildError, Error, ErrorKind, PeerError, RegionError, Stopped, SubmitError,
};
pub use crate::placement::IdlePolicy;
/// Faults the poller can inject (the `fault-injection` feature).
#[cfg(feature = "fault-injection")]
pub use crate::transport::faulty::Faults;
/// The active-message id notifications travel on (internal: for tests
/// that send a peer's bytes).
#[doc(hidden)]
pub use crate::transport::ucx::NOTIFY_AM_ID;

/// One handle of a read or write: the blocks moved with one remote rank.
/// `local[i]` pairs with `remote[i]`.
#[derive(Debug, Clone, Copy)]
pub struct Transfer<'a> {
    /// The remote rank, from [`Engine::add_peer`].
    pub peer: PeerId,
    /// Local block ids.
    pub local: &'a [BlockId],
    /// Remote block ids, same length.
    pub remote: &'a [BlockId],
    /// The incarnation of the remote lend (a read) or receive (a
    /// write) these blocks belong to: what the remote engine's
    /// [`Engine::lend`] returned, carried here with the block ids. Every
    /// notification about the transfer names it, so a late answer about an
    /// earlier lend of the same request id cannot complete this one.
    /// [`Incarnation::NONE`] only for a read with confirmation off (memory
    /// no lend guards).
    pub lend: Incarnation,
}

impl<'a> Transfer<'a> {
    /// This handle moving a part of each block: the bytes `local` of each
    /// local block and `remote` of each remote block (the remote engine's
    /// block size, which may differ from this one's). Both ranges must be
    /// non-empty, of equal length, and inside a block on their side; the
    /// read or write that takes it ([`Engine::read_parts`],
    /// [`Engine::write_parts`]) refuses them otherwise
    /// ([`SubmitError::BadPart`]).
    pub fn part(
        self,
        local: std::ops::Range<u64>,
        remote: std::ops::Range<u64>,
    ) -> PartTransfer<'a> {
        PartTransfer {
            transfer: self,
            local_bytes: local,
            remote_bytes: remote,
        }
    }
}

/// A [`Transfer`] of part of each block: see [`Transfer::part`].
#[derive(Debug, Clone)]
pub struct PartTransfer<'a> {
    /// The blocks, peer and incarnation.
    pub transfer: Transfer<'a>,
    /// The bytes moved of each local block.
    pub local_bytes: std::ops::Range<u64>,
    /// The bytes moved of each remote block.
    pub remote_bytes: std::ops::Range<u64>,
}

/// A handle as a submission sees it: its blocks, and the part of each
/// block it moves (whole blocks if none).
trait Handle<'a> {
    fn transfer(&self) -> &Transfer<'a>;
    fn bytes(&self) -> Option<(std::ops::Range<u64>, std::ops::Range<u64>)>;
}

impl<'a> Handle<'a> for Transfer<'a> {
    fn transfer(&self) -> &Transfer<'a> {
        self
    }
    fn bytes(&self) -> Option<(std::ops::Range<u64>, std::ops::Range<u64>)> {
        None
    }
}

impl<'a> Handle<'a> for PartTransfer<'a> {
    fn transfer(&self) -> &Transfer<'a> {
        &self.transfer
    }
    fn bytes(&self) -> Option<(std::ops::Range<u64>, std::ops::Range<u64>)> {
        Some((self.local_bytes.clone(), self.remote_bytes.clone()))
    }
}

/// A failed send: a write that failed or was aborted. Never done; its source
/// blocks are free (nothing reads them any more).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FailedSend {
    /// The request.
    pub id: RequestId,
    /// The first failure.
    pub reason: Reason,
}

/// A failed receive: the request, why, and the local blocks whose contents
/// are invalid (`Outcomes::invalid_blocks[blocks]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailedRecv {
    /// The request.
    pub id: RequestId,
    /// The first failure.
    pub reason: Reason,
    /// Its range in [`Outcomes::invalid_blocks`].
    pub blocks: std::ops::Range<usize>,
}

/// What [`Engine::poll`] reports, in the shape serving engines consume.
/// Reuse one value across polls: clearing keeps capacity, so steady state
/// does not allocate.
#[derive(Debug, Default, Clone)]
pub struct Outcomes {
    /// Reads (and receives) whose data is all here.
    pub finished_recving: Vec<RequestId>,
    /// Reads that failed, after quiescence.
    pub failed_recving: Vec<FailedRecv>,
    /// Local blocks to invalidate, ranges of which `failed_recving` names.
    pub invalid_blocks: Vec<BlockId>,
    /// Writes acknowledged by every consumer, and lends every reader
    /// notified: their source blocks are free.
    pub finished_sending: Vec<RequestId>,
    /// Writes that failed or were aborted, after quiescence, with their
    /// reason: never done; their source blocks are free.
    pub failed_sending: Vec<FailedSend>,
    /// Writes and lends whose lease expired (or that shutdown or an abort
    /// ended): their blocks are free, the transfer is not done.
    pub expired: Vec<RequestId>,
    /// Informational: a handle failed (its request is reported later).
    pub handle_failures: Vec<(RequestId, u8, Reason)>,
    /// Peers lost (their endpoint failed: the process died, the link is
    /// gone), with the endpoint's status: their requests fail as reported
    /// above, and each must be added again (fresh metadata) to be used.
    pub peers_lost: Vec<(PeerId, Reason)>,
}

impl Outcomes {
    /// Empties every list, keeping capacity.
    pub fn clear(&mut self) {
        self.finished_recving.clear();
        self.failed_recving.clear();
        self.invalid_blocks.clear();
        self.finished_sending.clear();
        self.failed_sending.clear();
        self.expired.clear();
        self.handle_failures.clear();
        self.peers_lost.clear();
    }

    /// Whether nothing is reported.
    pub fn is_empty(&self) -> bool {
        self.finished_recving.is_empty()
            && self.failed_recving.is_empty()
            && self.finished_sending.is_empty()
            && self.failed_sending.is_empty()
            && self.expired.is_empty()
            && self.handle_failures.is_empty()
            && self.peers_lost.is_empty()
    }

    /// The invalid blocks of one failed receive.
    pub fn blocks_of(&self, failed: &FailedRecv) -> &[BlockId] {
        &self.invalid_blocks[failed.blocks.clone()]
    }
}

/// Builds an [`Engine`].
#[derive(Debug, Clone)]
pub struct EngineBuilder {
    ledger: LedgerConfig,
    command_ring: usize,
    event_ring: usize,
    event_overflow: usize,
    block_size: u64,
    core: Option<usize>,
    idle: IdlePolicy,
    ucx: ContextOptions,
    read_deadline: Duration,
    confirm_reads: bool,
    fence_push_leases: bool,
    read_heartbeat: Duration,
    lend_grace: Duration,
    remote_write: bool,
    auth: Option<AuthKey>,
    /// [`EngineBuilder::auth_key`] was called (the test hook leaves such
    /// an engine's key alone).
    auth_given: bool,
    #[cfg(feature = "fault-injection")]
    faults: Faults,
}

/// Test hook: the secret an engine takes when its builder was given no key
/// ([`EngineBuilder::auth_key`]), so that a whole test suite (Rust,
/// Python, C) runs keyed. It can only add a key: an engine given one, or
/// given none explicitly, keeps what it was given.
pub const TEST_AUTH_ENV: &str = "KVPOLL_TEST_AUTH_KEY";

impl Default for EngineBuilder {
    fn default() -> Self {
        Self {
            ledger: LedgerConfig::default(),
            command_ring: 1 << 16,
            event_ring: 1 << 14,
            event_overflow: 1 << 16,
            block_size: 16 * 1024,
            core: None,
            idle: IdlePolicy::Adaptive,
            ucx: ContextOptions::default(),
            read_deadline: Duration::from_secs(30),
            confirm_reads: true,
            fence_push_leases: true,
            read_heartbeat: Duration::from_millis(250),
            lend_grace: Duration::from_secs(5),
            remote_write: true,
            auth: None,
            auth_given: false,
            #[cfg(feature = "fault-injection")]
            faults: Faults::default(),
        }
    }
}

impl EngineBuilder {
    /// The block size this builder builds with.
    pub(crate) fn block_size_of(&self) -> u64 {
        self.block_size
    }

    /// Binds the engine's UCX context to network device `device`
    /// (`UCX_NET_DEVICES`), over the environment's choice.
    pub(crate) fn net_device(mut self, device: &str) -> Self {
        self.ucx = self.ucx.option("NET_DEVICES", device);
        self
    }

    /// Ledger slots (requests in flight plus reported, not yet polled) and
    /// the most local blocks one request may name.
    pub fn ledger(mut self, slots: u32, max_blocks: u32) -> Self {
        self.ledger = LedgerConfig { slots, max_blocks };
        self
    }

    /// Entries of the command ring (a request takes 1 + handles + blocks).
    pub fn command_ring(mut self, entries: usize) -> Self {
        self.command_ring = entries;
        self
    }

    /// Entries of the event ring, and of the poller's overflow behind it.
    pub fn event_ring(mut self, entries: usize, overflow: usize) -> Self {
        self.event_ring = entries;
        self.event_overflow = overflow;
        self
    }

    /// Bytes per block (default 16 KiB).
    pub fn block_size(mut self, bytes: u64) -> Self {
        self.block_size = bytes;
        self
    }

    /// Pin the poller to this CPU core (default: not pinned). A CPU the
    /// machine does not have is refused ([`BuildError::NoSuchCpu`]). A
    /// failure to pin is an error for a `Busy` poller; an `Adaptive` one
    /// runs unpinned, with a `tracing` warning, and
    /// [`Engine::poller_core`] says `None`. Take the core from a
    /// [`crate::placement::CoreMap`].
    pub fn core(mut self, core: Option<usize>) -> Self {
        self.core = core;
        self
    }

    /// Places the poller as a core map says: the first poller entry's core
    /// and idle policy (this engine runs one poller; further entries are
    /// for further engines). A map without pollers is refused.
    pub fn core_map(mut self, map: &crate::placement::CoreMap) -> Result<Self, BuildError> {
        let spec = map.pollers().first().ok_or(BuildError::NoPoller)?;
        self.core = Some(spec.core);
        self.idle = spec.idle;
        Ok(self)
    }

    /// The poller's idle policy (default [`IdlePolicy::Adaptive`]).
    pub fn idle(mut self, idle: IdlePolicy) -> Self {
        self.idle = idle;
        self
    }

    /// UCX options (transports and others).
    pub fn ucx(mut self, options: ContextOptions) -> Self {
        self.ucx = options;
        self
    }

    /// Deadline of a read, from its submission (default 30 s); a read can
    /// carry its own ([`Engine::read_with_deadline`]).
    pub fn read_deadline(mut self, d: Duration) -> Self {
        self.read_deadline = d;
        self
    }

    /// Whether a read finishes only once each of its lender engines
    /// confirmed that its lend was live when the data was read (default:
    /// yes). A lend that expired, was consumed or never existed is refused,
    /// and the read fails with `Cause::LeaseLost`, naming its blocks — never
    /// finishes with another request's bytes. Turn it off only for reads of
    /// memory that no lend guards (the lenders are then told afterwards).
    pub fn confirm_reads(mut self, confirm: bool) -> Self {
        self.confirm_reads = confirm;
        self
    }

    /// Whether a receive's lease is a fence (default: yes): when it
    /// runs out, the blocks are held — quarantined, not reported — until
    /// every writer that could still write into them has said it is done or
    /// will write nothing more, or was lost. Off, the lease is a plain
    /// timer: the blocks are reported at its end even while a stalled
    /// writer's puts are still to land. UNSAFE: that is the corruption
    /// kvpoll exists to prevent; off only to show it (`kvpoll demo
    /// --no-fence`).
    pub fn fence_push_leases(mut self, fence: bool) -> Self {
        self.fence_push_leases = fence;
        self
    }

    /// How often a read still in flight tells its lenders to keep their
    /// lends (default 250 ms): each heartbeat extends a lend by its own
    /// lease length from then. A reader that stops (a paused process, a
    /// cut link) stops sending them, and its lenders' leases run out.
    /// Writes in flight do the same for their receives.
    /// `Duration::MAX`: never.
    pub fn read_heartbeat(mut self, every: Duration) -> Self {
        self.read_heartbeat = every;
        self
    }

    /// How long a read whose lender does not know the lend yet keeps
    /// asking (default 5 s). A serving engine can hand a lend's block ids
    /// and incarnation to the reader before the lender's poller has taken
    /// the lend (the prefill answers the request, then its worker lends):
    /// the lender answers "pending", and the reader asks again — after
    /// 100 µs, doubling to 20 ms — until the lend is there or this much
    /// time passed, then fails `Cause::LeaseLost`. The lender holds a
    /// reader's give-up (or a writer's word, for a receive) that
    /// arrives first as long.
    pub fn lend_grace(mut self, grace: Duration) -> Self {
        self.lend_grace = grace;
        self
    }

    /// Whether peers may write into this engine's blocks (default: yes).
    /// Only a push destination needs it: in pull mode a lender is read
    /// and a reader writes its own memory. Off, the engine opens no
    /// receive ([`SubmitError::RemoteWriteOff`]) and registers its
    /// regions for remote reads only. Where tcp is the only transport
    /// ([`ContextOptions::transports`] `"tcp"`) a peer's writes are then
    /// refused, and the engine writes nothing itself either
    /// ([`SubmitError::NoPuts`]); over shared memory, and over RDMA with
    /// UCX 1.13 to 1.22, nothing refuses them: docs/design.md §4's table
    /// says what guards each transport.
    pub fn remote_write(mut self, allowed: bool) -> Self {
        self.remote_write = allowed;
        self
    }

    /// The key this engine shares with its peers (default: none). With
    /// one, its metadata and notification messages are tagged, and it
    /// refuses a peer's metadata without a tag of that key
    /// ([`PeerError::Unauthenticated`]) and drops notification messages
    /// without one, or seen before ([`PollerStats`] counts each). Without
    /// one, it refuses a peer's metadata that is tagged. The `kvpoll`
    /// tool and the bindings read the secret from a file or the
    /// environment ([`crate::auth::ENV`]); this call reads neither.
    /// [`crate::auth`] and docs/design.md §4 say what it guarantees.
    ///
    /// Test hook: an engine whose builder was not given a key (this call
    /// not made) takes the secret in
    /// [`TEST_AUTH_ENV`] if set and not empty, so that a whole test suite
    /// runs keyed.
    pub fn auth_key(mut self, key: Option<AuthKey>) -> Self {
        self.auth = key;
        self.auth_given = true;
        self
    }

    /// Faults to inject (default: none). Test hook: `fault-injection` only.
    #[cfg(feature = "fault-injection")]
    pub fn faults(mut self, faults: Faults) -> Self {
        self.faults = faults;
        self
    }

    /// Starts the poller and returns the engine.
    pub fn build(self) -> Result<Engine, BuildError> {
        let auth = match std::env::var_os(TEST_AUTH_ENV) {
            Some(secret) if !self.auth_given && !secret.is_empty() => Some(AuthKey::from_secret(
                std::os::unix::ffi::OsStrExt::as_bytes(secret.as_os_str()).trim_ascii(),
            )?),
            _ => self.auth.clone(),
        };
        if self.block_size == 0 {
            return Err(BuildError::BlockSize(0));
        }
        for (ring, entries, min) in [
            ("command", self.command_ring, 2),
            ("event", self.event_ring, 1),
        ] {
            if entries < min {
                return Err(BuildError::RingTooSmall { ring, entries, min });
            }
        }
        if let Some(core) = self.core {
            if let Some(cpus) = crate::placement::machine_cpus().filter(|c| !c.contains(&core)) {
                return Err(BuildError::NoSuchCpu {
                    core,
                    count: cpus.len(),
                    cpus: crate::placement::format_cpu_list(&cpus),
                });
            }
        }
        let ledger = crate::ledger::Ledger::new(self.ledger)?;
        let slots = ledger.slots().clone();
        let (commands, command_rx) = ring::commands::<Command>(self.command_ring);
        let (event_tx, events) = ring::events::<Event>(self.event_ring, self.event_overflow);
        // Keys of reported requests go back to the poller, which frees their
        // slots. At most `slots` keys exist, so this ring is never full.
        let (retire, retire_rx) = ring::commands::<RequestKey>(self.ledger.slots as usize);
        let (control, control_rx) = mpsc::channel();
        let shared = Arc::new(
            Shared::new().map_err(|e| BuildError::Spawn(format!("wake-up eventfd: {e}")))?,
        );
        let (ready_tx, ready_rx) = mpsc::channel();
        let config = driver::Config {
            block_size: self.block_size,
            core: self.core,
            idle: self.idle,
            ucx: self.ucx.clone(),
            instance: instance_id(),
            confirm_reads: self.confirm_reads,
            fence_push_leases: self.fence_push_leases,
            read_heartbeat: self.read_heartbeat,
            lend_grace: self.lend_grace,
            remote_write: self.remote_write,
            auth: auth.clone(),
            #[cfg(feature = "fault-injection")]
            faults: self.faults,
        };
        let thread_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("kvpoll-poller".into())
            .spawn(move || {
                // SAFETY: gettid has no preconditions.
                let tid = unsafe { libc::gettid() };
                // Relaxed: read for metrics only.
                thread_shared.tid.store(tid, Ordering::Relaxed);
                driver::run(
                    config,
                    ledger,
                    driver::Channels {
                        commands: command_rx,
                        retire: retire_rx,
                        events: event_tx,
                        control: control_rx,
                        shared: thread_shared,
                    },
                    ready_tx,
                )
            })
            .map_err(|e| BuildError::Spawn(e.to_string()))?;
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(BuildError::Spawn(
                    "the poller thread ended before it was ready".into(),
                ));
            }
        }
        // Relaxed: stored before the driver reported ready.
        let words = WordsInUse::new(shared.lend_words.load(Ordering::Relaxed));
        Ok(Engine {
            slots,
            commands,
            retire,
            events,
            control,
            shared,
            thread: Some(thread),
            // Twice the slots: with deletions rehashed in place it never
            // grows (at most one entry per slot).
            in_flight: InFlight::with_capacity_and_hasher(
                2 * self.ledger.slots as usize,
                Default::default(),
            ),
            tally: crate::metrics::Tally::default(),
            words,
            scratch: Vec::with_capacity(1024),
            parked: Vec::new(),
            retired: Vec::with_capacity(self.ledger.max_blocks as usize),
            region_blocks: None,
            regions: Vec::new(),
            peer_block_sizes: Vec::new(),
            max_blocks: self.ledger.max_blocks,
            capacity: self.ledger.slots,
            block_size: self.block_size,
            read_deadline: self.read_deadline,
            confirm_reads: self.confirm_reads,
            remote_write: self.remote_write,
            puts: !self.ucx.without_rma(self.remote_write),
            auth,
            reports_signalled: false,
        })
    }
}

fn nanos(d: Duration) -> u64 {
    d.as_nanos().min(u128::from(u64::MAX)) as u64
}

impl Incarnation {
    /// A fresh incarnation: 64 bits from the operating system's CSPRNG
    /// (`getrandom(2)`, drawn a batch at a time per thread), never
    /// [`Incarnation::NONE`]. [`Engine::lend`] draws one itself; a serving
    /// engine that hands out a lend's block ids before its worker lends
    /// them (vLLM's scheduler does) draws one here, hands it out with the
    /// ids and lends with [`Engine::lend_with`].
    pub fn draw() -> Incarnation {
        thread_local! {
            static TOKENS: std::cell::RefCell<Tokens> = std::cell::RefCell::new(Tokens::default());
        }
        TOKENS.with(|t| t.borrow_mut().draw())
    }
}

/// No lend word held (a request that is no lend, a lend whose word another
/// live lend of this engine held, or an engine without words).
const NO_WORD: u32 = u32::MAX;

/// Draws of an incarnation whose word is free before a lend takes one
/// whose word is held (it then has none: its readers ask).
const WORD_DRAWS: u32 = 16;

/// Which lend words this engine's lends in flight hold, one bit each
/// ([`crate::transport::lend_word_of`] of their incarnations): a lend
/// whose word another live lend holds confirms no read one-sidedly (its
/// readers ask it, a round trip each), and incarnations drawn at random
/// met one at a rate of live lends / words (6 % of 8 192 lends in flight
/// over a UCX transport's 131 072 words). The poller clears a lend's
/// word before it publishes the lend's end, and the engine releases its
/// bit when it takes that report: a bit is cleared only after its word
/// is.
struct WordsInUse {
    bits: Vec<u64>,
    len: usize,
}

impl WordsInUse {
    fn new(len: usize) -> Self {
        let len = if len.is_power_of_two() { len } else { 0 };
        WordsInUse {
            bits: vec![0; len.div_ceil(64)],
            len,
        }
    }

    fn index(&self, token: Incarnation) -> Option<usize> {
        crate::transport::lend_word_of(token, self.len)
    }

    fn held(&self, i: usize) -> bool {
        self.bits[i / 64] & (1 << (i % 64)) != 0
    }

    /// A fresh incarnation whose word no live lend of this engine holds
    /// (a few draws; the last one drawn if every one was held).
    fn draw(&self) -> Incarnation {
        let mut token = Incarnation::draw();
        for _ in 1..WORD_DRAWS {
            match self.index(token) {
                Some(i) if self.held(i) => token = Incarnation::draw(),
                _ => break,
            }
        }
        token
    }

    /// The word lend `token` would hold, or [`NO_WORD`] if another live
    /// lend holds it (or there are none).
    fn free_word_of(&self, token: Incarnation) -> u32 {
        match self.index(token) {
            Some(i) if !self.held(i) => i as u32,
            _ => NO_WORD,
        }
    }

    fn hold(&mut self, word: u32) {
        if word != NO_WORD {
            let i = word as usize;
            self.bits[i / 64] |= 1 << (i % 64);
        }
    }

    fn release(&mut self, word: u32) {
        if word != NO_WORD {
            let i = word as usize;
            self.bits[i / 64] &= !(1 << (i % 64));
        }
    }
}

/// Incarnation tokens, drawn from the operating system's CSPRNG
/// (`getrandom(2)`) a batch at a time, so that drawing one costs an index.
struct Tokens {
    buf: [u64; 64],
    next: usize,
}

impl Default for Tokens {
    fn default() -> Self {
        Tokens {
            buf: [0; 64],
            next: 64,
        }
    }
}

impl Tokens {
    fn draw(&mut self) -> Incarnation {
        loop {
            if self.next == self.buf.len() {
                self.refill();
            }
            let t = self.buf[self.next];
            self.next += 1;
            if t != 0 {
                return Incarnation(t);
            }
        }
    }

    fn refill(&mut self) {
        let len = std::mem::size_of_val(&self.buf);
        let base = self.buf.as_mut_ptr().cast::<u8>();
        let mut filled = 0;
        while filled < len {
            // SAFETY: the destination is the rest of `buf`, `len - filled`
            // writable bytes; getrandom writes at most that many.
            let n = unsafe { libc::getrandom(base.add(filled).cast(), len - filled, 0) };
            if n > 0 {
                filled += n as usize;
            } else if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                // Without getrandom(2) (kernels before 3.17): the device.
                use std::io::Read;
                let mut bytes = vec![0u8; len - filled];
                std::fs::File::open("/dev/urandom")
                    .and_then(|mut f| f.read_exact(&mut bytes))
                    .expect("no source of randomness for incarnation tokens");
                // SAFETY: `bytes` holds exactly the `len - filled` bytes
                // left in `buf`, which does not overlap it.
                unsafe {
                    std::ptr::copy_nonoverlapping(bytes.as_ptr(), base.add(filled), len - filled)
                };
                filled = len;
            }
        }
        self.next = 0;
    }
}

/// A lend's incarnation must name one: [`Incarnation::NONE`] is refused.
fn lendable(token: Incarnation) -> Result<(), SubmitError> {
    if token.is_none() {
        return Err(SubmitError::BadIncarnation {
            handle: 0,
            why: "a lend needs an incarnation (Incarnation::draw)",
        });
    }
    Ok(())
}

fn instance_id() -> u64 {
    // Unique per engine start: time, process and a counter, mixed.
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let x = t ^ (u64::from(std::process::id()) << 32) ^ COUNTER.fetch_add(1, Ordering::Relaxed);
    crate::wire::fnv1a64(&x.to_le_bytes()) | 1
}

/// Request id → what it is and when it was submitted. The ledger's cheap
/// id hasher: ids are the engine's own, and SipHash cost a third of a
/// submit and report.
type InFlight = HashMap<
    RequestId,
    (Kind, std::time::Instant, u32),
    std::hash::BuildHasherDefault<crate::ledger::IdHasher>,
>;

/// A registered region as the engine thread sees it.
#[derive(Debug, Clone)]
struct Region {
    base: usize,
    len: usize,
    /// Device memory: blocks are copied through the CUDA driver.
    #[cfg(feature = "cuda")]
    device: Option<crate::gpu::DeviceMemory>,
}

/// The engine: submit transfers, poll for reports. See the module docs.
pub struct Engine {
    slots: Arc<Slots>,
    pub(crate) commands: CommandSender<Command>,
    retire: CommandSender<RequestKey>,
    pub(crate) events: EventReceiver<Event>,
    control: mpsc::Sender<Control>,
    pub(crate) shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    /// What each request in flight is, when it was submitted, and the
    /// lend word it holds ([`NO_WORD`]: none).
    in_flight: InFlight,
    /// The lend words this engine's lends in flight hold.
    words: WordsInUse,
    /// Outcomes and latencies of what was reported, for `metrics()`.
    pub(crate) tally: crate::metrics::Tally,
    scratch: Vec<Command>,
    /// Events drained during shutdown, reported by the next poll.
    parked: Vec<Event>,
    retired: Vec<BlockId>,
    region_blocks: Option<u64>,
    regions: Vec<Region>,
    /// Each peer's block size, by peer id (0: never added here).
    peer_block_sizes: Vec<u64>,
    max_blocks: u32,
    capacity: u32,
    block_size: u64,
    read_deadline: Duration,
    confirm_reads: bool,
    /// Peers may write into this engine's blocks: it may open receives.
    remote_write: bool,
    /// Its UCX context can post puts (not over tcp alone without remote
    /// writes: `ContextOptions::without_rma`).
    puts: bool,
    /// The deployment's key: peers' metadata must carry its tag.
    auth: Option<AuthKey>,
    /// The last `wait` returned with its eventfd readable: drained before
    /// the next announcement, not on the way to the reports.
    reports_signalled: bool,
}

/// Wakes an engine thread blocked in [`Engine::wait`] from any thread (a
/// control-plane thread that has work for it, say). Cheap to clone; a
/// wake with nobody waiting makes the next `wait` return at once.
#[derive(Clone)]
pub struct EngineWaker {
    shared: Arc<Shared>,
}

impl EngineWaker {
    /// Wakes the engine thread if it waits; otherwise its next
    /// [`Engine::wait`] returns without blocking. No syscall unless it
    /// waits.
    pub fn wake(&self) {
        self.shared.reports.notify();
    }
}

impl std::fmt::Debug for EngineWaker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EngineWaker")
    }
}

/// Poller counters, as SPDK's reactors count them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PollerStats {
    /// Loop iterations that did work.
    pub busy_iterations: u64,
    /// Loop iterations that found nothing to do.
    pub idle_iterations: u64,
    /// Nanoseconds spent in runs of busy iterations (SPDK's busy ticks).
    pub busy_ns: u64,
    /// Nanoseconds spent idle: spinning, yielding or blocked waiting for
    /// an event. `busy_ns / (busy_ns + idle_ns)` is the poller's load.
    pub idle_ns: u64,
    /// Notification payloads that did not decode (dropped, nothing changed).
    pub malformed_notifications: u64,
    /// Notifications that decoded but were refused: unknown request, the
    /// wrong kind for it, a repeat from an engine already counted, or an
    /// acknowledgement from an engine the write did not write to, a note
    /// held for a lend that never came, a read refused as not lent.
    pub rejected_notifications: u64,
    /// As a lender: reads refused because this engine did not lend what
    /// they read under the incarnation they named (another lend's blocks,
    /// blocks not lent, an incarnation it can tell it never lent).
    pub refused_reads: u64,
    /// As a reader: reads that failed `Cause::NotLent` (their lender
    /// refused them so, or never knew their lend).
    pub reads_not_lent: u64,
    /// As a push destination: writers' words refused because the blocks
    /// they wrote were not their receive's (another receive's, or none),
    /// or the receive's blocks may hold another write's bytes.
    pub refused_writes: u64,
    /// As a writer: writes that failed `Cause::NotLent` (their
    /// destination did not take their word).
    pub writes_not_lent: u64,
    /// Transfer operations posted (one block of one region each, plus
    /// flushes).
    pub ops_posted: u64,
    /// Transfer operations completed, successfully or not.
    pub ops_completed: u64,
    /// Bytes moved by operations that completed successfully.
    pub bytes_moved: u64,
    /// Notifications sent (and answered) to other engines.
    pub notifications_sent: u64,
    /// Messages they travelled in: the notifications the poller has for
    /// one endpoint at once share one message.
    pub notification_messages: u64,
    /// Peer metadata [`Engine::add_peer`] refused as unauthenticated
    /// ([`PeerError::Unauthenticated`]): no tag of this engine's key, or a
    /// tag where this engine has no key.
    pub unauthenticated_peers: u64,
    /// Notification messages dropped whole because their tag did not
    /// check out (an engine with a key only): sent by a process without
    /// the key or with another, meant for another engine, or altered.
    pub unauthenticated_notifications: u64,
    /// Notification messages dropped whole as copies of one received
    /// before (an engine with a key only): a valid tag on a counter
    /// already seen from its sender.
    pub replayed_notifications: u64,
    /// As a reader: lenders whose lend word, read after the data, named
    /// the lend: confirmed without a question.
    pub word_confirmations: u64,
    /// As a reader: lend words that did not name the lend (not lent yet,
    /// ended, taken by another lend, not readable): the lender was asked.
    pub word_misses: u64,
    /// As a lender: lends that found their word held by another live lend
    /// (their readers ask). [`Engine::lend`] draws incarnations whose
    /// words this engine's live lends do not hold; a caller's own
    /// ([`Engine::lend_with`]) may collide.
    pub lend_word_collisions: u64,
}

impl Engine {
    /// A builder with the defaults.
    pub fn builder() -> EngineBuilder {
        EngineBuilder::default()
    }

    fn control<T, E: From<Stopped>>(
        &self,
        make: impl FnOnce(mpsc::Sender<Result<T, E>>) -> Control,
    ) -> Result<T, E> {
        self.alive()?;
        let (tx, rx) = mpsc::channel();
        self.control.send(make(tx)).map_err(|_| self.gone())?;
        self.shared.control_pending.store(true, Ordering::Release);
        self.wake();
        rx.recv().map_err(|_| self.gone())?
    }

    /// Whether the engine still takes requests.
    fn alive(&self) -> Result<(), Stopped> {
        if self.shared.dead.load(Ordering::Acquire) {
            return Err(Stopped::PollerDied);
        }
        if self.is_deaf() {
            return Err(Stopped::Deaf);
        }
        match &self.thread {
            None => Err(Stopped::Shutdown),
            Some(t) if t.is_finished() => Err(self.gone()),
            Some(_) => Ok(()),
        }
    }

    /// Whether the poller found this engine's UCX worker deaf: it receives
    /// no message again (a peer killed inside a shared-memory send to it
    /// left its receive queue stopped; docs/design.md §4). Found by a probe
    /// the poller sends itself over the transports its peers use, within
    /// about a second of poller time. From then on every call that would
    /// start something fails with [`Stopped::Deaf`]; [`Engine::poll`] still
    /// reports what was in flight as it ends (each lend at its lease, each
    /// read or write at its deadline or lease), once. The engine cannot
    /// recover: build a new one and give peers its
    /// [`Engine::local_metadata`] (`kvpoll serve` does). Always `false`
    /// without a shared-memory transport.
    pub fn is_deaf(&self) -> bool {
        self.shared.deaf.load(Ordering::Acquire)
    }

    /// Why the poller is not there.
    fn gone(&self) -> Stopped {
        if self.shared.dead.load(Ordering::Acquire) {
            Stopped::PollerDied
        } else {
            Stopped::Shutdown
        }
    }

    /// Registers a region of `blocks` blocks (one KV layer) of host memory
    /// the engine allocates, zeroed: UCX's shared memory (on one host,
    /// read and written one-sidedly from the mapped segment), or, where
    /// UCX moves one-sided operations on one host through `cma`
    /// ([`crate::transport::ucx::Context::reads_by_cma`]), anonymous memory
    /// on huge pages (`cma` copies from them faster). For memory the
    /// serving engine already has, see
    /// [`Engine::register_memory`]. Every region must hold the same
    /// number of blocks. Returns the region's index.
    pub fn register(&mut self, blocks: u64) -> Result<usize, RegionError> {
        self.register_region(blocks, None, None)
    }

    /// Registers caller memory as a region of `len / block_size` blocks
    /// (one KV layer): `len` must be a whole number of blocks.
    ///
    /// # Safety
    /// `base..base+len` must be valid, writable host memory that stays
    /// allocated and in place until the engine is dropped (after
    /// [`Engine::shutdown`]), and the caller must not rely on its contents
    /// while transfers into it are in flight.
    pub unsafe fn register_memory(
        &mut self,
        base: *mut u8,
        len: usize,
    ) -> Result<usize, RegionError> {
        let blocks = self.caller_blocks(base as usize, len)?;
        self.register_region(blocks, Some(base as usize), None)
    }

    /// Registers CUDA device memory the caller owns (a serving engine's KV
    /// layer on the GPU) as a region of `len / block_size` blocks, *as*
    /// device memory: UCX moves its blocks over its CUDA transports
    /// (GPUDirect RDMA where the NIC allows, `cuda_ipc` between GPUs of
    /// one host, staged by `cuda_copy` otherwise). `read_block` and
    /// `write_block` copy through the CUDA driver.
    ///
    /// Refused with [`RegionError::Device`], changing nothing, when this
    /// machine has no CUDA driver or GPU ([`crate::gpu::GpuError::NoDriver`],
    /// [`crate::gpu::GpuError::NoDevice`]), when CUDA does not report
    /// `base..base+len` as inside one device allocation
    /// ([`crate::gpu::GpuError::NotDeviceMemory`]), or when the UCX loaded
    /// has no CUDA transports ([`crate::gpu::GpuError::UcxWithoutCuda`]).
    ///
    /// # Safety
    /// `base..base+len` must stay allocated on the device, in place, until
    /// the engine is dropped (after [`Engine::shutdown`]), and the caller
    /// must not rely on its contents while transfers into it are in flight.
    #[cfg(feature = "cuda")]
    pub unsafe fn register_device_memory(
        &mut self,
        base: u64,
        len: usize,
    ) -> Result<usize, RegionError> {
        let blocks = self.caller_blocks(base as usize, len)?;
        let device = crate::gpu::DeviceMemory::probe(base, len)?;
        self.register_region(blocks, Some(base as usize), Some(device))
    }

    /// The blocks in `len` bytes of caller memory at `base`.
    fn caller_blocks(&self, base: usize, len: usize) -> Result<u64, RegionError> {
        if base == 0 {
            return Err(RegionError::NullMemory { len });
        }
        if len as u64 % self.block_size != 0 {
            return Err(RegionError::NotWholeBlocks {
                len,
                block_size: self.block_size,
            });
        }
        Ok(len as u64 / self.block_size)
    }

    fn register_region(
        &mut self,
        blocks: u64,
        user: Option<usize>,
        device: Option<crate::driver::DeviceMemory>,
    ) -> Result<usize, RegionError> {
        let bad = |why| RegionError::BadSize {
            blocks,
            block_size: self.block_size,
            why,
        };
        if blocks == 0 || blocks > u64::from(u32::MAX) {
            return Err(bad("a region holds 1..=u32::MAX blocks"));
        }
        if let Some(first) = self.region_blocks {
            if first != blocks {
                return Err(RegionError::Uneven { blocks, first });
            }
        }
        let len = blocks
            .checked_mul(self.block_size)
            .filter(|&l| l <= 1 << 40)
            .ok_or_else(|| bad("more than the 1 TiB a region may map"))?;
        #[cfg(feature = "cuda")]
        let copies = device.clone();
        let (base, len) = self.control(|reply| Control::Register {
            blocks,
            len: len as usize,
            user,
            device,
            reply,
        })?;
        self.region_blocks = Some(blocks);
        self.regions.push(Region {
            base,
            len,
            #[cfg(feature = "cuda")]
            device: copies,
        });
        Ok(self.regions.len() - 1)
    }

    /// Copies `data` into block `block` of region `region` (the serving
    /// engine filling KV, or a test writing a pattern).
    pub fn write_block(
        &self,
        region: usize,
        block: BlockId,
        data: &[u8],
    ) -> Result<(), RegionError> {
        let dst = self.block_ptr(region, block, data.len())?;
        #[cfg(feature = "cuda")]
        if let Some(device) = &self.regions[region].device {
            return Ok(device.write(dst as u64, data)?);
        }
        // SAFETY: dst..dst+len lies inside a registered region (checked),
        // which stays mapped until the engine is dropped.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
        Ok(())
    }

    /// Copies block `block` of region `region` into `out`.
    pub fn read_block(
        &self,
        region: usize,
        block: BlockId,
        out: &mut [u8],
    ) -> Result<(), RegionError> {
        let src = self.block_ptr(region, block, out.len())?;
        #[cfg(feature = "cuda")]
        if let Some(device) = &self.regions[region].device {
            return Ok(device.read(src as u64, out)?);
        }
        // SAFETY: as in write_block.
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    fn block_ptr(&self, region: usize, block: BlockId, len: usize) -> Result<*mut u8, RegionError> {
        let r = self.regions.get(region).ok_or(RegionError::NoSuchRegion {
            region,
            regions: self.regions.len(),
        })?;
        if len as u64 > self.block_size {
            return Err(RegionError::TooManyBytes {
                given: len,
                block_size: self.block_size,
            });
        }
        let off = u64::from(block.0) * self.block_size;
        if off + self.block_size > r.len as u64 {
            return Err(RegionError::BlockOutOfRange {
                region,
                block,
                blocks: self.region_blocks.unwrap_or(0),
            });
        }
        Ok((r.base + off as usize) as *mut u8)
    }

    /// Bytes per block.
    pub fn block_size(&self) -> u64 {
        self.block_size
    }

    /// This engine's metadata for its peers: worker address, region rkeys
    /// and layout, versioned and checksummed.
    pub fn local_metadata(&self) -> Result<Vec<u8>, PeerError> {
        self.control(|reply| Control::Metadata { reply })
    }

    /// Adds a peer from its metadata. Bad metadata changes nothing. With
    /// a key ([`EngineBuilder::auth_key`]), metadata not tagged with it is
    /// refused ([`PeerError::Unauthenticated`]); without one, tagged
    /// metadata is. Each such refusal is counted
    /// ([`PollerStats::unauthenticated_peers`]).
    pub fn add_peer(&mut self, metadata: &[u8]) -> Result<PeerId, PeerError> {
        let meta = self.decode_peer(metadata)?;
        meta.check_compatible(crate::metadata::BlockLayout {
            block_size: self.block_size,
        })?;
        self.add_decoded_peer(meta)
    }

    /// [`Engine::add_peer`] for a peer whose block size may differ from
    /// this engine's (a tensor-parallel rank holding another share of each
    /// block's heads). Whole-block transfers to it are refused while the
    /// sizes differ; part transfers ([`Transfer::part`]) address its blocks
    /// at its own size.
    pub fn add_peer_any_block_size(&mut self, metadata: &[u8]) -> Result<PeerId, PeerError> {
        let meta = self.decode_peer(metadata)?;
        self.add_decoded_peer(meta)
    }

    /// A peer's metadata, checked and authenticated; a refusal as
    /// unauthenticated is counted.
    fn decode_peer(&self, metadata: &[u8]) -> Result<crate::metadata::PeerMetadata, PeerError> {
        crate::metadata::PeerMetadata::decode_with_key(metadata, self.auth.as_ref()).map_err(|e| {
            let e = PeerError::from(e);
            if let PeerError::Unauthenticated(why) = &e {
                // Relaxed: a counter read for display only.
                self.shared
                    .unauthenticated_peers
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %why, "peer refused as unauthenticated");
            }
            e
        })
    }

    fn add_decoded_peer(
        &mut self,
        meta: crate::metadata::PeerMetadata,
    ) -> Result<PeerId, PeerError> {
        let block_size = meta.layout.block_size;
        let peer = self.control(|reply| Control::AddPeer { meta, reply })?;
        let i = peer.0 as usize;
        if self.peer_block_sizes.len() <= i {
            self.peer_block_sizes.resize(i + 1, 0);
        }
        self.peer_block_sizes[i] = block_size;
        Ok(peer)
    }

    /// The part of each block handle `i` moves, checked against both
    /// sides' block sizes; `None` for whole blocks.
    fn block_bytes(
        &self,
        i: usize,
        peer: PeerId,
        bytes: Option<(std::ops::Range<u64>, std::ops::Range<u64>)>,
    ) -> Result<Option<BlockBytes>, SubmitError> {
        let theirs = self.peer_block_sizes.get(peer.0 as usize).copied();
        let Some((local, remote)) = bytes else {
            return match theirs {
                Some(bs) if bs != 0 && bs != self.block_size => Err(SubmitError::BadPart {
                    handle: i,
                    local: 0..self.block_size,
                    remote: 0..bs,
                    why: "whole blocks of different sizes: give the part of each block to move",
                }),
                _ => Ok(None),
            };
        };
        let bad = |why| SubmitError::BadPart {
            handle: i,
            local: local.clone(),
            remote: remote.clone(),
            why,
        };
        if local.is_empty() || remote.is_empty() {
            return Err(bad("an empty byte range"));
        }
        if local.end - local.start != remote.end - remote.start {
            return Err(bad("the local and remote ranges differ in length"));
        }
        if local.end > self.block_size {
            return Err(bad("the local range ends past this engine's block size"));
        }
        match theirs {
            Some(bs) if bs != 0 => {
                if remote.end > bs {
                    return Err(bad("the remote range ends past the peer's block size"));
                }
            }
            _ => return Err(SubmitError::UnknownPeer { handle: i, peer }),
        }
        Ok(Some(BlockBytes {
            local_offset: local.start,
            remote_offset: remote.start,
            len: local.end - local.start,
        }))
    }

    /// Removes a peer: its handles in flight fail (deferred, as always), its
    /// endpoint is closed. Removing a peer again is fine; an id this engine
    /// never gave out is [`PeerError::Unknown`].
    pub fn remove_peer(&mut self, peer: PeerId) -> Result<(), PeerError> {
        self.control(|reply| Control::RemovePeer { peer, reply })
    }

    fn check_blocks<'a>(
        &self,
        blocks: impl Iterator<Item = &'a BlockId>,
    ) -> Result<(), SubmitError> {
        let n = self.region_blocks.ok_or(SubmitError::NoRegions)?;
        for &b in blocks {
            if u64::from(b.0) >= n {
                return Err(SubmitError::BlockOutOfRange {
                    block: b,
                    blocks: n,
                });
            }
        }
        Ok(())
    }

    fn admit(&self, id: RequestId) -> Result<(), SubmitError> {
        self.alive()?;
        if self.in_flight.contains_key(&id) {
            return Err(SubmitError::Duplicate(id));
        }
        if self.in_flight.len() >= self.capacity as usize {
            return Err(SubmitError::Full(self.capacity));
        }
        Ok(())
    }

    fn submit_transfers<'a, H: Handle<'a>>(
        &mut self,
        id: RequestId,
        kind: Kind,
        handles: &[H],
        expires_in: Duration,
    ) -> Result<(), SubmitError> {
        self.admit(id)?;
        if handles.len() > MAX_HANDLES {
            return Err(SubmitError::TooManyHandles(handles.len()));
        }
        let mut total = 0usize;
        let mut parts: arrayvec::ArrayVec<Option<BlockBytes>, MAX_HANDLES> =
            arrayvec::ArrayVec::new();
        let guarded = self.confirm_reads || kind != Kind::Read;
        for (i, handle) in handles.iter().enumerate() {
            let h = handle.transfer();
            if h.local.len() != h.remote.len() || h.local.is_empty() {
                return Err(SubmitError::BadPairing {
                    handle: i,
                    local: h.local.len(),
                    remote: h.remote.len(),
                });
            }
            self.check_blocks(h.local.iter())?;
            if guarded && h.lend.is_none() {
                return Err(SubmitError::BadIncarnation {
                    handle: i,
                    why: "no incarnation: pass the token the remote engine's lend returned",
                });
            }
            if handles[..i]
                .iter()
                .map(|g| g.transfer())
                .any(|g| g.peer == h.peer && g.lend != h.lend)
            {
                return Err(SubmitError::BadIncarnation {
                    handle: i,
                    why: "handles to one peer name different incarnations (one request reads one lend of each peer)",
                });
            }
            parts.push(self.block_bytes(i, h.peer, handle.bytes())?);
            total += h.local.len();
        }
        if total > self.max_blocks as usize {
            return Err(SubmitError::TooManyBlocks {
                given: total,
                max: self.max_blocks,
            });
        }
        let n_parts = parts.iter().filter(|p| p.is_some()).count();
        self.fits(Command::entries_for_parts(handles.len(), n_parts, total))?;
        self.scratch.clear();
        self.scratch.push(Command::Begin {
            id,
            kind,
            handles: handles.len() as u8,
            blocks: 0,
            expires_in: nanos(expires_in),
            token: Incarnation::draw(),
        });
        for (handle, part) in handles.iter().zip(parts) {
            let h = handle.transfer();
            if let Some(part) = part {
                self.scratch.push(Command::Part(part));
            }
            self.scratch.push(Command::Handle {
                peer: h.peer,
                pairs: h.local.len() as u32,
                lend: h.lend,
            });
            self.scratch.extend(
                h.local
                    .iter()
                    .zip(h.remote)
                    .map(|(&local, &remote)| Command::Pair { local, remote }),
            );
        }
        self.send(id, kind)
    }

    /// Refuses a batch the command ring can never hold.
    fn fits(&self, entries: usize) -> Result<(), SubmitError> {
        let capacity = self.commands.capacity();
        if entries > capacity {
            return Err(SubmitError::RequestTooLarge { entries, capacity });
        }
        Ok(())
    }

    fn send(&mut self, id: RequestId, kind: Kind) -> Result<(), SubmitError> {
        self.send_holding(id, kind, NO_WORD)
    }

    /// [`Engine::send`] of a lend that holds lend word `word`.
    fn send_holding(&mut self, id: RequestId, kind: Kind, word: u32) -> Result<(), SubmitError> {
        self.commands
            .send_all(&self.scratch)
            .map_err(|_| SubmitError::RingFull(self.scratch.len()))?;
        if kind != Kind::NotifyOnly {
            self.in_flight
                .insert(id, (kind, std::time::Instant::now(), word));
        }
        self.wake();
        Ok(())
    }

    /// Pull: reads `handles` (one per remote rank). Reported in
    /// `finished_recving`, or `failed_recving` with the blocks to invalidate
    /// once every handle stopped. On success each producer rank is
    /// notified. With no handles (a full prefix hit) it is reported finished
    /// at once.
    ///
    /// Several handles may name the same producer rank: it is notified once.
    pub fn read(&mut self, id: RequestId, handles: &[Transfer<'_>]) -> Result<(), SubmitError> {
        self.read_with_deadline(id, handles, self.read_deadline)
    }

    /// [`Engine::read`] with its own deadline. Past it, the peers still
    /// serving the read are judged stalled: their endpoints are force-closed
    /// (other requests on them fail with `Cause::PeerStalled`, new ones get
    /// a fresh endpoint) and the read fails with `Cause::Deadline` once
    /// quiescent.
    pub fn read_with_deadline(
        &mut self,
        id: RequestId,
        handles: &[Transfer<'_>],
        deadline: Duration,
    ) -> Result<(), SubmitError> {
        let kind = if handles.is_empty() {
            Kind::PrefixHit
        } else {
            Kind::Read
        };
        self.submit_transfers(id, kind, handles, deadline)
    }

    /// [`Engine::read_with_deadline`] of part of each block: each handle
    /// moves the byte range [`Transfer::part`] gave it (the heads one
    /// tensor-parallel rank holds of each block, say). `None` takes the
    /// engine's read deadline.
    pub fn read_parts(
        &mut self,
        id: RequestId,
        handles: &[PartTransfer<'_>],
        deadline: Option<Duration>,
    ) -> Result<(), SubmitError> {
        if handles.is_empty() {
            return Err(SubmitError::NoHandles);
        }
        let deadline = deadline.unwrap_or(self.read_deadline);
        self.submit_transfers(id, Kind::Read, handles, deadline)
    }

    /// Nothing to read (a full prefix hit, or a producer rank this consumer
    /// does not read from), but each of `producers` lent blocks for request
    /// `id` (the incarnation its lend returned) and awaits this engine's
    /// word: each is notified once, so it releases at once instead of at
    /// its lease's end. Nothing is reported here; the id is not tracked
    /// (it may be reused at once).
    pub fn notify_only(
        &mut self,
        id: RequestId,
        producers: &[(PeerId, Incarnation)],
    ) -> Result<(), SubmitError> {
        self.alive()?;
        if producers.len() > MAX_HANDLES {
            return Err(SubmitError::TooManyHandles(producers.len()));
        }
        if let Some(i) = producers.iter().position(|p| p.1.is_none()) {
            return Err(SubmitError::BadIncarnation {
                handle: i,
                why: "no incarnation: pass the token the remote engine's lend returned",
            });
        }
        self.fits(Command::entries_for_transfers(producers.len(), 0))?;
        self.scratch.clear();
        self.scratch.push(Command::Begin {
            id,
            kind: Kind::NotifyOnly,
            handles: producers.len() as u8,
            blocks: 0,
            expires_in: 0,
            token: Incarnation::draw(),
        });
        self.scratch
            .extend(producers.iter().map(|&(peer, lend)| Command::Handle {
                peer,
                pairs: 0,
                lend,
            }));
        self.send(id, Kind::NotifyOnly)
    }

    /// Push: writes `handles` into remote blocks the consumers opened with
    /// [`Engine::receive`] or [`Engine::receive_from`]. Done (`finished_sending`) only after every write
    /// completed and was flushed on the endpoint it travelled on and
    /// `expected_acks` consumer engines acknowledged (one each, whatever
    /// their handle count); never after a failure: a failed or aborted write
    /// is reported in `failed_sending` with its reason once quiescent.
    /// Unacknowledged at the lease end: `expired`.
    pub fn write(
        &mut self,
        id: RequestId,
        handles: &[Transfer<'_>],
        expected_acks: u32,
        lease: Duration,
    ) -> Result<(), SubmitError> {
        self.submit_write(id, handles, expected_acks, lease)
    }

    fn submit_write<'a, H: Handle<'a>>(
        &mut self,
        id: RequestId,
        handles: &[H],
        expected_acks: u32,
        lease: Duration,
    ) -> Result<(), SubmitError> {
        if !self.puts {
            return Err(SubmitError::NoPuts);
        }
        if handles.is_empty() {
            return Err(SubmitError::NoHandles);
        }
        if expected_acks as usize > MAX_CONSUMERS {
            return Err(SubmitError::TooManyConsumers(expected_acks));
        }
        self.submit_transfers(
            id,
            Kind::Write {
                acks: expected_acks,
            },
            handles,
            lease,
        )
    }

    /// [`Engine::write`] of part of each block: each handle moves the
    /// byte range [`Transfer::part`] gave it.
    pub fn write_parts(
        &mut self,
        id: RequestId,
        handles: &[PartTransfer<'_>],
        expected_acks: u32,
        lease: Duration,
    ) -> Result<(), SubmitError> {
        self.submit_write(id, handles, expected_acks, lease)
    }

    /// Pull: lends `blocks` to `readers` remote engines until each of them
    /// notified (each engine counts once, however many handles it used;
    /// then `finished_sending`) or `lease` ends (`expired`).
    ///
    /// Returns the lend's incarnation: hand it to the readers with the
    /// block ids, as [`Transfer::lend`]. It is drawn now, so a reader
    /// holding it reads blocks this engine has already committed, even if
    /// its read reaches the poller before this lend does (see
    /// [`EngineBuilder::lend_grace`]); the lease starts when the poller
    /// takes the lend. The request id may be reused once this lend is
    /// reported: notes about this incarnation never touch the next one.
    pub fn lend(
        &mut self,
        id: RequestId,
        blocks: &[BlockId],
        readers: u32,
        lease: Duration,
    ) -> Result<Incarnation, SubmitError> {
        let token = self.words.draw();
        self.lend_with(id, blocks, readers, lease, token)?;
        Ok(token)
    }

    /// [`Engine::lend`] under an incarnation the caller drew with
    /// [`Incarnation::draw`] and may already have handed out with the
    /// block ids: a reader may then ask before this lend reaches the
    /// poller, and is answered once it does ([`EngineBuilder::lend_grace`]).
    /// Draw a fresh one for every lend: an incarnation used twice lets a
    /// late note about the first lend touch the second.
    pub fn lend_with(
        &mut self,
        id: RequestId,
        blocks: &[BlockId],
        readers: u32,
        lease: Duration,
        token: Incarnation,
    ) -> Result<(), SubmitError> {
        let kind = Kind::Lend {
            notifications: readers,
        };
        self.expose(id, blocks, readers, kind, lease, token)
    }

    /// Push: opens a receive, local `blocks` that `writers` remote engines
    /// write into and notify; when all did, the data is here
    /// (`finished_recving`) and each writer is acknowledged; otherwise
    /// `failed_recving` names the blocks, which may hold partial data. The
    /// writers are unnamed: at the lease's end every peer this engine
    /// knows is asked (see [`Engine::receive_from`]).
    ///
    /// Returns the receive's incarnation: hand it to the writers with the
    /// block ids, as [`Transfer::lend`].
    pub fn receive(
        &mut self,
        id: RequestId,
        blocks: &[BlockId],
        writers: u32,
        lease: Duration,
    ) -> Result<Incarnation, SubmitError> {
        let token = Incarnation::draw();
        self.receive_with(id, blocks, writers, lease, token)?;
        Ok(token)
    }

    /// [`Engine::receive`] under an incarnation the caller drew (see
    /// [`Engine::lend_with`]).
    pub fn receive_with(
        &mut self,
        id: RequestId,
        blocks: &[BlockId],
        writers: u32,
        lease: Duration,
        token: Incarnation,
    ) -> Result<(), SubmitError> {
        self.writable()?;
        let kind = Kind::Receive { writers };
        self.expose(id, blocks, writers, kind, lease, token)
    }

    /// A receive invites peers' writes: refused where they are not allowed.
    fn writable(&self) -> Result<(), SubmitError> {
        if self.remote_write {
            Ok(())
        } else {
            Err(SubmitError::RemoteWriteOff)
        }
    }

    /// Lends or opens a receive for `n` remote engines.
    fn expose(
        &mut self,
        id: RequestId,
        blocks: &[BlockId],
        n: u32,
        kind: Kind,
        lease: Duration,
        token: Incarnation,
    ) -> Result<(), SubmitError> {
        lendable(token)?;
        self.admit(id)?;
        if n == 0 {
            return Err(SubmitError::NothingToAwait);
        }
        if n as usize > MAX_CONSUMERS {
            return Err(SubmitError::TooManyConsumers(n));
        }
        self.check_blocks(blocks.iter())?;
        if blocks.len() > self.max_blocks as usize {
            return Err(SubmitError::TooManyBlocks {
                given: blocks.len(),
                max: self.max_blocks,
            });
        }
        self.fits(1 + blocks.len())?;
        self.scratch.clear();
        self.scratch.push(Command::Begin {
            id,
            kind,
            handles: 0,
            blocks: blocks.len() as u32,
            expires_in: nanos(lease),
            token,
        });
        self.scratch
            .extend(blocks.iter().map(|&b| Command::Block(b)));
        let word = match kind {
            Kind::Lend { .. } => self.words.free_word_of(token),
            _ => NO_WORD,
        };
        self.send_holding(id, kind, word)?;
        self.words.hold(word);
        Ok(())
    }

    /// A receive whose writers are named: `blocks` wait for each writer
    /// engine of `writers` to say its write landed (or that it gave up).
    /// Its lease is a fence, not a timer: when it ends (or on
    /// [`Engine::abort`]) with a writer still silent, the blocks stay
    /// quarantined — not reported, so not reused — until that writer speaks
    /// (a stalled writer does, once it resumes and its own lease ends) or
    /// its peer is lost (its endpoint fails, or [`Engine::remove_peer`]).
    /// Reported in `finished_recving`, or in `failed_recving` naming the
    /// blocks.
    ///
    /// Returns the receive's incarnation, for the writers' handles.
    pub fn receive_from(
        &mut self,
        id: RequestId,
        blocks: &[BlockId],
        writers: &[PeerId],
        lease: Duration,
    ) -> Result<Incarnation, SubmitError> {
        let token = Incarnation::draw();
        self.receive_from_with(id, blocks, writers, lease, token)?;
        Ok(token)
    }

    /// [`Engine::receive_from`] under an incarnation the caller drew (see
    /// [`Engine::lend_with`]).
    pub fn receive_from_with(
        &mut self,
        id: RequestId,
        blocks: &[BlockId],
        writers: &[PeerId],
        lease: Duration,
        token: Incarnation,
    ) -> Result<(), SubmitError> {
        self.writable()?;
        lendable(token)?;
        self.admit(id)?;
        let mut distinct: arrayvec::ArrayVec<PeerId, MAX_HANDLES> = arrayvec::ArrayVec::new();
        for &w in writers {
            if !distinct.contains(&w) {
                distinct
                    .try_push(w)
                    .map_err(|_| SubmitError::TooManyConsumers(writers.len() as u32))?;
            }
        }
        if distinct.is_empty() {
            return Err(SubmitError::NothingToAwait);
        }
        self.check_blocks(blocks.iter())?;
        if blocks.len() > self.max_blocks as usize {
            return Err(SubmitError::TooManyBlocks {
                given: blocks.len(),
                max: self.max_blocks,
            });
        }
        self.fits(1 + distinct.len() + blocks.len())?;
        let kind = Kind::Receive {
            writers: distinct.len() as u32,
        };
        self.scratch.clear();
        self.scratch.push(Command::Begin {
            id,
            kind,
            handles: distinct.len() as u8,
            blocks: blocks.len() as u32,
            expires_in: nanos(lease),
            token,
        });
        self.scratch
            .extend(distinct.iter().map(|&peer| Command::Handle {
                peer,
                pairs: 0,
                lend: Incarnation::NONE,
            }));
        self.scratch
            .extend(blocks.iter().map(|&b| Command::Block(b)));
        self.send(id, kind)
    }

    /// Extends the leases of these writes or lends to `extend` from now
    /// (never shortening). Unknown ids are ignored (and counted).
    pub fn heartbeat(&mut self, ids: &[RequestId], extend: Duration) -> Result<(), SubmitError> {
        self.alive()?;
        self.fits(ids.len())?;
        self.scratch.clear();
        let ns = nanos(extend);
        self.scratch.extend(
            ids.iter()
                .map(|&id| Command::Heartbeat { id, extend_ns: ns }),
        );
        self.commands
            .send_all(&self.scratch)
            .map_err(|_| SubmitError::RingFull(self.scratch.len()))?;
        self.wake();
        Ok(())
    }

    /// Aborts a request. It alone is affected: what is not posted is
    /// cancelled, what is posted completes (or fails) on its own — nothing
    /// is force-closed, so other requests on the same peers go on — and it
    /// is reported failed (`Cause::Aborted`) once quiescent. If its posted
    /// operations outlive its deadline or lease, its peers are judged
    /// stalled as for any request.
    pub fn abort(&mut self, id: RequestId) -> Result<(), SubmitError> {
        self.alive()?;
        if !self.in_flight.contains_key(&id) {
            return Err(SubmitError::UnknownRequest(id));
        }
        self.commands
            .send_all(&[Command::Abort(id)])
            .map_err(|_| SubmitError::RingFull(1))?;
        self.wake();
        Ok(())
    }

    /// Fault injection: the poller stops progressing for `d` (as a hung
    /// rank would). Its peers see nothing but silence.
    #[cfg(feature = "fault-injection")]
    pub fn stall(&mut self, d: Duration) -> Result<(), SubmitError> {
        let ns = nanos(d);
        self.commands
            .send_all(&[Command::Stall { ns }])
            .map_err(|_| SubmitError::RingFull(1))?;
        self.wake();
        Ok(())
    }

    /// The CPU the poller is pinned to, read back after pinning; `None` when
    /// it was not asked to pin or could not (adaptive pollers only warn).
    pub fn poller_core(&self) -> Option<usize> {
        match self.shared.pinned_core.load(Ordering::Acquire) {
            u64::MAX => None,
            c => Some(c as usize),
        }
    }

    /// Requests submitted and not yet reported.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The poller's busy and idle iteration counts.
    pub fn poller_stats(&self) -> PollerStats {
        PollerStats {
            busy_iterations: self.shared.busy_iterations.load(Ordering::Relaxed),
            idle_iterations: self.shared.idle_iterations.load(Ordering::Relaxed),
            busy_ns: self.shared.busy_ns.load(Ordering::Relaxed),
            idle_ns: self.shared.idle_ns.load(Ordering::Relaxed),
            malformed_notifications: self.shared.malformed_notes.load(Ordering::Relaxed),
            rejected_notifications: self.shared.rejected_notes.load(Ordering::Relaxed),
            refused_reads: self.shared.refused_reads.load(Ordering::Relaxed),
            reads_not_lent: self.shared.reads_not_lent.load(Ordering::Relaxed),
            refused_writes: self.shared.refused_writes.load(Ordering::Relaxed),
            writes_not_lent: self.shared.writes_not_lent.load(Ordering::Relaxed),
            ops_posted: self.shared.ops_posted.load(Ordering::Relaxed),
            ops_completed: self.shared.ops_completed.load(Ordering::Relaxed),
            bytes_moved: self.shared.bytes_moved.load(Ordering::Relaxed),
            notifications_sent: self.shared.notes_sent.load(Ordering::Relaxed),
            notification_messages: self.shared.note_messages.load(Ordering::Relaxed),
            unauthenticated_peers: self.shared.unauthenticated_peers.load(Ordering::Relaxed),
            unauthenticated_notifications: self
                .shared
                .unauthenticated_notes
                .load(Ordering::Relaxed),
            replayed_notifications: self.shared.replayed_notes.load(Ordering::Relaxed),
            word_confirmations: self.shared.word_confirmations.load(Ordering::Relaxed),
            word_misses: self.shared.word_misses.load(Ordering::Relaxed),
            lend_word_collisions: self.shared.word_collisions.load(Ordering::Relaxed),
        }
    }

    /// CPU time the poller thread has used so far (Linux: from
    /// `/proc/self/task/<tid>/schedstat`, in ns). `None` where that cannot
    /// be read. How much of a core an idle poller burns is the difference
    /// over a quiet second.
    pub fn poller_cpu_time(&self) -> Option<Duration> {
        // Relaxed: written once before the poller reports ready.
        let tid = self.shared.tid.load(Ordering::Relaxed);
        if tid == 0 {
            return None;
        }
        let text = std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat")).ok()?;
        let ns: u64 = text.split_whitespace().next()?.parse().ok()?;
        Some(Duration::from_nanos(ns))
    }

    /// Ledger counters (rejected inputs and notifications); `in_use` counts
    /// the requests in flight as this thread sees them.
    pub fn ledger_stats(&self) -> crate::ledger::Stats {
        self.slots.stats(self.in_flight.len() as u32)
    }

    /// After every push: wakes the poller if it blocks (one atomic swap;
    /// an eventfd write only when it does). See [`crate::wake`].
    fn wake(&self) {
        self.shared.wake.notify();
    }

    /// Like [`Engine::poll`], but when nothing is new, blocks until the
    /// poller publishes something, an [`EngineWaker`] wakes it, or
    /// `timeout` passes (no spinning: an eventfd the poller writes only
    /// when this thread announced that it blocks). Returns what was
    /// appended to `out` (0: woken with nothing new, or timed out).
    ///
    /// For an engine thread with nothing else to do until a transfer ends:
    /// a serving loop that steps anyway polls instead. The wake-up is the
    /// one the poller gets from a submit, roles swapped, so it cannot be
    /// lost (see the wake protocol in `docs/design.md`).
    pub fn wait(&mut self, out: &mut Outcomes, timeout: Duration) -> usize {
        let n = self.poll(out);
        if n > 0 || timeout.is_zero() {
            return n;
        }
        let deadline = std::time::Instant::now() + timeout;
        let shared = self.shared.clone();
        let wake = &shared.reports;
        loop {
            if std::mem::take(&mut self.reports_signalled) {
                wake.efd.drain();
            }
            // Announce; `false`: something was published (or a waker
            // woke us) since we last looked: look again without blocking.
            if wake.state.prepare_park() {
                // Re-check after announcing: what was published before
                // the announcement is in the ring now.
                let n = self.poll(out);
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                if n > 0 || left.is_zero() || shared.dead.load(Ordering::Acquire) {
                    wake.state.woke();
                    return n;
                }
                self.reports_signalled = crate::wake::wait_readable(wake.efd.fd(), None, left);
                let notified = wake.state.woke();
                let n = self.poll(out);
                if n > 0 || notified || self.reports_signalled {
                    return n;
                }
            } else {
                // Notified since the last announcement: by a waker, or by
                // the poller for reports an earlier poll already took (the
                // two look alike; returning 0 for the second costs the
                // caller one more call, at most once per publication).
                return self.poll(out);
            }
            if std::time::Instant::now() >= deadline {
                return 0;
            }
        }
    }

    /// A handle that wakes this engine's thread out of [`Engine::wait`],
    /// usable from any thread.
    pub fn waker(&self) -> EngineWaker {
        EngineWaker {
            shared: self.shared.clone(),
        }
    }

    /// Collects what happened since the last poll into `out` (appended; clear
    /// it between polls). Returns the number of reports added. Allocates
    /// nothing when nothing happened.
    ///
    /// Once the poller died, the requests it could not report are reported
    /// here as failed (`Cause::PollerDied`, no blocks named: invalidate what
    /// they used).
    pub fn poll(&mut self, out: &mut Outcomes) -> usize {
        let mut n = 0;
        // One clock read for the latencies of everything this poll reports
        // (none when nothing is new).
        let mut now = None;
        for ev in std::mem::take(&mut self.parked) {
            n += self.report(ev, out, &mut now);
        }
        while let Some(ev) = self.events.recv() {
            n += self.report(ev, out, &mut now);
        }
        if self.shared.dead.load(Ordering::Acquire) && !self.in_flight.is_empty() {
            n += self.report_orphans(out);
        }
        // Relaxed first: one load when no peer was lost (the common case).
        if self.shared.lost_pending.load(Ordering::Relaxed)
            && self.shared.lost_pending.swap(false, Ordering::Acquire)
        {
            if let Ok(mut lost) = self.shared.lost_peers.lock() {
                n += lost.len();
                out.peers_lost.append(&mut lost);
            }
        }
        n
    }

    /// Reports what a dead poller left: it published what it could before it
    /// exited, so drain the ring once more, then fail the rest.
    fn report_orphans(&mut self, out: &mut Outcomes) -> usize {
        let thread_done = self.thread.as_ref().is_none_or(|t| t.is_finished());
        if !thread_done {
            return 0;
        }
        let mut n = 0;
        let mut now = None;
        while let Some(ev) = self.events.recv() {
            n += self.report(ev, out, &mut now);
        }
        let reason = Reason::of(Cause::PollerDied);
        for (id, (kind, _, _)) in std::mem::take(&mut self.in_flight) {
            n += 1;
            match kind {
                Kind::Write { .. } => out.failed_sending.push(FailedSend { id, reason }),
                Kind::Lend { .. } => out.expired.push(id),
                _ => {
                    let at = out.invalid_blocks.len();
                    out.failed_recving.push(FailedRecv {
                        id,
                        reason,
                        blocks: at..at,
                    });
                }
            }
        }
        n
    }

    /// Maps one event to `out`; `now` is read at the first report that
    /// needs it and shared by the rest of the poll.
    fn report(
        &mut self,
        ev: Event,
        out: &mut Outcomes,
        now: &mut Option<std::time::Instant>,
    ) -> usize {
        let Event { key, id, outcome } = ev;
        if let Outcome::HandleFailed { handle, reason } = outcome {
            out.handle_failures.push((id, handle, reason));
            *self.tally.handle_failures.of(reason.cause) += 1;
            return 1;
        }
        let entry = self.in_flight.remove(&id);
        if let Some((k, since, word)) = entry {
            let now = *now.get_or_insert_with(std::time::Instant::now);
            self.tally
                .record(k, &outcome, now.saturating_duration_since(since));
            // The poller cleared the word before it published the end.
            self.words.release(word);
        }
        let kind = entry.map(|(k, _, _)| k);
        self.retired.clear();
        // Read the blocks to invalidate, then hand the key back: the slot
        // (and its block list) cannot be reused before the poller retires it.
        let _ = self.slots.blocks_to_invalidate(key, &mut self.retired);
        // Cannot be full (one entry per slot); if the poller is gone, there
        // is nothing left to free.
        let _ = self.retire.send(key);
        match (outcome, kind) {
            (Outcome::Finished, _) => out.finished_recving.push(id),
            (Outcome::Failed(reason), Some(Kind::Write { .. })) => {
                out.failed_sending.push(FailedSend { id, reason })
            }
            (Outcome::Failed(_), Some(Kind::Lend { .. })) => out.expired.push(id),
            (Outcome::Failed(reason), _) => {
                let start = out.invalid_blocks.len();
                out.invalid_blocks.extend_from_slice(&self.retired);
                out.failed_recving.push(FailedRecv {
                    id,
                    reason,
                    blocks: start..out.invalid_blocks.len(),
                });
            }
            (Outcome::SendDone | Outcome::LendReleased, _) => out.finished_sending.push(id),
            (Outcome::SendExpired | Outcome::LendExpired, _) => out.expired.push(id),
            (Outcome::HandleFailed { .. }, _) => {}
        }
        1
    }

    /// Stops the poller: requests in flight are cancelled (endpoints force-
    /// closed) and reported failed or expired once quiescent — collect them
    /// with a last [`Engine::poll`]. Releases every endpoint, region and
    /// worker. Idempotent.
    pub fn shutdown(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        self.shared.stop.store(true, Ordering::Release);
        let _ = self.control.send(Control::Shutdown);
        self.shared.control_pending.store(true, Ordering::Release);
        self.wake();
        // The poller publishes the reports of what it cancelled before it
        // exits; keep the ring drained so that it never waits on us.
        while !thread.is_finished() {
            while let Some(ev) = self.events.recv() {
                self.parked.push(ev);
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        let _ = thread.join();
        self.regions.clear();
    }
}

// The engine's side of its metrics: `metrics` knows nothing of the engine.

impl Engine {
    /// A snapshot of this engine's counters: the poller's (iterations,
    /// operations, bytes, refused inputs), the ledger's (slots), and what
    /// this engine reported (requests by outcome, handle failures by cause,
    /// submit → report latency by kind).
    pub fn metrics(&self) -> MetricsSnapshot {
        let p = self.poller_stats();
        let l = self.ledger_stats();
        MetricsSnapshot {
            pollers: vec![PollerMetrics {
                busy_ns: p.busy_ns,
                idle_ns: p.idle_ns,
                busy_iterations: p.busy_iterations,
                idle_iterations: p.idle_iterations,
                ops_posted: p.ops_posted,
                ops_completed: p.ops_completed,
                bytes: p.bytes_moved,
                notifications_sent: p.notifications_sent,
                notification_messages: p.notification_messages,
            }],
            requests: self.tally.requests,
            handle_failures: self.tally.handle_failures,
            latency: self.tally.latency,
            rejected: RejectedInputs {
                handle_inputs: l.rejected_inputs,
                malformed_notifications: p.malformed_notifications,
                notifications: l.rejected_notifications,
                not_lent_reads: p.refused_reads,
                not_lent_writes: p.refused_writes,
                heartbeats: l.ignored_heartbeats,
                retires: l.rejected_retires,
                release_retries: l.failed_release_retries,
                unauthenticated_peers: p.unauthenticated_peers,
                unauthenticated_notifications: p.unauthenticated_notifications,
                replayed_notifications: p.replayed_notifications,
            },
            release_failures: l.release_failures,
            slots: SlotUse {
                capacity: u64::from(l.capacity),
                in_use: u64::from(l.in_use),
                quarantined: self.shared.quarantined.load(Ordering::Relaxed),
            },
            rings: vec![
                RingMetrics {
                    ring: "commands".into(),
                    poller: 0,
                    capacity: self.commands.capacity() as u64,
                    occupancy: self.commands.occupancy() as u64,
                    overflowed: 0,
                },
                RingMetrics {
                    ring: "events".into(),
                    poller: 0,
                    capacity: self.events.capacity() as u64,
                    occupancy: self.events.occupancy() as u64,
                    overflowed: self.shared.events_overflowed.load(Ordering::Relaxed),
                },
            ],
        }
    }
}

impl MetricsSnapshot {
    /// Adds what one [`Engine::poll`] reported: requests by outcome and
    /// handle failures by cause.
    pub fn count(&mut self, out: &Outcomes) {
        let r = &mut self.requests;
        r.finished_recving += out.finished_recving.len() as u64;
        r.failed_recving += out.failed_recving.len() as u64;
        r.finished_sending += out.finished_sending.len() as u64;
        r.failed_sending += out.failed_sending.len() as u64;
        r.expired += out.expired.len() as u64;
        for (_, _, reason) in &out.handle_failures {
            *self.handle_failures.of(reason.cause) += 1;
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}
