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
    /// request's. Or a receive's writer gave up.
    LeaseLost = 10,
    /// A read's lender holds no lend of the incarnation the read named
    /// that covers the blocks it read: blocks of another lend, blocks not
    /// lent at all, or an incarnation the lender never lent (one it can
    /// tell from a lend not submitted yet is refused at once; otherwise
    /// once the grace period, or the read's deadline, ran out). The bytes
    /// read are not that lend's.
    NotLent = 11,
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
            11 => Cause::NotLent,
            _ => return None,
        })
    }
}

/// A transport status: UCX's `ucs_status_t` (one byte; 0 is `UCS_OK`, and
/// what a failure without a transport status carries). Shown with its
/// name and number (`UCS_ERR_CANCELED (-16)`).
///
/// ```
/// use kvpoll::Status;
/// let s = Status::new(-16);
/// assert_eq!((s.name(), s.code()), ("UCS_ERR_CANCELED", -16));
/// assert_eq!(s.to_string(), "UCS_ERR_CANCELED (-16)");
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Status(i8);

/// The names of the `ucs_status_t` values (UCX 1.13), by code.
const STATUS_NAMES: &[(i8, &str)] = &[
    (0, "UCS_OK"),
    (1, "UCS_INPROGRESS"),
    (-1, "UCS_ERR_NO_MESSAGE"),
    (-2, "UCS_ERR_NO_RESOURCE"),
    (-3, "UCS_ERR_IO_ERROR"),
    (-4, "UCS_ERR_NO_MEMORY"),
    (-5, "UCS_ERR_INVALID_PARAM"),
    (-6, "UCS_ERR_UNREACHABLE"),
    (-7, "UCS_ERR_INVALID_ADDR"),
    (-8, "UCS_ERR_NOT_IMPLEMENTED"),
    (-9, "UCS_ERR_MESSAGE_TRUNCATED"),
    (-10, "UCS_ERR_NO_PROGRESS"),
    (-11, "UCS_ERR_BUFFER_TOO_SMALL"),
    (-12, "UCS_ERR_NO_ELEM"),
    (-13, "UCS_ERR_SOME_CONNECTS_FAILED"),
    (-14, "UCS_ERR_NO_DEVICE"),
    (-15, "UCS_ERR_BUSY"),
    (-16, "UCS_ERR_CANCELED"),
    (-17, "UCS_ERR_SHMEM_SEGMENT"),
    (-18, "UCS_ERR_ALREADY_EXISTS"),
    (-19, "UCS_ERR_OUT_OF_RANGE"),
    (-20, "UCS_ERR_TIMED_OUT"),
    (-21, "UCS_ERR_EXCEEDS_LIMIT"),
    (-22, "UCS_ERR_UNSUPPORTED"),
    (-23, "UCS_ERR_REJECTED"),
    (-24, "UCS_ERR_NOT_CONNECTED"),
    (-25, "UCS_ERR_CONNECTION_RESET"),
    (-40, "UCS_ERR_FIRST_LINK_FAILURE"),
    (-59, "UCS_ERR_LAST_LINK_FAILURE"),
    (-60, "UCS_ERR_FIRST_ENDPOINT_FAILURE"),
    (-80, "UCS_ERR_ENDPOINT_TIMEOUT"),
    (-89, "UCS_ERR_LAST_ENDPOINT_FAILURE"),
];

impl Status {
    /// `UCS_OK`: no transport status.
    pub const OK: Status = Status(0);

    /// The status of code `code`.
    pub const fn new(code: i8) -> Self {
        Status(code)
    }

    /// The `ucs_status_t` number.
    pub const fn code(self) -> i8 {
        self.0
    }

    /// The `ucs_status_t` name; a code between two named ones is of UCX's
    /// link (`-40..=-59`) or endpoint (`-60..=-89`) failure ranges, shown
    /// by range; any other is `"unknown"`.
    pub fn name(self) -> &'static str {
        match STATUS_NAMES.iter().find(|(c, _)| *c == self.0) {
            Some((_, name)) => name,
            None if (-59..=-40).contains(&self.0) => "a UCX link failure",
            None if (-89..=-60).contains(&self.0) => "a UCX endpoint failure",
            None => "unknown",
        }
    }

    /// Whether this is `UCS_OK` (no transport status).
    pub const fn is_ok(self) -> bool {
        self.0 == 0
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.name(), self.0)
    }
}

impl std::fmt::Debug for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// A failure: its cause and the transport's status ([`Status::OK`] when
/// there is none).
///
/// ```
/// use kvpoll::{Cause, Reason, Status};
/// let r = Reason::new(Cause::Transfer, -16);
/// assert_eq!(r.status, Status::new(-16));
/// assert_eq!(Reason::unpack(r.pack()), Some(r));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Reason {
    /// What went wrong.
    pub cause: Cause,
    /// The transport's status.
    pub status: Status,
}

impl Reason {
    /// A reason with the transport's status code.
    pub fn new(cause: Cause, status: i8) -> Self {
        Reason {
            cause,
            status: Status(status),
        }
    }
    /// A reason without a status code.
    pub fn of(cause: Cause) -> Self {
        Reason {
            cause,
            status: Status::OK,
        }
    }
    /// Packs in 16 bits, never 0 (so 0 means "no failure yet" in a slot).
    pub fn pack(self) -> u32 {
        u32::from(self.cause as u8) << 8 | u32::from(self.status.0 as u8)
    }
    /// Unpacks [`Reason::pack`]; `None` for 0 or garbage.
    pub fn unpack(v: u32) -> Option<Self> {
        Some(Reason {
            cause: Cause::from_u8((v >> 8) as u8)?,
            status: Status(v as u8 as i8),
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
