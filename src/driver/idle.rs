//! The idle policy and its wait. An idle adaptive driver spins a little,
//! yields a little, then blocks on the transport's event fd and the
//! engine's eventfd (see [`crate::wake`]) until an event, a submit or the
//! core's next deadline; a busy one only spins. A worker that refuses to
//! arm is napped on, longer each time ([`Refusals`]).

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::Driver;
use crate::ledger::Nanos;
use crate::placement::IdlePolicy;
use crate::transport::Transport;

/// Where the driver stands in an idle run.
pub(super) struct Idle {
    /// Idle turns in a row.
    streak: u32,
    /// When the last work was done (the await phase counts from it).
    since: Nanos,
    /// The last wait returned with the engine's eventfd readable; it is
    /// drained before the next announcement.
    efd_signalled: bool,
    /// What to do about a worker that refuses to arm.
    refusals: Refusals,
    /// The last idle run that a peer's message ended was shorter than
    /// [`AWAIT`]: that peer's next message is likely to come as soon
    /// (see `Driver::awaiting`). Starts true: yielding is the safe guess.
    prompt_peers: bool,
    /// A peer's message was taken in this turn.
    heard: bool,
}

impl Idle {
    pub(super) fn new(now: Nanos) -> Self {
        Idle {
            streak: 0,
            since: now,
            efd_signalled: false,
            refusals: Refusals::default(),
            prompt_peers: true,
            heard: false,
        }
    }

    /// A run switched at `t`; `busy`: to a busy one. An idle run that a
    /// peer's message ended says how promptly peers speak.
    pub(super) fn switch(&mut self, t: Nanos, busy: bool) {
        if busy && self.heard {
            self.prompt_peers = t.0.saturating_sub(self.since.0) < AWAIT.as_nanos() as u64;
        }
        self.since = t;
    }

    /// A turn did work.
    pub(super) fn work(&mut self) {
        self.streak = 0;
        self.refusals.work();
    }

    /// A peer's message was taken in this turn.
    pub(super) fn heard(&mut self) {
        self.heard = true;
    }

    /// The turn ended: the next one has heard nothing yet.
    pub(super) fn turn_done(&mut self) {
        self.heard = false;
    }
}

impl Driver {
    /// The idle phases of the adaptive policy after one more idle turn:
    /// spin, yield the core a few times, then (returns `true`) block. The
    /// busy policy only spins.
    ///
    /// Both phases are short on purpose (see [`SPIN`]).
    pub(super) fn idle_wait(&mut self) -> bool {
        if self.cfg.idle == IdlePolicy::Busy {
            std::hint::spin_loop();
            return false;
        }
        self.idle.streak = self.idle.streak.saturating_add(1);
        match self.idle.streak {
            // The first idle turn after work yields once: the engine
            // thread waiting on what was just published may share this CPU
            // (one syscall per busy -> idle switch, none while busy).
            1 => std::thread::yield_now(),
            // Nothing is expected soon: none of this engine's reads or
            // writes is in flight (no answer to catch), and its peers'
            // messages have come seldom (a lender of 8 MiB requests, whose
            // readers' notes come hundreds of microseconds apart, and
            // whose engine lends as releases are reported, after a
            // wake-up of its own). Spinning and yielding would end before
            // anything came: block now. Spinning so was about a quarter
            // of such a lender's poller CPU (two wake-ups a request).
            _ if !self.expects_soon() => return true,
            0..=SPIN => std::hint::spin_loop(),
            YIELD_FROM..=YIELD_TO => std::thread::yield_now(),
            _ if self.awaiting() => std::thread::yield_now(),
            _ => return true,
        }
        false
    }

    /// Whether something may come soon enough to be caught by spinning:
    /// an answer to this engine's reads or writes, or the next message of
    /// a peer that has been prompt (see [`Driver::awaiting`]).
    fn expects_soon(&self) -> bool {
        self.core.awaits_answers() || self.idle.prompt_peers
    }

