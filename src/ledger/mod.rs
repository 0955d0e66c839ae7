//! The request ledger: lock-free handle accounting with deferred failure and
//! exactly-once reports.
//!
//! A sans-IO state machine (in the manner of `quinn-proto`): it never reads a
//! clock and never does I/O. Its driver (the poller) feeds it inputs —
//! requests, handle progress, notifications, the current time — and it hands
//! back [`Event`]s for the engine and [`Cancel`]s for the driver.
//!
//! # Shape
//!
//! - [`Slots`] is a slab of request slots fixed at construction, made only of
//!   atomics and shared (`Arc`) by every poller and the engine thread. Handle
//!   inputs ([`Slots::posting`], [`Slots::setup_failed`],
//!   [`Slots::completed`], [`Slots::release_failed`],
//!   [`Slots::release_retried`]) take `&self` and may come from any poller;
//!   the engine thread reads a failed read's blocks with
//!   [`Slots::blocks_to_invalidate`].
//! - [`Ledger`] is the owner's half, held by one poller: it begins requests,
//!   maps request ids to slots, and takes the inputs that need that map or
//!   the time ([`Ledger::notify`], [`Ledger::heartbeat`], [`Ledger::abort`],
//!   [`Ledger::advance`], [`Ledger::peer_lost`]), and retires reported
//!   requests ([`Ledger::retire`]) when the engine hands their keys back.
//!   Only it frees and takes slots, so a slot is never reused under the feet
//!   of an owner input, and the engine thread writes nothing in the slab.
//!
//! A slot holds: a *state word* (generation, phase, kind, cancel cause,
//! outcome); `planned`, `stopped` and `failed` bitmaps (one bit a handle, up
//! to 64); one *claim word* per handle (generation and step: planned, posted,
//! held, stopped, stopped-unposted); the first failure's [`Reason`];
//! notification counts; and the request's local block ids, in storage sized at
//! construction (`max_blocks` per slot). Beginning a request allocates nothing.
//!
//! # Exactly once
//!
//! - Each handle step is one CAS on the handle's claim word, which includes
//!   the generation: a duplicate input finds the step taken, and a stale one
//!   (an old generation) matches nothing. So each handle stops once, and a
//!   [`RequestKey`] that outlived its request can never touch the slot's next
//!   request.
//! - A handle's failed bit and the request's reason are written *before* its
//!   bit in `stopped` (`fetch_or`, AcqRel). Exactly one `fetch_or` turns
//!   `stopped` into `planned`; that thread has acquired every earlier stop, so
//!   it sees every failure.
//! - The report is published by a CAS of the state word from LIVE or
//!   CANCELLING to TERMINAL. Every input that may complete a condition (the
//!   last stop, a notification, a cancel, a lease) tries it; a CAS succeeds
//!   once per generation. Where two conditions are completed by two threads
//!   (the last stop of a write and its last acknowledgement), each completes
//!   its own with a RMW and reads the other's with a RMW (`fetch_or(0)`), which
//!   reads the latest value: at least one of them sees both.
//! - The slot is freed only by [`Ledger::retire`], after the engine consumed
//!   the terminal event, read a failed read's blocks to invalidate, and
//!   handed the key back. So the blocks cannot be overwritten by a new
//!   request before the engine has them, and the generation changes only
//!   then. Freed slots are reused oldest first.
//!
//! # Deferred failure and cancellation
//!
//! A failure is recorded at once (and announced with an
//! [`Outcome::HandleFailed`] notice) but the request is reported only when
//! quiescent: every planned handle stopped. A handle whose release failed is
//! *held*: ended but not stopped, until a retry releases it. At a deadline,
//! a lease expiry or an abort the request turns CANCELLING: handles not yet
//! posted are stopped by the ledger (a later `posting` of them is refused with
//! [`InputError::Cancelled`]) and the handles still in flight are returned as
//! a [`Cancel`]: the driver force-closes their endpoints, UCX completes them
//! with `UCS_ERR_CANCELED`, and the last completion publishes the failure.
//!
//! # Example
//!
//! ```
//! use kvpoll::ledger::*;
//!
//! let mut ledger = Ledger::new(LedgerConfig { slots: 8, max_blocks: 4 }).unwrap();
//! let slots = ledger.slots().clone();
//! let mut events = Vec::new();
//! let peers = [PeerId(0), PeerId(1)];
//! let blocks = [BlockId(7)];
//! let req = Request { id: RequestId(1), kind: Kind::Read, peers: &peers, blocks: &blocks, expires: Nanos(1_000) };
//! let key = match ledger.begin(&req, &mut |e| events.push(e)).unwrap() {
//!     Begun::Tracked(key) => key,
//!     Begun::Untracked => unreachable!(),
//! };
//! let (h0, h1) = (HandleKey::new(key, 0).unwrap(), HandleKey::new(key, 1).unwrap());
//! slots.posting(h0).unwrap();
//! slots.posting(h1).unwrap();
//! let err = Err(Reason::new(Cause::Transfer, -25));
//! slots.completed(h0, err, &mut |e| events.push(e)).unwrap(); // notice only
//! assert!(events.iter().all(|e| !e.outcome.is_terminal()));
//! slots.completed(h1, err, &mut |e| events.push(e)).unwrap(); // quiescent: reported
//! let last = *events.last().unwrap();
//! assert!(matches!(last.outcome, Outcome::Failed(_)));
//! // The engine thread: take the blocks to invalidate, hand the key back.
//! let mut invalid = Vec::new();
//! slots.blocks_to_invalidate(last.key, &mut invalid).unwrap();
//! assert_eq!(invalid, [BlockId(7)]);
//! ledger.retire(last.key).unwrap();
//! assert_eq!(ledger.stats().in_use, 0);
//! ```

