//! Transports: what the poller drives on behalf of the protocol core.
//!
//! The [`crate::core`] decides *what* to do (post these blocks on this
//! endpoint, flush it, send this notification, force-close it); a
//! [`Transport`] does it. Two implement the trait: [`ucx`] (the real one)
//! and [`sim`] (a deterministic simulator with memory, pauses and faults).
//! Both speak `u64` tokens: every posted operation completes, once, with the
//! token it was posted with.
//!
//! Endpoints are named by [`Ep`]: a peer and a *generation*. The core bumps
//! a peer's generation when it force-closes its endpoint; a transport opens
//! a fresh endpoint the first time it sees a newer generation, and refuses
//! (with [`CANCELED`]) any operation aimed at an older one. That is how a
//! flush is kept on the endpoint its puts travelled on.

#[cfg(feature = "fault-injection")]
#[doc(hidden)]
pub mod faulty;
pub mod peer;
#[doc(hidden)]
pub mod sim;
#[doc(hidden)]
pub mod simnet;
pub mod ucx;

use std::sync::atomic::{AtomicU64, Ordering};

use crate::ledger::{BlockId, HandleKey, Incarnation, Nanos, PeerId};
use peer::PeerMetadata;

/// The token kind a transport uses for operations of its own (closes):
/// the top two bits of the 32-bit kind field set. Tokens the core posts
/// never carry it, and the core never sees these completions.
pub const T_TRANSPORT: u64 = 3 << 30;
/// The token kind the core gives a read's lend word check (a read has no
/// flush, so it shares that kind); a transport tells word completions by it.
pub const T_WORD: u64 = 1 << 30;

/// The part of each block a handle moves: `len` bytes at `local_offset`
/// in each local block, to or from `remote_offset` in each remote block
/// (which may be of another size than the local one: the peer's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockBytes {
    /// Offset in each local block.
    pub local_offset: u64,
    /// Offset in each remote block.
    pub remote_offset: u64,
    /// Bytes moved per block pair; never 0.
    pub len: u64,
}

/// `UCS_ERR_IO_ERROR`.
pub const IO_ERROR: i8 = -3;
/// `UCS_ERR_UNREACHABLE`.
pub const UNREACHABLE: i8 = -6;
/// `UCS_ERR_CANCELED`: what a forced endpoint close completes operations
/// with, and what an operation aimed at a closed endpoint generation gets.
pub const CANCELED: i8 = -16;
/// `UCS_ERR_ENDPOINT_TIMEOUT`: what a lost peer fails operations with.
pub const ENDPOINT_TIMEOUT: i8 = -80;
/// `UCS_ERR_INVALID_PARAM`: an operation refused before the transport saw it.
pub const INVALID_PARAM: i8 = -5;
/// `UCS_ERR_NO_RESOURCE`: a lend word read refused for want of a landing
/// cell (the reader asks its lender instead).
pub const NO_RESOURCE: i8 = -2;
/// `UCS_ERR_UNSUPPORTED`: an operation this transport cannot perform, or
/// a peer that announced no lend words.
pub const UNSUPPORTED: i8 = -22;
/// `UCS_ERR_REJECTED`: a read its lender refused to serve because the
/// blocks it asked for are not those of the live lend it named
/// ([`TransportEvent::ReadAsked`]); the read fails `Cause::NotLent`.
pub const NOT_LENT: i8 = -23;

/// Most lend words an engine announces (a peer announcing more is
/// refused); a power of two.
pub const MAX_LEND_WORDS: usize = 1 << 20;

/// The word of `len` lend words (a power of two) that incarnation `inc`
/// lives in while lent: its top bits after a multiplicative hash, so that
/// the reader, knowing only the incarnation and the lender's word count,
/// finds the same word the lender wrote. Two live lends may hash to the
/// same word; the second gets none, and its readers ask (the word is a
/// fast path, the full 64-bit compare decides).
pub fn lend_word_of(inc: Incarnation, len: usize) -> Option<usize> {
    if len == 0 || !len.is_power_of_two() {
        return None;
    }
    let bits = len.trailing_zeros();
    if bits == 0 {
        return Some(0);
    }
    Some((inc.0.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - bits)) as usize)
}

