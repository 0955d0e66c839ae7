//! Statistics: busy and idle turns and the time spent in busy and idle
//! runs, counted on the driver thread without atomics and published into
//! [`super::Shared`] (with the core's own counters) every 1024 turns, before
//! blocking and at the end. Refused reads and rejected notifications are
//! also logged there, one line a second at most.

use crate::core::CoreStats;

use std::sync::atomic::Ordering;

use super::Driver;
use crate::ledger::Nanos;

impl Driver {
    pub(super) fn publish_counters(&self, c: &mut Counters) {
        let now = self.now();
        c.close_run(now);
        // Relaxed: monotonic metrics, read for display only.
        let s = &self.shared;
        s.busy_iterations
            .fetch_add(std::mem::take(&mut c.busy), Ordering::Relaxed);
        s.idle_iterations
            .fetch_add(std::mem::take(&mut c.idle), Ordering::Relaxed);
        s.busy_ns
            .fetch_add(std::mem::take(&mut c.busy_ns), Ordering::Relaxed);
        s.idle_ns
            .fetch_add(std::mem::take(&mut c.idle_ns), Ordering::Relaxed);
        let stats = self.core.stats();
        s.malformed_notes
            .store(stats.malformed_notifications, Ordering::Relaxed);
        s.rejected_notes
            .store(stats.rejected_notifications, Ordering::Relaxed);
        s.refused_reads
            .store(stats.refused_reads, Ordering::Relaxed);
        s.reads_not_lent
            .store(stats.reads_not_lent, Ordering::Relaxed);
        s.refused_writes
            .store(stats.refused_writes, Ordering::Relaxed);
        s.writes_not_lent
            .store(stats.writes_not_lent, Ordering::Relaxed);
        s.unauthenticated_notes
            .store(stats.unauthenticated_notifications, Ordering::Relaxed);
        s.replayed_notes
            .store(stats.replayed_notifications, Ordering::Relaxed);
        s.word_confirmations
            .store(stats.word_confirmations, Ordering::Relaxed);
        s.word_misses.store(stats.word_misses, Ordering::Relaxed);
        s.word_collisions
            .store(stats.word_collisions, Ordering::Relaxed);
        self.shared
            .ops_posted
            .store(stats.ops_posted, Ordering::Relaxed);
        self.shared
            .ops_completed
            .store(stats.ops_completed, Ordering::Relaxed);
        s.notes_sent
            .store(stats.notifications_sent, Ordering::Relaxed);
        s.note_messages
            .store(stats.notification_messages, Ordering::Relaxed);
        self.shared.bytes_moved.store(
            stats.blocks_moved.saturating_mul(self.cfg.block_size),
            Ordering::Relaxed,
        );
        s.events_overflowed
            .store(self.events.overflowed(), Ordering::Relaxed);
        s.quarantined
            .store(stats.quarantined_now, Ordering::Relaxed);
        c.log_refusals(&stats, now);
    }
}

/// Busy and idle iterations and nanoseconds since the last publication,
/// and the run in progress (busy or idle) with the time it started.
pub(super) struct Counters {
    pub(super) busy: u64,
    pub(super) idle: u64,
    busy_ns: u64,
    idle_ns: u64,
    pub(super) busy_run: bool,
    run_start: Nanos,
    /// Refused reads, reads not lent and rejected notifications as last
    /// logged, and when.
    logged: [u64; 5],
    logged_at: Option<Nanos>,
}

impl Counters {
    pub(super) fn new(now: Nanos) -> Self {
        Counters {
            busy: 0,
            idle: 0,
            busy_ns: 0,
            idle_ns: 0,
            busy_run: false,
            run_start: now,
            logged: [0; 5],
            logged_at: None,
        }
    }

    /// Logs the refusals counted since the last line, if a second passed
    /// since it: a flood of forged notes costs one line a second.
    fn log_refusals(&mut self, stats: &CoreStats, now: Nanos) {
        let seen = [
            stats.refused_reads,
            stats.reads_not_lent,
            stats.refused_writes,
            stats.writes_not_lent,
            stats.rejected_notifications,
        ];
        let recent = self
            .logged_at
            .is_some_and(|t| now.0.saturating_sub(t.0) < 1_000_000_000);
        if seen == self.logged || recent {
            return;
        }
        let [refused, not_lent, refused_writes, writes_not_lent, rejected] =
            std::array::from_fn(|i| seen[i].saturating_sub(self.logged[i]));
        if refused > 0 {
            tracing::warn!(
                refused,
                total = seen[0],
                "refused reads of blocks or incarnations this engine did not lend"
            );
        }
        if not_lent > 0 {
            tracing::warn!(
                not_lent,
                total = seen[1],
                "reads failed: their lender did not lend what they read"
            );
        }
        if refused_writes > 0 {
            tracing::warn!(
                refused = refused_writes,
                total = seen[2],
                "refused writers' words about blocks that are not their receive's"
            );
        }
        if writes_not_lent > 0 {
            tracing::warn!(
                not_lent = writes_not_lent,
                total = seen[3],
                "writes failed: their destination did not take what they wrote"
            );
        }
        let refusals = refused + refused_writes;
        if rejected > refusals {
            tracing::debug!(
                rejected = rejected - refusals,
                total = seen[4],
                "notifications rejected"
            );
        }
        self.logged = seen;
        self.logged_at = Some(now);
    }

    /// Counts the run in progress up to `now`; it goes on from there.
    fn close_run(&mut self, now: Nanos) {
        let ns = now.0.saturating_sub(self.run_start.0);
        if self.busy_run {
            self.busy_ns += ns;
        } else {
            self.idle_ns += ns;
        }
        self.run_start = now;
    }

    /// Closes the run in progress at `now` and starts the other kind.
    pub(super) fn switch(&mut self, now: Nanos) {
        self.close_run(now);
        self.busy_run = !self.busy_run;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_split_time_between_busy_and_idle_runs_at_each_switch() {
        let mut c = Counters::new(Nanos(100));
        // Idle from 100 to 250, busy from 250 to 300, idle until 1000.
        c.switch(Nanos(250));
        assert!(c.busy_run);
        c.switch(Nanos(300));
        c.close_run(Nanos(1000));
        assert_eq!((c.idle_ns, c.busy_ns), (150 + 700, 50));
        assert!(!c.busy_run, "closing a run keeps its kind");
    }

    #[test]
    fn refusals_are_logged_at_most_once_a_second() {
        let mut c = Counters::new(Nanos(0));
        let mut s = CoreStats {
            refused_reads: 1,
            ..CoreStats::default()
        };
        c.log_refusals(&s, Nanos(10));
        assert_eq!(c.logged, [1, 0, 0, 0, 0]);
        s.refused_reads = 5;
        s.refused_writes = 1;
        s.rejected_notifications = 3;
        c.log_refusals(&s, Nanos(500_000_000));
        assert_eq!(c.logged, [1, 0, 0, 0, 0], "logged again within the second");
        c.log_refusals(&s, Nanos(1_000_000_010));
        assert_eq!(c.logged, [5, 0, 1, 0, 3]);
    }
}
