//! Typed errors: each names the input that was wrong. A refused input never
//! changes the state of any request.

use super::key::{HandleKey, RequestId, RequestKey, MAX_HANDLES, MAX_SLOTS};
use super::request::Kind;

/// The ledger could not be built.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// `slots` must be in `1..=MAX_SLOTS`.
    #[error("ledger slots must be between 1 and {MAX_SLOTS}, got {0}")]
    Slots(u32),
    /// `max_blocks` must be at least 1.
    #[error("ledger max_blocks per request must be at least 1")]
    MaxBlocks,
}

/// A request was refused at [`crate::ledger::Ledger::begin`]; nothing changed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BeginError {
    /// A request with this id is tracked already (possibly finished but not
    /// yet retired by the engine).
    #[error("request {0:?} is already tracked: request ids must be unique")]
    Duplicate(RequestId),
    /// More handles than fit in a request's bitmaps.
    #[error("request has {given} handles; at most {MAX_HANDLES} fit: split it")]
    TooManyHandles {
        /// Handles given.
        given: usize,
    },
    /// More local blocks than the ledger was sized for.
    #[error("request has {given} local blocks; this ledger holds at most {max} per request")]
    TooManyBlocks {
        /// Blocks given.
        given: usize,
        /// The ledger's `max_blocks`.
        max: u32,
    },
    /// A read or write with no handle: nothing would ever complete it. (A read
    /// with nothing to read is a `PrefixHit` or `NotifyOnly`.)
    #[error("{0:?} request has no handles: use PrefixHit/NotifyOnly for nothing to read")]
    EmptyPlan(Kind),
    /// A kind without local transfers (prefix hit, notify-only, lend) was
    /// given handles.
    #[error("{0:?} request takes no handles")]
    UnexpectedHandles(Kind),
    /// A lend waiting for zero notifications would be released before any
    /// reader read.
    #[error("lend must wait for at least one notification")]
    NothingToAwait,
    /// Every slot is in use: retire finished requests or size the ledger up.
    #[error("all {capacity} ledger slots are in use")]
    Full {
        /// The ledger's slot count.
        capacity: u32,
    },
}

/// A handle input was refused; nothing changed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum InputError {
    /// The request ended and was retired (the slot may hold another request
    /// now), or the key was never issued.
    #[error("{0:?} is stale: its request was retired")]
    Stale(RequestKey),
    /// The request has no such handle.
    #[error("{0:?} is not a handle of its request")]
    NoSuchHandle(HandleKey),
    /// Posting a handle twice.
    #[error("{0:?} was already posted")]
    AlreadyPosted(HandleKey),
    /// The request is being cancelled (deadline, lease, abort or peer loss):
    /// do not post this handle; the ledger stopped it already.
    #[error("{0:?} was cancelled before it was posted: do not post it")]
    Cancelled(HandleKey),
    /// A completion for a handle that was never posted.
    #[error("{0:?} completed but was never posted")]
    NotPosted(HandleKey),
    /// A second completion (or setup failure) for one handle.
    #[error("{0:?} has already ended")]
    AlreadyEnded(HandleKey),
    /// A release retry for a handle whose release did not fail.
    #[error("{0:?} holds no failed release")]
    NotHeld(HandleKey),
}

/// A consumer notification was rejected and dropped (and counted).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NotifyError {
    /// No live write or lend has this id (unknown, already reported, or its
    /// lease expired).
    #[error("notification for {0:?}, which no live write or lend has")]
    UnknownRequest(RequestId),
    /// The request is a read: it awaits no notifications.
    #[error("notification for {0:?}, a read, which awaits none")]
    NotAwaited(RequestId),
    /// A notification must count at least one reader.
    #[error("notification for {0:?} with a count of 0")]
    ZeroCount(RequestId),
}

/// An abort was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AbortError {
    /// No live request has this id (unknown, or already reported).
    #[error("abort of {0:?}, which no live request has")]
    UnknownRequest(RequestId),
}

/// A retire (or a read of blocks to invalidate) was refused; nothing
/// changed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RetireError {
    /// The key is not the slot's current request (retired twice, or never
    /// issued).
    #[error("{0:?} is stale: already retired")]
    Stale(RequestKey),
    /// The request has not been reported yet: only a terminal event's key can
    /// be retired.
    #[error("{0:?} has not been reported yet")]
    NotReported(RequestKey),
}