#![warn(missing_docs)]

mod error;
mod event;
mod index;
mod key;
mod request;
mod slots;

use std::collections::VecDeque;

use arrayvec::ArrayVec;

pub use error::{AbortError, BeginError, ConfigError, InputError, NotifyError, RetireError};
pub use event::{Cancel, Cause, Event, Outcome, Reason, Status};
pub use key::{
    BlockId, HandleKey, Incarnation, Nanos, PeerId, RequestId, RequestKey, MAX_HANDLES, MAX_SLOTS,
};
pub use request::{Kind, Request};
pub(crate) use slots::bits;
pub use slots::{Phase, SlotView, Slots, Stats};

pub(crate) use index::IdHasher;
use index::IdIndex;
use slots::{Cancelled, State, CANCELLING, FREE, K_LEND, K_READ, K_RECEIVE, K_WRITE, LIVE};

use std::sync::Arc;

/// Sizes of a ledger, fixed at construction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LedgerConfig {
    /// Request slots: live requests plus reported ones the engine has not
    /// retired yet. At most [`MAX_SLOTS`].
    pub slots: u32,
    /// The most local blocks one request may name (memory: 4 bytes × slots ×
    /// max_blocks). More is refused with [`BeginError::TooManyBlocks`].
    pub max_blocks: u32,
}

impl Default for LedgerConfig {
    /// 1024 slots of up to 512 blocks (2 MiB of block ids).
    fn default() -> Self {
        LedgerConfig {
            slots: 1024,
            max_blocks: 512,
        }
    }
}

/// What [`Ledger::begin`] did with a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Begun {
    /// Tracked under this key: post its handles (claiming each with
    /// [`Slots::posting`]).
    Tracked(RequestKey),
    /// A [`Kind::NotifyOnly`] request: nothing tracked, nothing will be
    /// reported; the driver only sends the producer its notification.
    Untracked,
}

/// What the owner keeps of each slot, outside the shared atomics.
struct Owned {
    id: Option<RequestId>,
    peers: ArrayVec<PeerId, MAX_HANDLES>,
    expires: Nanos,
}

/// The owner's half of the ledger: begins requests and takes the inputs
/// keyed by request id or by time. Held by one poller (`&mut self`).
pub struct Ledger {
    slots: Arc<Slots>,
    index: IdIndex,
    owned: Vec<Owned>,
    /// Free slots, oldest retired first: a retired slot is reused as late
    /// as possible, so a stale key meets a new generation late, not soon.
    free: VecDeque<u32>,
    /// No live request expires before this (a lower bound: `advance` skips
    /// its scan until then).
    next_expiry: Nanos,
}

