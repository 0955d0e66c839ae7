//! Whether this engine's worker still hears: a probe for a shared-memory
//! receive queue that stopped for good.
//!
//! A process killed inside a shared-memory active-message send to this
//! worker (after it took a slot of the receive FIFO, before it marked the
//! slot written) leaves a slot that nobody completes; the worker reads no
//! message on that transport again, from anyone (docs/design.md §4). UCX
//! says nothing of it: progress finds nothing and `ucp_worker_arm` refuses
//! as it does for any pending event.
//!
//! So the transport keeps a second worker in the same context, with an
//! endpoint to its own worker made as a peer's is (peer error mode, the
//! same lane selection: the active-message lane a peer on this host gets),
//! and now and then ([`PROBE_EVERY`]) sends an 8-byte message from it to
//! the worker. A probe that the worker has not received once both
//! [`PROBE_BOUND`] of time and [`PROBE_PROGRESSES`] of its progress calls
//! passed since it was sent means the worker is deaf. Both bounds count
//! what the poller itself did: a poller that is stopped (SIGSTOP), stalled
//! or descheduled makes no progress calls, and its first progress once it
//! runs again reads the probe, so it is never taken for deaf; a poller that
//! spins fast makes many progress calls in no time, and the time bound
//! waits for it. A live queue hands over the probe within a few progress
//! calls (UCX reads up to 16 messages a call from a FIFO of 64), whatever
//! else is queued before it.
//!
//! [`Hearing`] is the rule alone (fed the time and the progress count,
//! no UCX), so that it is tested apart; [`super::UcxTransport`] sends the
//! probes and reports what arrived.

use crate::ledger::Nanos;

/// How often a probe is sent: one in flight at most, the next no sooner
/// than this after the last one was sent.
pub const PROBE_EVERY: Nanos = Nanos(500_000_000);
/// How long a probe may stay unheard, in poller time.
pub const PROBE_BOUND: Nanos = Nanos(500_000_000);
/// How many progress calls of the worker a probe may stay unheard.
pub const PROBE_PROGRESSES: u64 = 64;

/// What [`Hearing::step`] asks the transport to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Nothing: a probe is in flight and not late, or the next is not due.
    Wait,
    /// Send probe number `seq`.
    Send(u64),
    /// The worker is deaf (for good: this answer never changes).
    Deaf,
}

/// The probe rule: when to send, and when a probe unheard means deaf.
#[derive(Debug, Default)]
pub struct Hearing {
    /// The probe in flight: its number, when it was sent, and the progress
    /// count then.
    out: Option<(u64, Nanos, u64)>,
    /// When the last probe was sent.
    last: Option<Nanos>,
    seq: u64,
    deaf: bool,
}

impl Hearing {
    /// What to do at `now`, with `progresses` progress calls of the worker
    /// made so far.
    pub fn step(&mut self, now: Nanos, progresses: u64) -> Step {
        if self.deaf {
            return Step::Deaf;
        }
        match self.out {
            Some((_, at, p)) => {
                let late = now.0.saturating_sub(at.0) >= PROBE_BOUND.0
                    && progresses.saturating_sub(p) >= PROBE_PROGRESSES;
                if late {
                    self.deaf = true;
                    return Step::Deaf;
                }
                Step::Wait
            }
            None if self
                .last
                .is_none_or(|t| now.0.saturating_sub(t.0) >= PROBE_EVERY.0) =>
            {
                self.seq += 1;
                self.out = Some((self.seq, now, progresses));
                self.last = Some(now);
                Step::Send(self.seq)
            }
            None => Step::Wait,
        }
    }

    /// Probe `seq` arrived (any other number is ignored).
    pub fn heard(&mut self, seq: u64) {
        if self.out.is_some_and(|(s, ..)| s == seq) {
            self.out = None;
        }
    }

    /// The probe just asked for could not be sent: it is not waited for
    /// (the next is sent after [`PROBE_EVERY`]).
    pub fn unsent(&mut self) {
        self.out = None;
    }

    /// Whether a probe is in flight (its worker is then progressed).
    pub fn waiting(&self) -> bool {
        self.out.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn at(ms: u64) -> Nanos {
        Nanos(ms * MS)
    }

    #[test]
    fn a_probe_heard_in_time_never_makes_the_worker_deaf_and_the_next_waits_its_period() {
        let mut h = Hearing::default();
        assert_eq!(h.step(at(0), 0), Step::Send(1));
        assert!(h.waiting());
        h.heard(1);
        assert!(!h.waiting());
        // Not due yet, however many progress calls.
        assert_eq!(h.step(at(499), 1_000_000), Step::Wait);
        assert_eq!(h.step(at(500), 1_000_000), Step::Send(2));
        h.heard(2);
        for t in (501..20_000).step_by(7) {
            if let Step::Send(s) = h.step(at(t), t * 100) {
                h.heard(s);
            }
        }
        assert_ne!(h.step(at(30_000), 10_000_000), Step::Deaf);
    }

    #[test]
    fn a_stopped_poller_is_not_deaf_however_long_it_was_stopped() {
        // Sent, then the process is stopped for a minute: no progress
        // call in between, so not deaf; its first progress reads the probe.
        let mut h = Hearing::default();
        assert_eq!(h.step(at(0), 10), Step::Send(1));
        assert_eq!(h.step(at(60_000), 10), Step::Wait);
        assert_eq!(h.step(at(60_000), 10 + PROBE_PROGRESSES - 1), Step::Wait);
        h.heard(1);
        assert_eq!(h.step(at(60_001), 10 + PROBE_PROGRESSES), Step::Send(2));
    }

    #[test]
    fn a_fast_spinning_poller_is_not_deaf_before_the_time_bound() {
        let mut h = Hearing::default();
        assert_eq!(h.step(at(0), 0), Step::Send(1));
        assert_eq!(h.step(at(499), 1_000_000), Step::Wait);
    }

    #[test]
    fn a_probe_unheard_past_both_bounds_means_deaf_for_good() {
        let mut h = Hearing::default();
        assert_eq!(h.step(at(100), 5), Step::Send(1));
        assert_eq!(h.step(at(599), 5 + PROBE_PROGRESSES), Step::Wait);
        assert_eq!(h.step(at(600), 5 + PROBE_PROGRESSES - 1), Step::Wait);
        assert_eq!(h.step(at(600), 5 + PROBE_PROGRESSES), Step::Deaf);
        // A late arrival changes nothing: the worker stopped reading once.
        h.heard(1);
        assert_eq!(h.step(at(10_000), 1_000_000), Step::Deaf);
    }

    #[test]
    fn only_the_probe_in_flight_counts_as_heard_and_an_unsent_one_is_not_waited_for() {
        let mut h = Hearing::default();
        assert_eq!(h.step(at(0), 0), Step::Send(1));
        // An earlier number (or a peer's bytes) is not this probe.
        h.heard(7);
        assert!(h.waiting());
        h.unsent();
        assert!(!h.waiting());
        assert_eq!(h.step(at(10_000), 1_000_000), Step::Send(2));
    }
}