/// An engine's lend words: registered memory its readers read one-sidedly
/// (`Transport::read_word`), one 64-bit word per slot, each holding the
/// incarnation of the live lend that owns it or 0. The lender's core
/// writes a lend's incarnation into its word when the lend begins and
/// overwrites it (with 0) before the lend's end is published to the
/// engine: a reader that reads the incarnation back after its data landed
/// knows the lend had not ended, so its blocks were not reused, when the
/// data was read (docs/design.md §2, rule 5).
///
/// The memory belongs to `owner`, kept alive by every clone; whoever makes
/// the words zeroes them when the last clone goes (see the constructors).
#[derive(Clone)]
pub struct LendWords {
    base: std::ptr::NonNull<AtomicU64>,
    len: usize,
    _owner: std::rc::Rc<dyn std::any::Any>,
}

impl std::fmt::Debug for LendWords {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LendWords").field("len", &self.len).finish()
    }
}

impl LendWords {
    /// Words over `len` 64-bit words at `base`, owned by `owner`.
    ///
    /// # Safety
    /// `base` must be 8-byte aligned and `base..base + 8 * len` valid for
    /// reads and writes for as long as `owner` lives; this process touches
    /// it only through these words (others may read it: remote readers,
    /// the transport serving them). `len` must be a power of two.
    pub unsafe fn new(base: *mut u64, len: usize, owner: std::rc::Rc<dyn std::any::Any>) -> Self {
        debug_assert!(len.is_power_of_two() && base as usize % 8 == 0);
        LendWords {
            // SAFETY: the caller's promise: valid, hence not null.
            base: unsafe { std::ptr::NonNull::new_unchecked(base as *mut AtomicU64) },
            len,
            _owner: owner,
        }
    }

    /// `len` words on the heap (the simulator's; a power of two).
    pub fn heap(len: usize) -> Self {
        let len = len.next_power_of_two();
        let words: std::rc::Rc<Box<[AtomicU64]>> =
            std::rc::Rc::new((0..len).map(|_| AtomicU64::new(0)).collect());
        let base = words.as_ptr() as *mut u64;
        // SAFETY: the boxed slice is aligned, `len` words long and lives as
        // long as the owner handed over with it.
        unsafe { Self::new(base, len, words) }
    }

    /// Words in the table.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the table has no word.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        assert!(i < self.len, "lend word {i} of {}", self.len);
        // SAFETY: in bounds (checked); valid while `_owner` lives (new's
        // contract), and self holds it.
        unsafe { &*self.base.as_ptr().add(i) }
    }

    /// The value of word `i`.
    pub fn get(&self, i: usize) -> u64 {
        self.word(i).load(Ordering::Acquire)
    }

    /// Writes word `i`. A single 64-bit store: a remote reader sees the old
    /// value or the new one, and one that sees the old one read it before
    /// the store (the order that matters: before the lend's end is
    /// published, which follows the store).
    pub fn set(&self, i: usize, value: u64) {
        self.word(i).store(value, Ordering::SeqCst);
    }

    /// Zeroes every word (their owner is going away, or the engine is).
    pub fn clear_all(&self) {
        for i in 0..self.len {
            self.set(i, 0);
        }
    }
}

/// One endpoint: a peer, and which of its successive connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ep {
    /// The peer.
    pub peer: PeerId,
    /// Bumped at every forced close: a new generation is a new connection.
    pub generation: u32,
}

impl Ep {
    /// Packs the endpoint into the `u64` id a transport reports failures with.
    pub fn to_u64(self) -> u64 {
        u64::from(self.peer.0) << 32 | u64::from(self.generation)
    }

    /// Unpacks [`Ep::to_u64`].
    pub fn from_u64(v: u64) -> Self {
        Ep {
            peer: PeerId((v >> 32) as u32),
            generation: v as u32,
        }
    }
}

/// Which way a batch of block operations moves data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Remote → local (pull).
    Get,
    /// Local → remote (push).
    Put,
}

/// A post that did not go through whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PostFailure {
    /// Operations that were posted before the failure (each completes with
    /// the token as usual).
    pub posted: u32,
    /// Why the rest was not posted (a one-byte `ucs_status_t`).
    pub status: i8,
}

