//! The shared half of the ledger: a fixed slab of request slots made of
//! atomics. Every method takes `&self` and may run on any thread: pollers
//! report handle progress here; the engine thread reads a failed read's
//! blocks here before handing its key back to the owner.

use crossbeam_utils::CachePadded;

use super::error::{InputError, RetireError};
use super::event::{Cause, Event, Outcome, Reason};
use super::key::{BlockId, HandleKey, RequestId, RequestKey, MAX_HANDLES};
use super::request::Kind;
use crate::sync::{AtomicU32, AtomicU64, Ordering};

// ---------------------------------------------------------------------------
// The state word of a slot: generation, phase, kind, cancel cause and
// terminal outcome in one `u64`, so one CAS moves a request between phases and
// one load tells a caller whether its key is still current.

pub(crate) const FREE: u8 = 0;
pub(crate) const LIVE: u8 = 1;
pub(crate) const CANCELLING: u8 = 2;
pub(crate) const TERMINAL: u8 = 3;

pub(crate) const K_READ: u8 = 1;
pub(crate) const K_PREFIX_HIT: u8 = 2;
pub(crate) const K_WRITE: u8 = 3;
pub(crate) const K_LEND: u8 = 4;
pub(crate) const K_RECEIVE: u8 = 5;

const O_FINISHED: u8 = 1;
const O_FAILED: u8 = 2;
const O_SEND_DONE: u8 = 3;
const O_SEND_EXPIRED: u8 = 4;
const O_LEND_RELEASED: u8 = 5;
const O_LEND_EXPIRED: u8 = 6;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct State(pub(crate) u64);

impl State {
    pub(crate) fn new(generation: u32, phase: u8, kind: u8) -> State {
        State(u64::from(generation) << 32 | u64::from(kind) << 8 | u64::from(phase))
    }
    pub(crate) fn generation(self) -> u32 {
        (self.0 >> 32) as u32
    }
    pub(crate) fn phase(self) -> u8 {
        self.0 as u8
    }
    pub(crate) fn kind(self) -> u8 {
        (self.0 >> 8) as u8
    }
    fn cause(self) -> Option<Cause> {
        Cause::from_u8((self.0 >> 16) as u8)
    }
    fn outcome(self) -> u8 {
        (self.0 >> 24) as u8
    }
    fn cancelling(self, cause: Cause) -> State {
        State(self.0 & !0xff_00ff | u64::from(cause as u8) << 16 | u64::from(CANCELLING))
    }
    fn terminal(self, outcome: u8) -> State {
        State(self.0 & !0xff00_00ff | u64::from(outcome) << 24 | u64::from(TERMINAL))
    }
    fn is_tracked(self) -> bool {
        self.phase() == LIVE || self.phase() == CANCELLING
    }
}

// ---------------------------------------------------------------------------
// The claim word of a handle: generation and the handle's step. Every handle
// input moves it with one CAS that includes the generation, so each step
// happens once, and an input carrying a stale generation can never move a
// handle of the request that reuses the slot.

pub(crate) const H_PLANNED: u8 = 1;
pub(crate) const H_POSTED: u8 = 2;
/// Ended, but releasing its resources failed: still holds the request.
pub(crate) const H_HELD: u8 = 3;
/// Ended and released.
pub(crate) const H_STOPPED: u8 = 4;
/// Stopped without an operation ever posted (setup failure or cancellation).
pub(crate) const H_UNPOSTED: u8 = 5;

fn claim(generation: u32, step: u8) -> u64 {
    u64::from(generation) << 32 | u64::from(step)
}

/// One request slot. Padded so that two pollers working on neighbouring slots
/// do not share a cache line.
pub(crate) struct Slot {
    pub(crate) state: AtomicU64,
    id: AtomicU64,
    /// Handles in the plan; fixed from begin to retire.
    planned: AtomicU64,
    /// Handles that can no longer touch the request's blocks. The input whose
    /// `fetch_or` makes it equal to `planned` decides publication.
    stopped: AtomicU64,
    /// Handles that failed; every bit is set *before* the handle's bit in
    /// `stopped` (or while the handle is still in flight).
    failed: AtomicU64,
    /// The first failure's packed [`Reason`]; 0 while none.
    reason: AtomicU32,
    acks: AtomicU32,
    expected: AtomicU32,
    n_blocks: AtomicU32,
}