    /// Whether to keep yielding rather than block: the driver went idle
    /// less than [`AWAIT`] ago, and either this engine's reads or writes
    /// are in flight, or it has requests (lends, receives) and its peers
    /// have been prompt: the last idle run a peer's message ended was
    /// shorter than [`AWAIT`]. An answer a peer sends within that time (a
    /// read's confirmation, a write's acknowledgement), or the next note
    /// of a stream of reads from a lender, is then picked up by progress
    /// instead of waking this thread through the worker's event fd (over
    /// shared memory the sender signals it with a syscall; over tcp UCX's
    /// async thread relays it: two thread wake-ups, ~100 µs here).
    ///
    /// A lender whose readers come seldom (one note every few hundred
    /// microseconds or more, as 8 MiB requests do) blocks instead: its
    /// yields would end before the next note anyway. Yielding after
    /// every lend cost such a lender ~90 µs of CPU per 8 MiB request.
    fn awaiting(&self) -> bool {
        let recent = self.now().0.saturating_sub(self.idle.since.0) < AWAIT.as_nanos() as u64;
        recent
            && (self.core.awaits_answers()
                || (self.idle.prompt_peers && self.core.next_deadline().is_some()))
    }

    /// Blocks until the transport has an event, the engine pushed
    /// something, or the core's next deadline; see [`crate::wake`].
    pub(super) fn block(&mut self) {
        self.hear();
        let wake = &self.shared.wake;
        // The eventfd signal of the last wake-up is consumed here, before
        // announcing, not on waking: a wake-up then costs no syscall on its
        // way to the work (a signal written after the announcement below
        // stays, so none is lost; one left from before can only make the
        // next wait return at once, as before).
        if std::mem::take(&mut self.idle.efd_signalled) {
            wake.efd.drain();
        }
        // Announce. `false`: the engine pushed since we last looked (its
        // push is visible now): go round again.
        if !wake.state.prepare_park() {
            return;
        }
        // Re-check after announcing. Commands, control messages and the
        // stop flag are each followed by a notify, which the announcement
        // already caught or which will signal the eventfd; these loads
        // catch what is pushed without one (retired keys) and events the
        // engine has not drained yet (it does not notify when it drains).
        let pending_events = self.events.pending() > 0;
        let ready = !self.commands.is_empty()
            || !self.retire.is_empty()
            || self.shared.stop.load(Ordering::Acquire);
        if !ready {
            // Armed: block until the worker's fd fires. No fd (or events
            // waiting in the overflow): nap briefly on the eventfd alone.
            // Not armable (UCS_ERR_BUSY): the first time, do not block,
            // progress first (an event came in since the last progress).
            // Refused again with no work done in between: UCX holds sends
            // it cannot push out (a peer that does not drain its receive
            // queue), and only progress retries them; nap on the eventfd,
            // longer each time up to `REFUSED_NAP_MAX`, instead of
            // spinning on progress and arm (`Refusals`; work or an arm
            // that succeeds starts the count again).
            let fd = if pending_events {
                None
            } else {
                self.wire.wait_fd()
            };
            let armed = fd.is_some() && self.wire.arm();
            let cap = match fd.map(|_| self.idle.refusals.arm(armed)) {
                Some(Refusal::Armed) => Some(MAX_BLOCK),
                Some(Refusal::ProgressFirst) => None,
                Some(Refusal::Nap(nap)) => Some(nap),
                None if pending_events => Some(Duration::from_micros(200)),
                None => Some(NAP),
            };
            if let Some(cap) = cap {
                let timeout = match self.core.next_deadline() {
                    Some(t) => cap.min(Duration::from_nanos(
                        t.0.saturating_sub(self.now().0).max(1_000),
                    )),
                    None => cap,
                };
                let efd = self.shared.wake.efd.fd();
                self.idle.efd_signalled =
                    crate::wake::wait_readable(efd, fd.filter(|_| armed), timeout);
            }
        }
        self.shared.wake.state.woke();
    }
}

/// Idle iterations spent spinning, then yielding, before blocking. Short:
/// blocking is cheap to wake from (an eventfd write, a UCX fd), while a
/// thread that spun long before it slept has used up its fair share and
/// is woken behind whatever runs (measured on a loaded 2-vCPU machine: a
/// submit wake-up of ~4 ms after 2000 spins and 2000 yields).
const SPIN: u32 = 256;
const YIELD_FROM: u32 = SPIN + 1;
const YIELD_TO: u32 = SPIN + 16;
/// How long an adaptive poller with requests in flight keeps yielding
/// after its last work before it blocks (see `Driver::awaiting`).
const AWAIT: Duration = Duration::from_micros(300);