/// Something a transport saw, handed to the core by the driver.
#[derive(Debug, Clone, Copy)]
pub enum TransportEvent<'a> {
    /// An operation ended: the token it was posted with, and its status
    /// (0 for success).
    Completion {
        /// The token.
        token: u64,
        /// `0`, or why it failed.
        status: i8,
    },
    /// A notification arrived (the payload is unchecked outside bytes).
    Message {
        /// The payload.
        payload: &'a [u8],
        /// Where an answer goes ([`Transport::reply`]), if the sender asked
        /// for one: valid until the transport's next `progress`.
        reply: Option<u32>,
    },
    /// A lend word read ([`Transport::read_word`]) ended: its token, its
    /// status (0 for success) and, on success, the word read.
    Word {
        /// The token.
        token: u64,
        /// `0`, or why it failed.
        status: i8,
        /// The word (0 unless `status` is 0).
        word: u64,
    },
    /// A peer asks this engine to serve a read itself (a transport whose
    /// reads are messages the lender answers): blocks `first..=last` of
    /// region `region`, under lend `lend`. The core answers with
    /// [`Transport::serve_read`] before the transport's next `progress`:
    /// served if those blocks are the lend's or the lend is not one it
    /// knows (the read's confirmation decides then), refused otherwise.
    ReadAsked {
        /// The transport's handle for the request.
        request: u32,
        /// The lend the reader named.
        lend: Incarnation,
        /// The first block the bytes lie in.
        first: BlockId,
        /// The last block the bytes lie in.
        last: BlockId,
    },
    /// An endpoint failed (peer gone, link down).
    EndpointFailed {
        /// Which endpoint.
        ep: Ep,
        /// Why.
        status: i8,
    },
}

/// What the poller drives. Every method is called from the poller thread
/// only; none blocks.
pub trait Transport {
    /// Learns a peer from its metadata (already checked by the engine).
    fn add_peer(&mut self, peer: PeerId, meta: &PeerMetadata) -> Result<(), i8>;

    /// Forgets a peer: closes its endpoint if one is open (gracefully with
    /// `drain`, letting what is in flight finish; forced otherwise), and
    /// drops what it knew of it once nothing can use it any more.
    fn forget_peer(&mut self, peer: PeerId, drain: bool);

    /// Posts operations moving every block pair in every registered
    /// region, `block_size` bytes each, all completing with `token`: one
    /// per pair and region, or one per run of pairs that are consecutive on
    /// both sides (local `l, l+1, …` with remote `r, r+1, …`) and region,
    /// as the transport chooses. Returns the number of operations posted
    /// (the completions to expect).
    fn post(
        &mut self,
        ep: Ep,
        dir: Direction,
        pairs: &[(BlockId, BlockId)],
        token: u64,
    ) -> Result<u32, PostFailure>;

    /// [`Transport::post`] moving `part` of each block pair instead of
    /// whole blocks: `part.len` bytes from `part.local_offset` in each
    /// local block and `part.remote_offset` in each remote block, whose
    /// size is the peer's. A transport that cannot address parts of
    /// blocks posts nothing and fails.
    fn post_part(
        &mut self,
        ep: Ep,
        dir: Direction,
        pairs: &[(BlockId, BlockId)],
        part: BlockBytes,
        token: u64,
    ) -> Result<u32, PostFailure> {
        let _ = (ep, dir, pairs, part, token);
        Err(PostFailure {
            posted: 0,
            status: UNSUPPORTED,
        })
    }

    /// [`Transport::post`] (or, with `part`, [`Transport::post_part`]) of
    /// a handle that moves blocks of lend (or receive) `lend`: a
    /// transport whose lender serves reads itself sends it along, so that
    /// the lender checks the blocks before any byte leaves.
    fn post_lent(
        &mut self,
        ep: Ep,
        dir: Direction,
        pairs: &[(BlockId, BlockId)],
        part: Option<BlockBytes>,
        lend: Incarnation,
        token: u64,
    ) -> Result<u32, PostFailure> {
        let _ = lend;
        self.post_whole_or_part(ep, dir, pairs, part, token)
    }

    /// [`Transport::post`] of whole blocks, or with `part`,
    /// [`Transport::post_part`].
    fn post_whole_or_part(
        &mut self,
        ep: Ep,
        dir: Direction,
        pairs: &[(BlockId, BlockId)],
        part: Option<BlockBytes>,
        token: u64,
    ) -> Result<u32, PostFailure> {
        match part {
            None => self.post(ep, dir, pairs, token),
            Some(part) => self.post_part(ep, dir, pairs, part, token),
        }
    }