impl Ledger {
    /// A ledger with every slot, index entry and block-id cell allocated now.
    pub fn new(config: LedgerConfig) -> Result<Self, ConfigError> {
        if config.slots == 0 || config.slots > MAX_SLOTS {
            return Err(ConfigError::Slots(config.slots));
        }
        if config.max_blocks == 0 {
            return Err(ConfigError::MaxBlocks);
        }
        Ok(Ledger {
            slots: Arc::new(Slots::new(config.slots, config.max_blocks)),
            index: index::with_slots(config.slots),
            owned: (0..config.slots)
                .map(|_| Owned {
                    id: None,
                    peers: ArrayVec::new(),
                    expires: Nanos(u64::MAX),
                })
                .collect(),
            free: (0..config.slots).collect(),
            next_expiry: Nanos(u64::MAX),
        })
    }

    /// The shared slots: clone the `Arc` into pollers and the engine thread.
    pub fn slots(&self) -> &Arc<Slots> {
        &self.slots
    }

    /// Begins tracking `req`. Refused requests change nothing. Claim each
    /// handle with [`Slots::posting`] before posting it.
    ///
    /// A [`Kind::PrefixHit`] is reported `Finished` through `out` at once.
    pub fn begin(
        &mut self,
        req: &Request<'_>,
        out: &mut impl FnMut(Event),
    ) -> Result<Begun, BeginError> {
        self.start(req, false, out)
    }

    /// [`Ledger::begin`], with every handle already claimed for posting (as
    /// if [`Slots::posting`] had succeeded for each): for the usual driver,
    /// which posts all of a request's handles at once. A handle it then
    /// cannot post is reported with [`Slots::setup_failed`].
    pub fn begin_posting(
        &mut self,
        req: &Request<'_>,
        out: &mut impl FnMut(Event),
    ) -> Result<Begun, BeginError> {
        self.start(req, true, out)
    }

    fn start(
        &mut self,
        req: &Request<'_>,
        posting: bool,
        out: &mut impl FnMut(Event),
    ) -> Result<Begun, BeginError> {
        let n = req.peers.len();
        if n > MAX_HANDLES {
            return Err(BeginError::TooManyHandles { given: n });
        }
        if req.blocks.len() > self.slots.max_blocks() as usize {
            return Err(BeginError::TooManyBlocks {
                given: req.blocks.len(),
                max: self.slots.max_blocks(),
            });
        }
        let expected = match req.kind {
            Kind::Read | Kind::Write { .. } if n == 0 => {
                return Err(BeginError::EmptyPlan(req.kind))
            }
            Kind::PrefixHit | Kind::NotifyOnly | Kind::Lend { .. } | Kind::Receive { .. }
                if n != 0 =>
            {
                return Err(BeginError::UnexpectedHandles(req.kind))
            }
            Kind::Lend { notifications: 0 } | Kind::Receive { writers: 0 } => {
                return Err(BeginError::NothingToAwait)
            }
            Kind::NotifyOnly => return Ok(Begun::Untracked),
            Kind::Read | Kind::PrefixHit => 0,
            Kind::Write { acks } => acks,
            Kind::Lend { notifications } => notifications,
            Kind::Receive { writers } => writers,
        };
        if self.lookup(req.id).is_some() {
            return Err(BeginError::Duplicate(req.id));
        }
        let Some(slot) = self.free.pop_front() else {
            return Err(BeginError::Full {
                capacity: self.slots.capacity(),
            });
        };
        let owned = &mut self.owned[slot as usize];
        if let Some(old) = owned.id.take() {
            if self.index.get(&old) == Some(&slot) {
                self.index.remove(&old);
            }
        }
        owned.id = Some(req.id);
        owned.peers.clear();
        // Cannot fail: n <= MAX_HANDLES was checked above.
        owned.peers.extend(req.peers.iter().copied());
        owned.expires = req.expires;
        self.next_expiry = self.next_expiry.min(req.expires);
        self.index.insert(req.id, slot);
        let key = self.slots.init(
            slot,
            req.id,
            Slots::kind_code(req.kind),
            n,
            expected,
            req.blocks,
            posting,
        );
        if n == 0 {
            // Nothing to transfer: a prefix hit reports at once; a lend waits
            // for its notifications (publish declines).
            self.slots.publish(key, out);
        }
        Ok(Begun::Tracked(key))
    }

