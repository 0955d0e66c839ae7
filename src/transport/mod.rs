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
pub mod faulty;
pub mod sim;
pub mod simnet;
pub mod ucx;

use crate::core::BlockBytes;
use crate::ledger::{BlockId, HandleKey, PeerId};
use crate::metadata::PeerMetadata;

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
/// `UCS_ERR_UNSUPPORTED`: an operation this transport cannot perform.
pub const UNSUPPORTED: i8 = -22;

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

    /// Forgets a peer: force-closes its endpoint if one is open, and drops
    /// what it knew of it once nothing can use it any more.
    fn forget_peer(&mut self, peer: PeerId);

    /// Posts one operation per block pair and registered region, moving
    /// `block_size` bytes each, all completing with `token`. Returns the
    /// number of operations posted.
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

    /// Flushes endpoint `ep`: completes with `token` once every operation
    /// posted on it before is complete at the target. Fails if `ep` is not
    /// the endpoint's current, open generation.
    fn flush(&mut self, ep: Ep, token: u64) -> Result<(), i8>;

    /// Sends a notification to `ep`'s peer, completing with `token`; with
    /// `want_reply` the receiver can answer it ([`Transport::reply`]) even
    /// if it never added this engine as a peer.
    fn send(&mut self, ep: Ep, payload: &[u8], token: u64, want_reply: bool) -> Result<(), i8>;

    /// Answers a received message (its `reply` handle, before the next
    /// `progress`), completing with `token`.
    fn reply(&mut self, to: u32, payload: &[u8], token: u64) -> Result<(), i8>;

    /// Force-closes endpoint generation `ep` if it is the open one: every
    /// operation outstanding on it completes with [`CANCELED`]. Remote keys
    /// unpacked on it live until the close completed.
    fn close(&mut self, ep: Ep);

    /// Makes progress; returns how much work it did (0: nothing happened).
    fn progress(&mut self) -> u32;

    /// Hands every completion, message and endpoint failure seen since the
    /// last call to `sink`.
    fn drain(&mut self, sink: &mut dyn FnMut(TransportEvent<'_>));

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

    /// Releases what the transport holds for a handle whose operations all
    /// ended; `false` if that failed (the core retries later). UCX frees its
    /// requests in their completion callbacks, so the default cannot fail.
    fn release(&mut self, _handle: HandleKey) -> bool {
        true
    }
}
