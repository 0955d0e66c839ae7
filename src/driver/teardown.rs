//! The two ways a driver ends: [`Driver::shutdown`] when the engine is
//! dropped (everything in flight cancelled and reported, the transport
//! given time to finish) and [`Driver::die`] after a panic (every endpoint
//! closed, everything still tracked reported `PollerDied`).

use std::time::{Duration, Instant};

use super::Driver;
use crate::ledger::Cause;
use crate::transport::Transport;

impl Driver {
    /// Cancels everything in flight (requests still in the command ring
    /// were begun first), waits until the transport completed every
    /// outstanding operation (bounded), publishes the reports, and releases
    /// endpoints, regions, worker and context (in that order, by drop).
    pub(super) fn shutdown(&mut self) {
        self.drain_retired();
        self.drain_commands(&mut None);
        self.core.shutdown();
        self.execute(self.now());
        let start = Instant::now();
        while (self.core.outstanding() > 0
            || !self.core.quiescent()
            || self.core.quarantined() > 0
            || self.wire.closing())
            && start.elapsed() < Duration::from_secs(10)
        {
            self.wire.progress();
            self.drain_transport(&mut None);
            let now = self.now();
            self.core.advance(now);
            self.execute(now);
            self.publish();
        }
        // Whatever did not stop within the bound is reported all the same.
        self.core.abandon(Cause::Shutdown);
        self.publish();
        // The engine drains the ring while it waits for this thread.
        while self.events.flush() > 0 {
            std::thread::yield_now();
        }
    }

    /// After a panic: close every endpoint, give UCX a moment to cancel
    /// what was outstanding, then report everything still tracked.
    pub(super) fn die(&mut self) {
        self.core.close_all(Cause::PollerDied);
        self.execute(self.now());
        let start = Instant::now();
        while self.core.outstanding() > 0 && start.elapsed() < Duration::from_millis(500) {
            self.wire.progress();
            self.drain_transport(&mut None);
            self.execute(self.now());
        }
        self.core.abandon(Cause::PollerDied);
        self.publish();
        let start = Instant::now();
        while self.events.flush() > 0 && start.elapsed() < Duration::from_secs(1) {
            std::thread::yield_now();
        }
    }
}