impl Slot {
    fn new() -> Self {
        Slot {
            state: AtomicU64::new(State::new(0, FREE, 0).0),
            id: AtomicU64::new(0),
            planned: AtomicU64::new(0),
            stopped: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            reason: AtomicU32::new(0),
            acks: AtomicU32::new(0),
            expected: AtomicU32::new(0),
            n_blocks: AtomicU32::new(0),
        }
    }
}

/// Counters of refused and unusual inputs, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Slots in the ledger.
    pub capacity: u32,
    /// Slots in use: live requests, and reported ones not yet retired.
    pub in_use: u32,
    /// Handle inputs refused with an [`InputError`].
    pub rejected_inputs: u64,
    /// Consumer notifications rejected and dropped.
    pub rejected_notifications: u64,
    /// Heartbeats for no live write or lend.
    pub ignored_heartbeats: u64,
    /// Release retries that failed again.
    pub failed_release_retries: u64,
    /// Releases that failed (their handles held for a retry).
    pub release_failures: u64,
    /// Retires refused with a [`RetireError`].
    pub rejected_retires: u64,
}

/// Where a request is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Tracked, not yet reported.
    Live,
    /// Deadline, lease or abort hit: waiting for quiescence to report.
    Cancelling,
    /// Reported; waiting to be retired.
    Reported,
}

/// A snapshot of one request, for tests and diagnostics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotView {
    /// Where the request is.
    pub phase: Phase,
    /// Handles in the plan.
    pub planned: u64,
    /// Handles whose operation was posted.
    pub posted: u64,
    /// Handles whose release failed and that still hold the request.
    pub held: u64,
    /// Handles stopped (nothing of theirs can touch the blocks any more).
    pub stopped: u64,
    /// Handles that failed.
    pub failed: u64,
    /// Notifications received.
    pub acks: u32,
}

/// The shared slab of request slots. Get it from
/// [`crate::ledger::Ledger::slots`]; clone the `Arc` into each poller and
/// into the engine thread.
pub struct Slots {
    slots: Box<[CachePadded<Slot>]>,
    /// Claim words, `MAX_HANDLES` per slot.
    handles: Box<[AtomicU64]>,
    /// Local block ids, `max_blocks` per slot. Written by `begin` before the
    /// slot's state is released; read by `blocks_to_invalidate` after it is
    /// reported.
    blocks: Box<[AtomicU32]>,
    max_blocks: u32,
    rejected_inputs: AtomicU64,
    rejected_notifications: AtomicU64,
    ignored_heartbeats: AtomicU64,
    failed_release_retries: AtomicU64,
    release_failures: AtomicU64,
    rejected_retires: AtomicU64,
}

fn ended(hk: HandleKey, _: u8) -> InputError {
    InputError::AlreadyEnded(hk)
}

fn not_posted_or_ended(hk: HandleKey, step: u8) -> InputError {
    match step {
        H_PLANNED => InputError::NotPosted(hk),
        _ => InputError::AlreadyEnded(hk),
    }
}

/// What a cancel found.
pub(crate) enum Cancelled {
    /// Cancelled now: these handles of the request are in flight.
    Now(RequestKey, u64),
    /// Someone cancelled it already.
    Already,
    /// It was reported (or retired) first.
    Ended,
}

/// Iterates the set bits of a bitmap, lowest first.
pub(crate) fn bits(mut m: u64) -> impl Iterator<Item = u8> {
    std::iter::from_fn(move || {
        (m != 0).then(|| {
            let i = m.trailing_zeros() as u8;
            m &= m - 1;
            i
        })
    })
}

impl Slots {
    pub(crate) fn new(capacity: u32, max_blocks: u32) -> Self {
        let cap = capacity as usize;
        Slots {
            slots: (0..cap).map(|_| CachePadded::new(Slot::new())).collect(),
            handles: (0..cap * MAX_HANDLES).map(|_| AtomicU64::new(0)).collect(),
            blocks: (0..cap * max_blocks as usize)
                .map(|_| AtomicU32::new(0))
                .collect(),
            max_blocks,
            rejected_inputs: AtomicU64::new(0),
            rejected_notifications: AtomicU64::new(0),
            ignored_heartbeats: AtomicU64::new(0),
            failed_release_retries: AtomicU64::new(0),
            release_failures: AtomicU64::new(0),
            rejected_retires: AtomicU64::new(0),
        }
    }

    /// The number of slots.
    pub fn capacity(&self) -> u32 {
        self.slots.len() as u32
    }

