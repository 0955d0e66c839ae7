//! What goes into the core (retired keys, commands, transport events, the
//! clock) and what comes out of it (actions performed on the transport,
//! events published to the engine).

use std::sync::atomic::Ordering;

use super::Driver;
use crate::core::Command;
use crate::ledger::Nanos;
use crate::transport::{Transport, TransportEvent};

/// Turns in a row that a due deadline waits for the transport to run dry
/// (see `Driver::advance_if_due`), at most: a stream that never
/// stops must not hold leases and deadlines off for ever. UCX hands over
/// up to 16 messages per progress from a shared-memory FIFO of 64.
const HOLD_BACK: u32 = 64;

/// Passes of [`Driver::drain_transport`] at most in one turn: a read's
/// data, then its lend word loaded from a mapping, then (spare) what that
/// confirmation completed at once.
const DRAIN_PASSES: u32 = 3;

impl Driver {
    /// Frees the slots of requests the engine has consumed.
    pub(super) fn drain_retired(&mut self) -> u32 {
        let mut n = 0;
        while let Some(key) = self.retire.recv() {
            self.core.retire(key);
            n += 1;
        }
        n
    }

    /// Feeds the commands in the ring to the core, executing the actions
    /// of each; reads the clock (into `now`) only if there is one.
    pub(super) fn drain_commands(&mut self, now: &mut Option<Nanos>) -> u32 {
        if self.commands.is_empty() {
            return 0;
        }
        let mut n = 0;
        while let Some(cmd) = self.commands.recv() {
            n += 1;
            // Each command is dated when the driver takes it, after what
            // came before it (a stall, a batch of posts): a lease starts,
            // and a deadline counts, from then.
            let t = self.now();
            *now = Some(t);
            #[cfg(feature = "fault-injection")]
            if let Command::Stall { ns } = cmd {
                std::thread::sleep(std::time::Duration::from_nanos(ns));
                continue;
            }
            if matches!(cmd, Command::Begin { .. }) {
                // The engine admitted this request counting the slots it had
                // handed back; those keys were pushed before this command:
                // free their slots first, or the ledger could find itself
                // full and refuse it.
                self.drain_retired();
            }
            let commands = &mut self.commands;
            self.core.on_command(cmd, &mut || commands.recv(), t);
            self.execute(t);
        }
        n
    }

    /// Feeds what the transport saw to the core and executes the actions
    /// that follow, once for the whole batch. The clock is read at the
    /// first event (an idle turn reads none); a reading this turn already
    /// made is not reused, since posting the commands before may have
    /// taken a while.
    pub(super) fn drain_transport(&mut self, now: &mut Option<Nanos>) -> u32 {
        let mut n = 0;
        let mut read = None;
        let mut heard = false;
        // What the actions of one pass completed as they were posted (a
        // lend word loaded from a mapping) is taken in by the next: a few
        // passes, each after an execute.
        for _ in 0..DRAIN_PASSES {
            let (core, epoch) = (&mut self.core, self.shared.epoch);
            self.wire.drain(&mut |ev| {
                n += 1;
                heard |= matches!(ev, TransportEvent::Message { .. });
                let now = *read.get_or_insert_with(|| Nanos(epoch.elapsed().as_nanos() as u64));
                core.on_transport(ev, now);
            });
            let Some(t) = read else { break };
            self.execute(t);
            *now = Some(t);
            if !self.wire.ready() {
                break;
            }
        }
        if heard {
            self.idle.heard();
        }
        n
    }

    /// Advances the core's clock if a deadline is due: on a turn that read
    /// the clock anyway, always; otherwise (an idle spin) only every 16th
    /// turn, and only when something can be due (a deadline is seen a few
    /// microseconds late at most; `block` reads it anyway).
    ///
    /// `took` is what this turn's progress and transport drain took in.
    /// While that is not nothing, more may be waiting behind it (UCX hands
    /// over a few messages per progress: after a poller stop, one or two
    /// of a dozen readers' notes): the deadlines are judged on the first
    /// turn that finds nothing more, or after [`HOLD_BACK`] turns that
    /// kept finding something. So what arrived before a lease is judged
    /// counts: a lend read while its lender was stopped is released, not
    /// reported expired.
    pub(super) fn advance_if_due(&mut self, turn: u64, now: Option<Nanos>, took: u32) {
        let Some(due) = self.core.next_deadline() else {
            self.held_back = 0;
            return;
        };
        let t = match now {
            Some(t) => Some(t),
            None if turn % 16 == 0 || self.held_back > 0 => Some(self.now()),
            None => None,
        };
        let Some(t) = t.filter(|&t| due <= t) else {
            self.held_back = 0;
            return;
        };
        if took > 0 && self.held_back < HOLD_BACK {
            self.held_back += 1;
            return;
        }
        self.held_back = 0;
        self.core.advance(t);
        self.execute(t);
    }

    /// Executes the core's actions on the transport, feeding back results
    /// (`now` dates release retries).
    pub(super) fn execute(&mut self, now: Nanos) {
        super::execute::execute(&mut self.core, &mut self.wire, now);
    }

    /// Publishes the core's events and lost peers to the engine, waking it
    /// if it waits. Returns how many.
    pub(super) fn publish(&mut self) -> usize {
        let events = &mut self.events;
        let mut n = self.core.drain_events(|e| {
            // Backpressure only means the overflow is past its bound; the
            // event is kept either way, nothing is dropped.
            let _ = events.publish(e);
        });
        let shared = &self.shared;
        self.core.drain_lost_peers(|peer, reason| {
            if let Ok(mut lost) = shared.lost_peers.lock() {
                lost.push((peer, reason));
                shared.lost_pending.store(true, Ordering::Release);
                n += 1;
            }
        });
        if self.events.pending() > 0 {
            self.events.flush();
        }
        if n > 0 {
            // After the events are in the ring (release): an engine thread
            // blocked in `wait` is woken; one that is not costs one swap.
            self.shared.reports.notify();
        }
        n
    }
}