    /// The slot and state of a tracked (or reported, unretired) request.
    fn lookup(&self, id: RequestId) -> Option<(u32, State)> {
        let slot = *self.index.get(&id)?;
        let st = self.slots.state(slot);
        (st.phase() != FREE).then_some((slot, st))
    }

    /// The key of request `id`, if it is tracked or reported and not yet
    /// retired.
    pub fn key(&self, id: RequestId) -> Option<RequestKey> {
        self.lookup(id)
            .map(|(slot, st)| RequestKey::new(slot, st.generation()))
    }

    /// The peer of handle `hk`, if its request is tracked.
    pub fn peer(&self, hk: HandleKey) -> Option<PeerId> {
        let st = self.slots.state(hk.key().slot());
        if st.generation() != hk.key().generation() || st.phase() == FREE {
            return None;
        }
        self.owned
            .get(hk.key().slot() as usize)?
            .peers
            .get(usize::from(hk.handle()))
            .copied()
    }

    /// `count` consumer notifications for request `id` (acknowledgements of a
    /// write, reader notifications of a lend). Several consumer ranks may
    /// notify one request. Unknown, reported or expired ids are rejected,
    /// counted and dropped.
    pub fn notify(
        &mut self,
        id: RequestId,
        count: u32,
        out: &mut impl FnMut(Event),
    ) -> Result<(), NotifyError> {
        let refused = match self.lookup(id) {
            _ if count == 0 => NotifyError::ZeroCount(id),
            None => NotifyError::UnknownRequest(id),
            Some((_, st)) if !awaits(st.kind()) => NotifyError::NotAwaited(id),
            Some((_, st)) if st.phase() != LIVE => NotifyError::UnknownRequest(id),
            Some((slot, st)) => {
                self.slots
                    .add_acks(RequestKey::new(slot, st.generation()), count, out);
                return Ok(());
            }
        };
        self.slots.count_rejected_notification();
        Err(refused)
    }

    /// Request `key` (tracked, just begun, before any of its handles was
    /// posted) waits for `n` notifications besides its handles: a read, for
    /// the confirmations of its lenders.
    pub fn expect(&mut self, key: RequestKey, n: u32) {
        if self.is_live(key) {
            self.slots.set_expected(key, n);
        }
    }

    /// Whether `key`'s request is tracked and not yet being cancelled or
    /// reported.
    pub fn is_live(&self, key: RequestKey) -> bool {
        let st = self.slots.state(key.slot());
        st.generation() == key.generation() && st.phase() == LIVE
    }

    /// Whether live read `key` has all its handles stopped, none failed.
    pub fn all_stopped_clean(&self, key: RequestKey) -> bool {
        self.slots.all_stopped_clean(key)
    }

    /// One lender confirmed read `id` (tracked under `key`). Like
    /// [`Ledger::notify`], for a read.
    pub fn confirm(
        &mut self,
        id: RequestId,
        key: RequestKey,
        out: &mut impl FnMut(Event),
    ) -> Result<(), NotifyError> {
        let st = self.slots.state(key.slot());
        if st.generation() != key.generation() || st.phase() != LIVE || st.kind() != K_READ {
            self.slots.count_rejected_notification();
            return Err(NotifyError::UnknownRequest(id));
        }
        self.slots.add_acks(key, 1, out);
        Ok(())
    }

