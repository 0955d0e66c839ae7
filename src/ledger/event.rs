//! What the ledger tells its driver: events for the engine, cancellations for
//! the poller.

use super::key::{RequestId, RequestKey};

/// Why a handle or a request failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Cause {
    /// A posted transfer completed with an error (`status` says which; a
    /// forced endpoint close gives `UCS_ERR_CANCELED`).
    Transfer = 1,
    /// The handle failed before any operation was posted.
    Setup = 2,
    /// The handle's peer was lost (endpoint error).
    PeerLost = 3,
    /// The request's deadline passed before it stopped.
    Deadline = 4,
    /// The request's lease expired.
    LeaseExpired = 5,
    /// The engine aborted the request.
    Aborted = 6,
    /// The handle's endpoint was force-closed because the peer was judged
    /// stalled: another request on it passed its deadline or lease.
    PeerStalled = 7,
    /// The engine was shut down while the request was in flight.
    Shutdown = 8,
    /// The poller thread died; nothing more will happen to the request.
    PollerDied = 9,
    /// A read's lender answered that its lend was not live when the data
    /// was read (expired, consumed or unknown): the bytes may be another
    /// request's. Or a push destination's writer gave up.
    LeaseLost = 10,
}

impl Cause {
    pub(crate) fn from_u8(v: u8) -> Option<Cause> {
        Some(match v {
            1 => Cause::Transfer,
            2 => Cause::Setup,
            3 => Cause::PeerLost,
            4 => Cause::Deadline,
            5 => Cause::LeaseExpired,
            6 => Cause::Aborted,
            7 => Cause::PeerStalled,
            8 => Cause::Shutdown,
            9 => Cause::PollerDied,
            10 => Cause::LeaseLost,
            _ => return None,
        })
    }
}

/// A failure: its cause and the transport's raw status code (a one-byte
/// `ucs_status_t`; 0 when there is none).
///
/// ```
/// use kvpoll::ledger::{Cause, Reason};
/// let r = Reason::new(Cause::Transfer, -16);
/// assert_eq!(Reason::unpack(r.pack()), Some(r));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Reason {
    /// What went wrong.
    pub cause: Cause,
    /// The transport's status code.
    pub status: i8,
}

impl Reason {
    /// A reason.
    pub fn new(cause: Cause, status: i8) -> Self {
        Reason { cause, status }
    }
    /// A reason without a status code.
    pub fn of(cause: Cause) -> Self {
        Reason { cause, status: 0 }
    }
    /// Packs in 16 bits, never 0 (so 0 means "no failure yet" in a slot).
    pub fn pack(self) -> u32 {
        u32::from(self.cause as u8) << 8 | u32::from(self.status as u8)
    }
    /// Unpacks [`Reason::pack`]; `None` for 0 or garbage.
    pub fn unpack(v: u32) -> Option<Self> {
        Some(Reason {
            cause: Cause::from_u8((v >> 8) as u8)?,
            status: v as u8 as i8,
        })
    }
}

/// What happened to a request. All but [`Outcome::HandleFailed`] are
/// *terminal*: reported exactly once per request, after which the engine
/// hands the key back to the owner ([`crate::ledger::Ledger::retire`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// A read (or a prefix hit) has all its data.
    Finished,
    /// The request failed and is quiescent: nothing writes into its blocks any
    /// more. For a read, [`crate::ledger::Slots::blocks_to_invalidate`] gives
    /// its local blocks to invalidate.
    Failed(Reason),
    /// A write completed, was flushed, and every expected acknowledgement
    /// arrived: its source blocks are free.
    SendDone,
    /// A write's lease expired before every acknowledgement came: its
    /// source blocks are free; it is never reported done. (A write that
    /// failed is reported [`Outcome::Failed`] with its reason once quiescent.)
    SendExpired,
    /// Every expected reader notified: the lent blocks are free.
    LendReleased,
    /// A lend's lease expired before every reader notified: the blocks are free.
    LendExpired,
    /// Informational, not terminal: one handle failed; the request is reported
    /// when it is quiescent.
    HandleFailed {
        /// The handle's index.
        handle: u8,
        /// Why it failed.
        reason: Reason,
    },
}

impl Outcome {
    /// Whether this is the request's one terminal report.
    pub fn is_terminal(self) -> bool {
        !matches!(self, Outcome::HandleFailed { .. })
    }
}

/// One event for the engine: small and `Copy`, made for the event ring.
///
/// ```
/// use kvpoll::ledger::{Event, Outcome, RequestId, RequestKey};
/// let e = Event { key: RequestKey::new(0, 0), id: RequestId(1), outcome: Outcome::Finished };
/// assert!(e.outcome.is_terminal());
/// assert!(std::mem::size_of::<Event>() <= 24);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Event {
    /// The request's key: retire it after a terminal outcome.
    pub key: RequestKey,
    /// The engine's request id.
    pub id: RequestId,
    /// What happened.
    pub outcome: Outcome,
}

/// What the driver must do for a request that hit its deadline, its lease or
/// an abort while operations were in flight: force-close the endpoints of
/// these handles (UCX then completes each outstanding operation with
/// `UCS_ERR_CANCELED`, which the driver reports as usual).
///
/// Handles that were not yet posted have already been stopped by the ledger:
/// any later attempt to post them is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cancel {
    /// The request.
    pub key: RequestKey,
    /// Bitmap of the handles still in flight.
    pub handles: u64,
}
