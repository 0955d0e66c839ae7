//! What the engine asks the ledger to track.

use super::key::{BlockId, Nanos, PeerId, RequestId};

/// The kind of a request, and what it waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Pull consumer (decode reads): one handle per producer rank; reported
    /// `Finished` when all handles completed, `Failed` (with blocks to
    /// invalidate) when quiescent after any failure or after its deadline.
    Read,
    /// Pull consumer with nothing to read (full prefix-cache hit) whose
    /// engine awaits the request: no handles, reported `Finished` at once.
    PrefixHit,
    /// Pull consumer with nothing to read whose engine does not await it: only
    /// the producer needs a notification (the driver sends it). The ledger
    /// tracks nothing and never reports it.
    NotifyOnly,
    /// Push producer (prefill writes): reported `SendDone` when every handle
    /// completed (puts completed *and* their endpoint flushed) and `acks`
    /// consumer acknowledgements arrived; `SendExpired` at lease expiry
    /// otherwise (never done after a failure).
    Write {
        /// Consumer acknowledgements to wait for (0: none).
        acks: u32,
    },
    /// Pull producer: blocks lent to remote readers; no local handles.
    /// Reported `LendReleased` when `notifications` arrived, `LendExpired` at
    /// lease expiry.
    Lend {
        /// Reader notifications to wait for (at least 1).
        notifications: u32,
    },
    /// Receive: blocks lent to remote writers; no local handles.
    /// Reported `Finished` when `writers` notified that their writes landed,
    /// `Failed` (its blocks to invalidate: they may hold partial data) at
    /// lease expiry, abort or shutdown.
    Receive {
        /// Writer notifications to wait for (at least 1).
        writers: u32,
    },
}

impl Kind {
    /// Whether the request waits for notifications from remote engines.
    pub fn awaits_notifications(self) -> bool {
        matches!(
            self,
            Kind::Write { .. } | Kind::Lend { .. } | Kind::Receive { .. }
        )
    }
}

/// A request to begin tracking.
///
/// Borrowed slices: the ledger copies what it keeps into storage sized at
/// construction, so beginning a request allocates nothing.
///
/// ```
/// use kvpoll::ledger::{BlockId, Kind, Nanos, PeerId, Request, RequestId};
/// let peers = [PeerId(0), PeerId(1)];
/// let blocks = [BlockId(10), BlockId(11)];
/// let r = Request { id: RequestId(1), kind: Kind::Read, peers: &peers, blocks: &blocks, expires: Nanos(1_000_000) };
/// assert_eq!(r.peers.len(), 2);
/// ```
#[derive(Clone, Copy, Debug)]
pub struct Request<'a> {
    /// The engine's id; unique among tracked requests.
    pub id: RequestId,
    /// What kind of request, and what it waits for.
    pub kind: Kind,
    /// One entry per handle: the remote rank the handle transfers with. The
    /// handle's index is its position here.
    pub peers: &'a [PeerId],
    /// The local blocks the request reads into or writes from (invalidated
    /// when a read fails).
    pub blocks: &'a [BlockId],
    /// A read's deadline, a write's or a lend's lease end. Heartbeats extend
    /// leases.
    pub expires: Nanos,
}