/// Longest block on an armed event fd: a safety net only (every event
/// that matters fires the fd or the eventfd, and the core's deadlines cut
/// it short).
const MAX_BLOCK: Duration = Duration::from_millis(100);
/// Nap of a poller whose transport has no event fd: how late a remote
/// event can be noticed then.
const NAP: Duration = Duration::from_micros(200);

/// First and longest nap of a poller whose worker refuses to arm with
/// nothing to do (see `Driver::block`): how late queued sends are retried
/// once the peer that held them up drains again.
const REFUSED_NAP_MIN: Duration = Duration::from_micros(50);
const REFUSED_NAP_MAX: Duration = Duration::from_millis(1);

/// Refused arms in a row with no work done in between (`UCS_ERR_BUSY`,
/// or an arm that failed outright).
#[derive(Debug, Default)]
struct Refusals(u32);

/// What [`Refusals::arm`] says to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    /// The worker is armed: block on its fd as usual.
    Armed,
    /// Refused once: an event came in since the last progress; progress
    /// first, do not wait.
    ProgressFirst,
    /// Refused again with no work done: UCX holds sends it cannot push
    /// out; wait this long on the eventfd before progress retries them.
    Nap(Duration),
}

impl Refusals {
    /// The outcome of an arm: an arm forgets the refusals before it;
    /// doubling naps from [`REFUSED_NAP_MIN`] up
    /// to [`REFUSED_NAP_MAX`] from the second refusal in a row.
    fn arm(&mut self, armed: bool) -> Refusal {
        if armed {
            // Whatever held the worker busy is gone.
            self.0 = 0;
            return Refusal::Armed;
        }
        self.0 = self.0.saturating_add(1);
        if self.0 == 1 {
            return Refusal::ProgressFirst;
        }
        let doublings = (self.0 - 2).min(16);
        Refusal::Nap((REFUSED_NAP_MIN * (1 << doublings)).min(REFUSED_NAP_MAX))
    }

    /// An iteration did work: the next refusal is a fresh one.
    fn work(&mut self) {
        self.0 = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_arm_is_progressed_first_then_napped_on_longer_each_time_and_forgotten_once_armed()
    {
        let mut r = Refusals::default();
        assert_eq!(r.arm(true), Refusal::Armed);
        assert_eq!(r.arm(false), Refusal::ProgressFirst);
        let naps: Vec<Refusal> = (0..7).map(|_| r.arm(false)).collect();
        let us = |n| Refusal::Nap(Duration::from_micros(n));
        assert_eq!(
            naps,
            [
                us(50),
                us(100),
                us(200),
                us(400),
                us(800),
                us(1000),
                us(1000)
            ]
        );
        // Work done: the next refusal is progressed first again.
        r.work();
        assert_eq!(r.arm(false), Refusal::ProgressFirst);
        assert_eq!(r.arm(false), us(50));
        // Armed again (the held sends went out, say, with progress
        // reporting nothing): a later refusal is a fresh event, not the
        // same stuck peer, and must not wait a nap before its progress.
        assert_eq!(r.arm(true), Refusal::Armed);
        assert_eq!(r.arm(false), Refusal::ProgressFirst);
    }

    #[test]
    fn peers_are_prompt_while_their_messages_end_idle_runs_within_the_await_phase() {
        let us = |n: u64| Nanos(n * 1_000);
        let mut idle = Idle::new(us(0));
        assert!(idle.prompt_peers, "yielding is the first guess");
        // Idle from 0; a peer's message ends the run 500 µs later.
        idle.heard();
        idle.switch(us(500), true);
        idle.turn_done();
        assert!(!idle.prompt_peers, "a message 500 µs after going idle");
        // Idle again; a command (no message) ends the run at once: no
        // evidence about peers.
        idle.switch(us(510), false);
        idle.switch(us(520), true);
        idle.turn_done();
        assert!(!idle.prompt_peers);
        // A message 20 µs after going idle: prompt again.
        idle.switch(us(530), false);
        idle.heard();
        idle.switch(us(550), true);
        idle.turn_done();
        assert!(idle.prompt_peers);
        // A message taken within a busy run says nothing either, and a
        // turn that heard one does not carry it to a later switch.
        idle.heard();
        idle.turn_done();
        idle.switch(us(560), false);
        idle.switch(us(2_000), true);
        assert!(idle.prompt_peers);
    }
}