    /// Fails live request `key` with `cause` (a lender refused a read, a
    /// writer gave up): as an abort, but with its own cause. Returns the
    /// handles still in flight (none, for the callers above).
    pub fn fail(&mut self, key: RequestKey, cause: Cause, out: &mut impl FnMut(Event)) -> u64 {
        if !self.is_live(key) {
            return 0;
        }
        match self.slots.cancel(key.slot(), cause, out) {
            Cancelled::Now(_, handles) => handles,
            _ => 0,
        }
    }

    /// Extends the lease of write or lend `id` to `until`, never shortening
    /// it. Returns whether a live write or lend had that id; other ids are
    /// ignored (and counted).
    pub fn heartbeat(&mut self, id: RequestId, until: Nanos) -> bool {
        match self.lookup(id) {
            Some((slot, st)) if st.phase() == LIVE && awaits(st.kind()) => {
                let owned = &mut self.owned[slot as usize];
                owned.expires = owned.expires.max(until);
                true
            }
            _ => {
                self.slots.count_ignored_heartbeat();
                false
            }
        }
    }

    /// Aborts request `id`: handles not yet posted stop at once; the returned
    /// [`Cancel`] lists the handles in flight, whose endpoints the driver
    /// must force-close. The request is reported `Failed(Aborted)` once
    /// quiescent (possibly at once, through `out`). `Ok(None)` if nothing is
    /// in flight or it is already being cancelled; `Err` if no live request
    /// has this id (including one reported before the abort took hold: its
    /// report stands).
    pub fn abort(
        &mut self,
        id: RequestId,
        out: &mut impl FnMut(Event),
    ) -> Result<Option<Cancel>, AbortError> {
        let Some((slot, _)) = self.lookup(id) else {
            return Err(AbortError::UnknownRequest(id));
        };
        match self.slots.cancel(slot, Cause::Aborted, out) {
            Cancelled::Now(key, handles) => Ok(cancel_of(key, handles)),
            Cancelled::Already => Ok(None),
            // Reported before the abort took hold: the report stands.
            Cancelled::Ended => Err(AbortError::UnknownRequest(id)),
        }
    }

    /// Time is now `now`: reads past their deadline and writes and lends past
    /// their lease are cancelled (as [`Ledger::abort`], with cause
    /// `Deadline` or `LeaseExpired`). Cancels go to `cancels`, reports to
    /// `out`. Cheap when nothing can have expired.
    pub fn advance(
        &mut self,
        now: Nanos,
        out: &mut impl FnMut(Event),
        cancels: &mut impl FnMut(Cancel),
    ) {
        if now < self.next_expiry {
            return;
        }
        let mut next = Nanos(u64::MAX);
        for slot in 0..self.slots.capacity() {
            let st = self.slots.state(slot);
            if st.phase() != LIVE {
                continue;
            }
            let expires = self.owned[slot as usize].expires;
            if expires > now {
                next = next.min(expires);
                continue;
            }
            let cause = if st.kind() == K_READ {
                Cause::Deadline
            } else {
                Cause::LeaseExpired
            };
            if let Cancelled::Now(key, handles) = self.slots.cancel(slot, cause, out) {
                if let Some(c) = cancel_of(key, handles) {
                    cancels(c);
                }
            }
        }
        self.next_expiry = next;
    }

    /// Cancels every tracked request with `cause` (shutdown): as
    /// [`Ledger::advance`] does at a deadline, for all of them at once.
    pub fn cancel_all(
        &mut self,
        cause: Cause,
        out: &mut impl FnMut(Event),
        cancels: &mut impl FnMut(Cancel),
    ) {
        self.cancel_all_but(cause, |_| false, out, cancels);
    }

    /// As [`Ledger::cancel_all`], but the slots `keep` names stay live.
    pub fn cancel_all_but(
        &mut self,
        cause: Cause,
        keep: impl Fn(u32) -> bool,
        out: &mut impl FnMut(Event),
        cancels: &mut impl FnMut(Cancel),
    ) {
        for slot in 0..self.slots.capacity() {
            if self.slots.state(slot).phase() != LIVE || keep(slot) {
                continue;
            }
            if let Cancelled::Now(key, handles) = self.slots.cancel(slot, cause, out) {
                if let Some(c) = cancel_of(key, handles) {
                    cancels(c);
                }
            }
        }
    }