    /// Serves (`lent`) or refuses ([`NOT_LENT`]) the read of a
    /// [`TransportEvent::ReadAsked`].
    fn serve_read(&mut self, request: u32, lent: bool) {
        let _ = (request, lent);
    }

    /// Flushes endpoint `ep`: completes with `token` once every operation
    /// posted on it before is complete at the target. Fails if `ep` is not
    /// the endpoint's current, open generation.
    fn flush(&mut self, ep: Ep, token: u64) -> Result<(), i8>;

    /// Sends a notification to `ep`'s peer, completing with `token`; with
    /// `want_reply` the receiver can answer it ([`Transport::reply`]) even
    /// if it never added this engine as a peer.
    fn send(&mut self, ep: Ep, payload: &[u8], token: u64, want_reply: bool) -> Result<(), i8>;

    /// Answers a received message (its `reply` handle, before the next
    /// `progress`), completing with `token`. Over UCX the handle's endpoint
    /// can already be gone if the peer failed in the progress that brought
    /// the message (docs/design.md §4).
    fn reply(&mut self, to: u32, payload: &[u8], token: u64) -> Result<(), i8>;

    /// Reads, one-sidedly where the transport can, the lend word of `ep`'s
    /// peer that incarnation `inc` lives in ([`lend_word_of`] over the
    /// peer's announced words); ends with a [`TransportEvent::Word`] of
    /// `token`. Called only after every data operation whose validity it
    /// decides completed, so no ordering between them is assumed of the
    /// transport. `Err`: not posted (the peer has no words, no landing
    /// cell is free, the endpoint is closed).
    fn read_word(&mut self, ep: Ep, inc: Incarnation, token: u64) -> Result<(), i8>;

    /// This engine's own lend words, which its core writes (`None`: the
    /// transport announces none, and readers of its lends ask).
    fn lend_words(&self) -> Option<LendWords> {
        None
    }

    /// Force-closes endpoint generation `ep` if it is the open one: every
    /// operation outstanding on it completes with [`CANCELED`]. Remote keys
    /// unpacked on it live until the close completed.
    fn close(&mut self, ep: Ep);

    /// Makes progress; returns how much work it did (0: nothing happened).
    fn progress(&mut self) -> u32;

    /// Hands every completion, message and endpoint failure seen since the
    /// last call to `sink`.
    fn drain(&mut self, sink: &mut dyn FnMut(TransportEvent<'_>));

    /// Whether a [`Transport::drain`] would hand something over now,
    /// without progress: what the actions of the last drain completed as
    /// they were posted (a lend word loaded from a mapping, a read of a
    /// connection already lost). The driver drains again while it does, so
    /// that a read's confirmation follows its data within one turn rather
    /// than after the next turn's progress (and whatever copies that does).
    fn ready(&self) -> bool {
        false
    }

    /// Whether operations the transport itself posted (closes) are still
    /// outstanding; shutdown waits for them.
    fn closing(&self) -> bool;

    /// A file descriptor that becomes readable when the transport has new
    /// events (after [`Transport::arm`]), so that an idle poller can block
    /// on it instead of napping on a timer. `None` (the default): the
    /// transport cannot wake anyone; the poller naps with a short timeout.
    fn wait_fd(&mut self) -> Option<std::os::fd::RawFd> {
        None
    }

    /// Arms [`Transport::wait_fd`] for the next event. `true`: armed, the
    /// poller may block on it. `false`: events are pending (or there is no
    /// fd): progress first, do not block.
    fn arm(&mut self) -> bool {
        false
    }

    /// Whether the transport still receives messages, checked now and
    /// then by the poller with its clock: `false` once it found that it
    /// never will again (UCX: a shared-memory receive queue that a peer
    /// killed inside its send left stopped; see `ucx`'s probe). Sticky.
    /// The default (a transport that cannot tell) always hears.
    fn hearing(&mut self, _now: Nanos) -> bool {
        true
    }

    /// Releases what the transport holds for a handle whose operations all
    /// ended; `false` if that failed (the core retries later). UCX frees its
    /// requests in their completion callbacks, so the default cannot fail.
    fn release(&mut self, _handle: HandleKey) -> bool {
        true
    }
}