    /// The most local blocks one request may have.
    pub fn max_blocks(&self) -> u32 {
        self.max_blocks
    }

    pub(crate) fn slot(&self, i: u32) -> &Slot {
        &self.slots[i as usize]
    }

    fn claim_word(&self, slot: u32, handle: u8) -> &AtomicU64 {
        &self.handles[slot as usize * MAX_HANDLES + usize::from(handle)]
    }

    pub(crate) fn state(&self, slot: u32) -> State {
        // Acquire: pairs with begin's Release store, so the slot's fields
        // written before it (planned, id, blocks) are visible after this load.
        State(self.slot(slot).state.load(Ordering::Acquire))
    }

    // -- slot allocation (owner) -----------------------------------------

    /// Fills slot `i` for a new request and makes it live. Owner only, on a
    /// free slot.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn init(
        &self,
        i: u32,
        id: RequestId,
        kind: u8,
        n_handles: usize,
        expected: u32,
        blocks: &[BlockId],
        posting: bool,
    ) -> RequestKey {
        let s = self.slot(i);
        let generation = State(s.state.load(Ordering::Relaxed)).generation();
        // Relaxed stores: nobody reads these before the Release store of the
        // state below, which publishes them all.
        let planned = if n_handles == MAX_HANDLES {
            u64::MAX
        } else {
            (1u64 << n_handles) - 1
        };
        s.id.store(id.0, Ordering::Relaxed);
        s.planned.store(planned, Ordering::Relaxed);
        s.stopped.store(0, Ordering::Relaxed);
        s.failed.store(0, Ordering::Relaxed);
        s.reason.store(0, Ordering::Relaxed);
        s.acks.store(0, Ordering::Relaxed);
        s.expected.store(expected, Ordering::Relaxed);
        s.n_blocks.store(blocks.len() as u32, Ordering::Relaxed);
        // Claim words of unplanned handles keep an old generation and a final
        // step: no CAS can match them, since every input expects the current
        // generation.
        // A plain store may claim for posting: the key is not out yet, so no
        // cancel can race it.
        let first = if posting { H_POSTED } else { H_PLANNED };
        for h in 0..n_handles {
            self.claim_word(i, h as u8)
                .store(claim(generation, first), Ordering::Relaxed);
        }
        let base = i as usize * self.max_blocks as usize;
        for (cell, b) in self.blocks[base..base + blocks.len()].iter().zip(blocks) {
            cell.store(b.0, Ordering::Relaxed);
        }
        // Release: publishes every store above to whoever acquires the state.
        s.state
            .store(State::new(generation, LIVE, kind).0, Ordering::Release);
        RequestKey::new(i, generation)
    }

    // -- handle inputs (any poller) --------------------------------------

    /// The slot of `key` if the key is current: its request is tracked, or
    /// reported and not yet retired. (Inputs for a reported request find
    /// every handle at a final step and are refused by the claim word.)
    fn current(&self, key: RequestKey) -> Result<(&Slot, State), InputError> {
        let s = self
            .slots
            .get(key.slot() as usize)
            .ok_or(InputError::Stale(key))?;
        let st = self.state(key.slot());
        if st.generation() != key.generation() || st.phase() == FREE {
            return Err(InputError::Stale(key));
        }
        Ok((s, st))
    }

    fn reject<T>(&self, e: InputError) -> Result<T, InputError> {
        // Relaxed: a metric.
        self.rejected_inputs.fetch_add(1, Ordering::Relaxed);
        Err(e)
    }

    /// Moves handle `hk` from one of the steps `from` to `to`, or says why
    /// not: `refuse` names the error for a handle found at another step.
    fn step(
        &self,
        hk: HandleKey,
        from: &[u8],
        to: u8,
        refuse: fn(HandleKey, u8) -> InputError,
    ) -> Result<&Slot, InputError> {
        let key = hk.key();
        let (s, _) = self.current(key)?;
        // Relaxed: `planned` was published by the state we just acquired.
        if s.planned.load(Ordering::Relaxed) & hk.bit() == 0 {
            return Err(InputError::NoSuchHandle(hk));
        }
        let word = self.claim_word(key.slot(), hk.handle());
        let g = key.generation();
        // Relaxed: a guess for the CAS, which checks it.
        let mut cur = word.load(Ordering::Relaxed);
        loop {
            if (cur >> 32) as u32 != g {
                return Err(InputError::Stale(key));
            }
            if !from.contains(&(cur as u8)) {
                return Err(refuse(hk, cur as u8));
            }
            // AcqRel: the CAS decides which single input moves the handle;
            // Acquire orders our later writes (failed, stopped) after every
            // earlier step of this handle, Release hands ours to the next one.
            match word.compare_exchange(cur, claim(g, to), Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return Ok(s),
                Err(now) => cur = now,
            }
        }
    }

    /// Claims handle `hk` for posting: call it *before* posting the handle's
    /// operations, and post only on `Ok`. Refused if the handle was already
    /// posted or was cancelled (deadline, lease, abort, peer loss) before it
    /// was posted — then it is already stopped and must not be posted.
    pub fn posting(&self, hk: HandleKey) -> Result<(), InputError> {
        let refuse = |hk, step| match step {
            H_UNPOSTED => InputError::Cancelled(hk),
            _ => InputError::AlreadyPosted(hk),
        };
        match self.step(hk, &[H_PLANNED], H_POSTED, refuse) {
            Ok(_) => Ok(()),
            Err(e) => self.reject(e),
        }
    }

    /// Handle `hk` failed before any operation was posted (bad descriptor,
    /// unknown peer, missing registration). It stops failed at once; the
    /// request still waits for its other handles. Valid before or after
    /// [`Slots::posting`].
    pub fn setup_failed(
        &self,
        hk: HandleKey,
        reason: Reason,
        out: &mut impl FnMut(Event),
    ) -> Result<(), InputError> {
        match self.step(hk, &[H_PLANNED, H_POSTED], H_UNPOSTED, ended) {
            Ok(s) => {
                self.fail(s, hk, reason, out);
                self.stop(s, hk.key(), hk.bit(), out);
                Ok(())
            }
            Err(e) => self.reject(e),
        }
    }

    /// Handle `hk`'s operations completed, successfully or not, and its
    /// resources were released. For a handle of a [`Kind::Write`] this means
    /// its puts completed *and* its endpoint flush completed (a completed put
    /// only frees the source buffer).
    ///
    /// The input that stops the last handle of a request decides its report
    /// and passes it to `out` (with a [`Outcome::HandleFailed`] notice first
    /// when `result` is an error).
    pub fn completed(
        &self,
        hk: HandleKey,
        result: Result<(), Reason>,
        out: &mut impl FnMut(Event),
    ) -> Result<(), InputError> {
        match self.step(hk, &[H_POSTED], H_STOPPED, not_posted_or_ended) {
            Ok(s) => {
                if let Err(reason) = result {
                    self.fail(s, hk, reason, out);
                }
                self.stop(s, hk.key(), hk.bit(), out);
                Ok(())
            }
            Err(e) => self.reject(e),
        }
    }

    /// Handle `hk`'s operations completed (with `result`) but releasing its
    /// resources failed: the handle stays tracked, not stopped, and holds the
    /// request (and its blocks) until [`Slots::release_retried`] succeeds.
    pub fn release_failed(
        &self,
        hk: HandleKey,
        result: Result<(), Reason>,
        out: &mut impl FnMut(Event),
    ) -> Result<(), InputError> {
        match self.step(hk, &[H_POSTED], H_HELD, not_posted_or_ended) {
            Ok(s) => {
                self.release_failures.fetch_add(1, Ordering::Relaxed);
                if let Err(reason) = result {
                    self.fail(s, hk, reason, out);
                }
                Ok(())
            }
            Err(e) => self.reject(e),
        }
    }

    /// A retried release of handle `hk`: `released` says whether it worked
    /// this time. On success the handle stops (and may complete the request).
    pub fn release_retried(
        &self,
        hk: HandleKey,
        released: bool,
        out: &mut impl FnMut(Event),
    ) -> Result<(), InputError> {
        if !released {
            if let Err(e) = self.current(hk.key()) {
                return self.reject(e);
            }
            // Relaxed: the step was set by this handle's own earlier input,
            // on this thread (a handle's inputs come from one poller).
            let cur = self
                .claim_word(hk.key().slot(), hk.handle())
                .load(Ordering::Relaxed);
            if cur != claim(hk.key().generation(), H_HELD) {
                return self.reject(InputError::NotHeld(hk));
            }
            // Relaxed: a metric.
            self.failed_release_retries.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        match self.step(hk, &[H_HELD], H_STOPPED, |hk, _| InputError::NotHeld(hk)) {
            Ok(s) => {
                self.stop(s, hk.key(), hk.bit(), out);
                Ok(())
            }
            Err(e) => self.reject(e),
        }
    }

    // -- failure, stop, publication ---------------------------------------

    /// Records the first failure reason of the request. Must come before the
    /// stop of the handle that failed (the stop's Release publishes it).
    pub(crate) fn record_reason(&self, s: &Slot, reason: Reason) {
        // Relaxed: only the first reason wins; it is published to the
        // reporting thread by the Release of the later `stopped` RMW.
        let _ = s
            .reason
            .compare_exchange(0, reason.pack(), Ordering::Relaxed, Ordering::Relaxed);
    }

    /// Marks `hk` failed, telling `out` once per handle.
    fn fail(&self, s: &Slot, hk: HandleKey, reason: Reason, out: &mut impl FnMut(Event)) {
        self.record_reason(s, reason);
        self.mark_failed(s, hk.key(), hk.bit(), reason, out);
    }

    /// Sets `mask` in `failed` and sends a notice for each newly failed
    /// handle.
    pub(crate) fn mark_failed(
        &self,
        s: &Slot,
        key: RequestKey,
        mask: u64,
        reason: Reason,
        out: &mut impl FnMut(Event),
    ) {
        // Relaxed: ordered before the handle's stop by the stop's Release.
        let prev = s.failed.fetch_or(mask, Ordering::Relaxed);
        let id = RequestId(s.id.load(Ordering::Relaxed));
        for handle in bits(mask & !prev) {
            out(Event {
                key,
                id,
                outcome: Outcome::HandleFailed { handle, reason },
            });
        }
    }

    /// Stops the handles in `mask`; if that stops the last planned handle,
    /// tries to publish the request's report.
    pub(crate) fn stop(&self, s: &Slot, key: RequestKey, mask: u64, out: &mut impl FnMut(Event)) {
        // AcqRel: Release publishes this handle's failed bit and reason;
        // Acquire (through the release sequence of earlier RMWs on `stopped`)
        // makes every other stopped handle's failed bit visible to us. Exactly
        // one fetch_or turns `stopped` into `planned`.
        let prev = s.stopped.fetch_or(mask, Ordering::AcqRel);
        // Relaxed: fixed since begin, published by the state we acquired.
        let planned = s.planned.load(Ordering::Relaxed);
        if prev | mask == planned && prev != planned {
            self.publish(key, out);
        }
    }

    /// Publishes the request's terminal event if its conditions hold now.
    ///
    /// Called by every input that may complete a condition (last stop,
    /// notification, cancel). Whoever's CAS moves the state to TERMINAL
    /// reports; a CAS succeeds once per generation, so reports happen once.
    pub(crate) fn publish(&self, key: RequestKey, out: &mut impl FnMut(Event)) {
        if let Some(e) = self.try_publish(key) {
            out(e);
        }
    }

    fn try_publish(&self, key: RequestKey) -> Option<Event> {
        let s = self.slot(key.slot());
        let planned = s.planned.load(Ordering::Relaxed);
        // Read-modify-write reads (`fetch_or(0)`, `fetch_add(0)`), not loads:
        // a RMW reads the latest value, so of two threads that each complete
        // one condition (last stop; last notification) and then read the
        // other's, at least one sees both (store buffering cannot hide one
        // from both). AcqRel: acquire the failed bits published by stops.
        let stopped = s.stopped.fetch_or(0, Ordering::AcqRel);
        if stopped != planned {
            return None;
        }
        let acks = s.acks.fetch_add(0, Ordering::AcqRel);
        // Relaxed: acquired through `stopped` above.
        let failed = s.failed.load(Ordering::Relaxed);
        let expected = s.expected.load(Ordering::Relaxed);
        let mut st = self.state(key.slot());
        loop {
            if st.generation() != key.generation() || !st.is_tracked() {
                return None;
            }
            let (code, outcome) = self.verdict(s, st, failed, acks >= expected)?;
            // AcqRel: the CAS decides the single report; Release publishes
            // the outcome to the engine, which acquires the state.
            match s.state.compare_exchange(
                st.0,
                st.terminal(code).0,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    return Some(Event {
                        key,
                        id: RequestId(s.id.load(Ordering::Relaxed)),
                        outcome,
                    })
                }
                Err(now) => st = State(now),
            }
        }
    }

    /// The report of a quiescent request in state `st`, or `None` while it
    /// must still wait (for notifications, or for a failed write's lease).
    fn verdict(&self, s: &Slot, st: State, failed: u64, acked: bool) -> Option<(u8, Outcome)> {
        let failure = || {
            // Relaxed: the reason was written before a stop or a cancel CAS
            // that we acquired.
            let r = Reason::unpack(s.reason.load(Ordering::Relaxed))
                .or(st.cause().map(Reason::of))
                .unwrap_or(Reason::of(Cause::Transfer));
            (O_FAILED, Outcome::Failed(r))
        };
        let cancel = st.cause();
        match (st.kind(), cancel) {
            // A read also waits for its `expected` confirmations (one per
            // lender that must say its lend was live); a failed one does not.
            (K_READ | K_PREFIX_HIT, None) if failed == 0 && acked => {
                Some((O_FINISHED, Outcome::Finished))
            }
            (K_READ | K_PREFIX_HIT, None) if failed == 0 => None,
            (K_READ | K_PREFIX_HIT, _) => Some(failure()),
            (K_WRITE, None) if failed == 0 && acked => Some((O_SEND_DONE, Outcome::SendDone)),
            // A failed write is never done; quiescent, nothing reads its
            // source blocks any more: report the failure with its reason.
            (K_WRITE, None) if failed != 0 => Some(failure()),
            (K_WRITE, None) => None,
            (K_WRITE, Some(Cause::LeaseExpired)) => Some((O_SEND_EXPIRED, Outcome::SendExpired)),
            (K_LEND, None) if acked => Some((O_LEND_RELEASED, Outcome::LendReleased)),
            (K_LEND, None) => None,
            (K_LEND, Some(Cause::LeaseExpired)) => Some((O_LEND_EXPIRED, Outcome::LendExpired)),
            (K_RECEIVE, None) if acked => Some((O_FINISHED, Outcome::Finished)),
            (K_RECEIVE, None) => None,
            _ => Some(failure()),
        }
    }

    // -- cancellation (owner) ---------------------------------------------

    /// Moves a live request to CANCELLING with `cause`, stops every handle not
    /// yet posted, and returns the handles still in flight.
    pub(crate) fn cancel(&self, slot: u32, cause: Cause, out: &mut impl FnMut(Event)) -> Cancelled {
        let s = self.slot(slot);
        let mut st = self.state(slot);
        loop {
            match st.phase() {
                LIVE => {}
                CANCELLING => return Cancelled::Already,
                _ => return Cancelled::Ended,
            }
            // AcqRel: one CAS decides the cancel against a concurrent report.
            match s.state.compare_exchange(
                st.0,
                st.cancelling(cause).0,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break,
                Err(now) => st = State(now),
            }
        }
        let key = RequestKey::new(slot, st.generation());
        self.record_reason(s, Reason::of(cause));
        let planned = s.planned.load(Ordering::Relaxed);
        let (unposted, in_flight) = self.claim_unposted(key, planned);
        if unposted != 0 {
            // Relaxed: published by the stop below. No notices: these
            // handles never ran.
            s.failed.fetch_or(unposted, Ordering::Relaxed);
            // AcqRel: as in `stop`; the report is decided below.
            s.stopped.fetch_or(unposted, Ordering::AcqRel);
        }
        // Try to report in any case: the request may be quiescent already
        // (a write waiting for acks, a lend), or our stops finished it.
        self.publish(key, out);
        Cancelled::Now(key, in_flight)
    }

    /// The handles of tracked request `key` that are posted and not ended.
    pub(crate) fn posted_in_flight(&self, key: RequestKey) -> u64 {
        let st = self.state(key.slot());
        if st.generation() != key.generation() || !st.is_tracked() {
            return 0;
        }
        // Relaxed: `planned` was published by the state acquired above.
        let planned = self.slot(key.slot()).planned.load(Ordering::Relaxed);
        bits(planned)
            .filter(|&h| {
                // Acquire: a read of the handle's latest step.
                self.claim_word(key.slot(), h).load(Ordering::Acquire)
                    == claim(key.generation(), H_POSTED)
            })
            .fold(0, |m, h| m | 1 << h)
    }

    /// Stops (as never posted) every handle of `mask` not yet posted; returns
    /// those, and the handles of `mask` in flight (posted, not ended).
    pub(crate) fn claim_unposted(&self, key: RequestKey, mask: u64) -> (u64, u64) {
        let g = key.generation();
        let (mut unposted, mut in_flight) = (0, 0);
        for h in bits(mask) {
            let word = self.claim_word(key.slot(), h);
            // AcqRel: decides against a concurrent `posting` of this handle.
            match word.compare_exchange(
                claim(g, H_PLANNED),
                claim(g, H_UNPOSTED),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => unposted |= 1 << h,
                Err(cur) if cur == claim(g, H_POSTED) => in_flight |= 1 << h,
                Err(_) => {}
            }
        }
        (unposted, in_flight)
    }

    /// Whether live request `key` has every planned handle stopped and none
    /// failed (what the owner asks, cheaply, after each handle of a read).
    pub(crate) fn all_stopped_clean(&self, key: RequestKey) -> bool {
        let st = self.state(key.slot());
        if st.generation() != key.generation() || st.phase() != LIVE {
            return false;
        }
        let s = self.slot(key.slot());
        // Acquire: every handle's failed bit is written before its stop.
        let stopped = s.stopped.load(Ordering::Acquire);
        // Relaxed: fixed since begin, published by the state acquired above.
        stopped == s.planned.load(Ordering::Relaxed) && s.failed.load(Ordering::Relaxed) == 0
    }

    /// Sets the notifications request `key` waits for (owner only, before
    /// any of its handles can complete).
    pub(crate) fn set_expected(&self, key: RequestKey, n: u32) {
        // Relaxed: read by the owner thread's later publish attempts, and by
        // other threads through the state word's release sequence.
        self.slot(key.slot()).expected.store(n, Ordering::Relaxed);
    }

    /// Adds `count` notifications to a live request and tries to report it.
    pub(crate) fn add_acks(&self, key: RequestKey, count: u32, out: &mut impl FnMut(Event)) {
        let s = self.slot(key.slot());
        // AcqRel RMW: see try_publish on why both conditions are RMWs.
        let _ = s
            .acks
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |a| {
                Some(a.saturating_add(count))
            });
        self.publish(key, out);
    }

    pub(crate) fn count_rejected_notification(&self) {
        // Relaxed: a metric.
        self.rejected_notifications.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn count_ignored_heartbeat(&self) {
        // Relaxed: a metric.
        self.ignored_heartbeats.fetch_add(1, Ordering::Relaxed);
    }

    // -- engine side ------------------------------------------------------

    /// The local blocks to invalidate of a reported request: for a failed
    /// read or receive ([`Kind::Receive`]), appends its block ids to
    /// `invalid`; for any other report, adds nothing. The engine thread calls it on a terminal event, *before*
    /// handing the key back for [`crate::ledger::Ledger::retire`]: until then
    /// the slot cannot be reused, so the blocks read are the request's.
    pub fn blocks_to_invalidate(
        &self,
        key: RequestKey,
        invalid: &mut Vec<BlockId>,
    ) -> Result<(), RetireError> {
        let st = self.reported(key)?;
        if (st.kind() == K_READ || st.kind() == K_RECEIVE) && st.outcome() == O_FAILED {
            let s = self.slot(key.slot());
            let base = key.slot() as usize * self.max_blocks as usize;
            // Relaxed: published by begin's Release, acquired via the state.
            let n = s.n_blocks.load(Ordering::Relaxed) as usize;
            invalid.extend(
                self.blocks[base..base + n]
                    .iter()
                    .map(|c| BlockId(c.load(Ordering::Relaxed))),
            );
        }
        Ok(())
    }

    /// The blocks request `slot` named at begin, in order (a lend's lent
    /// blocks). Read by the thread that began it.
    pub(crate) fn blocks_of(&self, slot: u32) -> impl Iterator<Item = BlockId> + Clone + '_ {
        let s = self.slot(slot);
        let base = slot as usize * self.max_blocks as usize;
        // Relaxed: written by begin on this same thread.
        let n = s.n_blocks.load(Ordering::Relaxed) as usize;
        self.blocks[base..base + n]
            .iter()
            .map(|c| BlockId(c.load(Ordering::Relaxed)))
    }

    /// The state of `key`'s slot if `key` was reported and not retired.
    fn reported(&self, key: RequestKey) -> Result<State, RetireError> {
        if key.slot() >= self.capacity() {
            return self.reject_retire(RetireError::Stale(key));
        }
        let st = self.state(key.slot());
        if st.generation() != key.generation() || st.phase() == FREE {
            return self.reject_retire(RetireError::Stale(key));
        }
        if st.phase() != TERMINAL {
            return self.reject_retire(RetireError::NotReported(key));
        }
        Ok(st)
    }

    fn reject_retire<T>(&self, e: RetireError) -> Result<T, RetireError> {
        // Relaxed: a metric.
        self.rejected_retires.fetch_add(1, Ordering::Relaxed);
        Err(e)
    }

    /// Frees the slot of reported request `key` and moves its generation on,
    /// so `key` is stale from now on. Owner only.
    pub(crate) fn retire(&self, key: RequestKey) -> Result<(), RetireError> {
        let st = self.reported(key)?;
        let next = State::new(st.generation().wrapping_add(1), FREE, 0);
        // Release: a poller holding the old key reads the new generation
        // (and refuses) once it sees this store. Only the owner changes a
        // reported state, so a store suffices.
        self.slot(key.slot()).state.store(next.0, Ordering::Release);
        Ok(())
    }

    /// Reports every tracked request of the slab as failed with `reason`,
    /// quiescent or not. Only for a driver that has nothing left to wait
    /// for (its transport is gone): the poller after it died.
    pub(crate) fn fail_all(&self, reason: Reason, out: &mut impl FnMut(Event)) {
        for slot in 0..self.capacity() {
            let s = self.slot(slot);
            let mut st = self.state(slot);
            while st.is_tracked() {
                self.record_reason(s, reason);
                let next = st.terminal(O_FAILED);
                // AcqRel: decides the one report against any other publisher.
                match s
                    .state
                    .compare_exchange(st.0, next.0, Ordering::AcqRel, Ordering::Acquire)
                {
                    Ok(_) => {
                        let r = Reason::unpack(s.reason.load(Ordering::Relaxed)).unwrap_or(reason);
                        out(Event {
                            key: RequestKey::new(slot, st.generation()),
                            id: RequestId(s.id.load(Ordering::Relaxed)),
                            outcome: Outcome::Failed(r),
                        });
                        break;
                    }
                    Err(now) => st = State(now),
                }
            }
        }
    }

    // -- observation --------------------------------------------------------

    /// A snapshot of the request `key`, or `None` if the key is stale.
    pub fn snapshot(&self, key: RequestKey) -> Option<SlotView> {
        let s = self.slots.get(key.slot() as usize)?;
        let st = self.state(key.slot());
        if st.generation() != key.generation() || st.phase() == FREE {
            return None;
        }
        let planned = s.planned.load(Ordering::Acquire);
        let (mut posted, mut held) = (0, 0);
        for h in bits(planned) {
            let w = self.claim_word(key.slot(), h).load(Ordering::Acquire);
            match w as u8 {
                H_POSTED | H_STOPPED => posted |= 1 << h,
                H_HELD => {
                    posted |= 1 << h;
                    held |= 1 << h
                }
                _ => {}
            }
        }
        Some(SlotView {
            phase: match st.phase() {
                LIVE => Phase::Live,
                CANCELLING => Phase::Cancelling,
                _ => Phase::Reported,
            },
            planned,
            posted,
            held,
            stopped: s.stopped.load(Ordering::Acquire),
            failed: s.failed.load(Ordering::Acquire),
            acks: s.acks.load(Ordering::Acquire),
        })
    }

    /// Counters; `in_use` is filled in by [`crate::ledger::Ledger::stats`].
    pub(crate) fn stats(&self, in_use: u32) -> Stats {
        Stats {
            capacity: self.capacity(),
            in_use,
            rejected_inputs: self.rejected_inputs.load(Ordering::Relaxed),
            rejected_notifications: self.rejected_notifications.load(Ordering::Relaxed),
            ignored_heartbeats: self.ignored_heartbeats.load(Ordering::Relaxed),
            failed_release_retries: self.failed_release_retries.load(Ordering::Relaxed),
            release_failures: self.release_failures.load(Ordering::Relaxed),
            rejected_retires: self.rejected_retires.load(Ordering::Relaxed),
        }
    }

    pub(crate) fn kind_code(kind: Kind) -> u8 {
        match kind {
            Kind::Read => K_READ,
            Kind::PrefixHit | Kind::NotifyOnly => K_PREFIX_HIT,
            Kind::Write { .. } => K_WRITE,
            Kind::Lend { .. } => K_LEND,
            Kind::Receive { .. } => K_RECEIVE,
        }
    }
}