    /// Handles of request `key` still in flight (posted, not ended): what a
    /// forced close must reach when an aborted request outlives its
    /// deadline.
    pub fn in_flight(&self, key: RequestKey) -> u64 {
        self.slots.posted_in_flight(key)
    }

    /// No live request expires before this (`Nanos(u64::MAX)`: none does).
    pub fn next_expiry(&self) -> Nanos {
        self.next_expiry
    }

    /// The expiry (deadline or lease end) of a tracked request.
    pub fn expiry(&self, key: RequestKey) -> Option<Nanos> {
        let st = self.slots.state(key.slot());
        (st.generation() == key.generation() && st.phase() != FREE)
            .then(|| self.owned[key.slot() as usize].expires)
    }

    /// Reports every tracked request failed with `reason` at once, quiescent
    /// or not: for a driver whose transport is gone (a dead poller).
    pub fn fail_all(&mut self, reason: Reason, out: &mut impl FnMut(Event)) {
        self.slots.fail_all(reason, out);
    }

    /// The peer's endpoint failed: every handle to it fails (deferred as
    /// always). Handles not yet posted stop now; those in flight are marked
    /// failed and stop when the driver's forced close completes them.
    /// Returns the number of handles failed.
    pub fn peer_lost(&mut self, peer: PeerId, out: &mut impl FnMut(Event)) -> u32 {
        self.peer_lost_with(peer, Reason::of(Cause::PeerLost), out)
    }

    /// [`Ledger::peer_lost`] with the reason to record (a peer removed by
    /// the engine, or lost).
    pub fn peer_lost_with(
        &mut self,
        peer: PeerId,
        reason: Reason,
        out: &mut impl FnMut(Event),
    ) -> u32 {
        let mut count = 0;
        for slot in 0..self.slots.capacity() {
            let st = self.slots.state(slot);
            if st.phase() != LIVE && st.phase() != CANCELLING {
                continue;
            }
            let mask = self.owned[slot as usize]
                .peers
                .iter()
                .enumerate()
                .filter(|(_, p)| **p == peer)
                .fold(0u64, |m, (h, _)| m | 1 << h);
            if mask == 0 {
                continue;
            }
            let key = RequestKey::new(slot, st.generation());
            let (unposted, in_flight) = self.slots.claim_unposted(key, mask);
            let hit = unposted | in_flight;
            if hit == 0 {
                continue;
            }
            count += hit.count_ones();
            let s = self.slots.slot(slot);
            self.slots.record_reason(s, reason);
            self.slots.mark_failed(s, key, hit, reason, out);
            if unposted != 0 {
                self.slots.stop(s, key, unposted, out);
            }
        }
        count
    }

    /// Retires reported request `key` once the engine consumed its report
    /// (and, for a failed read, took its blocks with
    /// [`Slots::blocks_to_invalidate`]): frees the slot and makes `key` stale.
    /// The engine hands keys back to the owner (e.g. over the command ring).
    pub fn retire(&mut self, key: RequestKey) -> Result<(), RetireError> {
        self.slots.retire(key)?;
        self.free.push_back(key.slot());
        Ok(())
    }

    /// Counters and occupancy.
    pub fn stats(&self) -> Stats {
        self.slots
            .stats(self.slots.capacity() - self.free.len() as u32)
    }
}

/// Whether a request of kind code `k` waits for remote notifications (and
/// so has a lease that heartbeats extend).
fn awaits(k: u8) -> bool {
    k == K_WRITE || k == K_LEND || k == K_RECEIVE
}

fn cancel_of(key: RequestKey, handles: u64) -> Option<Cancel> {
    (handles != 0).then_some(Cancel { key, handles })
}

#[cfg(test)]
mod tests {
    use super::slots::bits;

    #[test]
    fn bits_iterates_set_bits_lowest_first() {
        assert_eq!(bits(0b1010_0001).collect::<Vec<_>>(), [0, 5, 7]);
        assert_eq!(bits(1 << 63).collect::<Vec<_>>(), [63]);
        assert_eq!(bits(0).count(), 0);
    }
}
