//! What an operator scrapes: a plain-data [`MetricsSnapshot`] of an engine
//! and its pollers, and its exposition, encoded by `prometheus-client`:
//! [`render`] in the OpenMetrics text format, [`render_text`] in the
//! Prometheus text format 0.0.4 (the same samples; counters' descriptors
//! name their `_total` series, which that format and `promtool check
//! metrics` expect). A server picks one by the scraper's `Accept` header.
//!
//! A snapshot is a copy: taking one ([`Engine::metrics`](crate::Engine::metrics)) reads the
//! engine's counters and allocates; nothing here runs on the hot path.
//! Latency histograms have fixed log2 buckets ([`LatencyHistogram`]), so a
//! recorder can keep them as arrays of counters without allocating or
//! locking, and two snapshots can be subtracted bucket by bucket.
//!
//! Some figures are not measured by the poller yet and read 0 in
//! [`Engine::metrics`](crate::Engine::metrics) (busy/idle time, operations, bytes, rings, latency);
//! the fields and the exposition are in place for them. Requests by
//! outcome and handle failures by cause are counted by whoever consumes
//! [`Outcomes`](crate::Outcomes): [`MetricsSnapshot::count`].
//!
//! ```
//! use kvpoll::metrics::{render, MetricsSnapshot, PollerMetrics};
//!
//! let mut snap = MetricsSnapshot::default();
//! snap.pollers.push(PollerMetrics { busy_iterations: 7, ..PollerMetrics::default() });
//! snap.latency.read.record(1_500); // 1.5 µs
//! let text = render(&snap).unwrap();
//! assert!(text.contains("kvpoll_poller_iterations_total{poller=\"0\",state=\"busy\"} 7"));
//! assert!(text.ends_with("# EOF\n"));
//! ```

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use std::time::Duration;

use crate::ledger::{Cause, Kind, Outcome};

/// The HTTP `Content-Type` of [`render`]'s output.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The HTTP `Content-Type` of [`render_text`]'s output.
pub const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Buckets of a [`LatencyHistogram`]: bucket `i < LATENCY_BUCKETS - 1`
/// counts latencies of at most `256 ns × 2^i` (256 ns to about 275 s); the
/// last one counts the rest.
pub const LATENCY_BUCKETS: usize = 32;

/// The smallest bucket's upper bound, as a power of two (2^8 = 256 ns).
const FIRST_BOUND_LOG2: u32 = 8;

/// Latencies in fixed log2 buckets, plus their sum.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LatencyHistogram {
    /// Samples per bucket (not cumulative); see [`LATENCY_BUCKETS`].
    pub buckets: [u64; LATENCY_BUCKETS],
    /// Sum of all samples, ns (wrapping).
    pub sum_ns: u64,
}

impl LatencyHistogram {
    /// The bucket a latency of `ns` falls in.
    pub const fn bucket_of(ns: u64) -> usize {
        if ns <= 1 << FIRST_BOUND_LOG2 {
            return 0;
        }
        // ns in (2^(k-1), 2^k] has k = 64 - leading_zeros(ns - 1).
        let k = 64 - (ns - 1).leading_zeros();
        let i = (k - FIRST_BOUND_LOG2) as usize;
        if i >= LATENCY_BUCKETS {
            LATENCY_BUCKETS - 1
        } else {
            i
        }
    }

    /// The upper bound of bucket `i` in ns; `None` for the last bucket
    /// (unbounded) and past it.
    pub const fn upper_bound_ns(i: usize) -> Option<u64> {
        if i + 1 >= LATENCY_BUCKETS {
            None
        } else {
            Some(1 << (FIRST_BOUND_LOG2 as usize + i))
        }
    }

    /// Counts one latency.
    pub fn record(&mut self, ns: u64) {
        self.buckets[Self::bucket_of(ns)] += 1;
        self.sum_ns = self.sum_ns.wrapping_add(ns);
    }

    /// Samples counted.
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }
}

/// One poller's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PollerMetrics {
    /// Time spent in iterations that did work, ns.
    pub busy_ns: u64,
    /// Time spent in iterations that found nothing (spinning, yielding,
    /// napping), ns.
    pub idle_ns: u64,
    /// Loop iterations that did work.
    pub busy_iterations: u64,
    /// Loop iterations that found nothing to do.
    pub idle_iterations: u64,
    /// UCX operations posted.
    pub ops_posted: u64,
    /// UCX operations completed (successfully or not).
    pub ops_completed: u64,
    /// Bytes moved by completed operations.
    pub bytes: u64,
    /// Notifications sent to other engines.
    pub notifications_sent: u64,
    /// Messages they travelled in (several to one endpoint share one).
    pub notification_messages: u64,
}

/// Requests reported, by outcome (the lists of [`Outcomes`](crate::Outcomes)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RequestOutcomes {
    /// Reads and receives whose data all arrived.
    pub finished_recving: u64,
    /// Reads that failed.
    pub failed_recving: u64,
    /// Writes acknowledged and lends fully read.
    pub finished_sending: u64,
    /// Writes that failed or were aborted.
    pub failed_sending: u64,
    /// Writes and lends whose lease expired.
    pub expired: u64,
}

/// Handle failures, by [`Cause`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HandleFailures {
    /// [`Cause::Transfer`].
    pub transfer: u64,
    /// [`Cause::Setup`].
    pub setup: u64,
    /// [`Cause::PeerLost`].
    pub peer_lost: u64,
    /// [`Cause::Deadline`].
    pub deadline: u64,
    /// [`Cause::LeaseExpired`].
    pub lease_expired: u64,
    /// [`Cause::Aborted`].
    pub aborted: u64,
    /// [`Cause::PeerStalled`].
    pub peer_stalled: u64,
    /// [`Cause::Shutdown`].
    pub shutdown: u64,
    /// [`Cause::PollerDied`].
    pub poller_died: u64,
    /// [`Cause::LeaseLost`].
    pub lease_lost: u64,
    /// [`Cause::NotLent`].
    pub not_lent: u64,
}

impl HandleFailures {
    /// The counter of `cause`.
    pub fn of(&mut self, cause: Cause) -> &mut u64 {
        match cause {
            Cause::Transfer => &mut self.transfer,
            Cause::Setup => &mut self.setup,
            Cause::PeerLost => &mut self.peer_lost,
            Cause::Deadline => &mut self.deadline,
            Cause::LeaseExpired => &mut self.lease_expired,
            Cause::Aborted => &mut self.aborted,
            Cause::PeerStalled => &mut self.peer_stalled,
            Cause::Shutdown => &mut self.shutdown,
            Cause::PollerDied => &mut self.poller_died,
            Cause::LeaseLost => &mut self.lease_lost,
            Cause::NotLent => &mut self.not_lent,
        }
    }

    fn rows(&self) -> [(&'static str, u64); 11] {
        [
            ("transfer", self.transfer),
            ("setup", self.setup),
            ("peer_lost", self.peer_lost),
            ("deadline", self.deadline),
            ("lease_expired", self.lease_expired),
            ("aborted", self.aborted),
            ("peer_stalled", self.peer_stalled),
            ("shutdown", self.shutdown),
            ("poller_died", self.poller_died),
            ("lease_lost", self.lease_lost),
            ("not_lent", self.not_lent),
        ]
    }
}

/// Inputs refused and dropped (nothing changed), by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RejectedInputs {
    /// Handle inputs the ledger refused (stale, duplicate, cancelled).
    pub handle_inputs: u64,
    /// Notification payloads that did not decode.
    pub malformed_notifications: u64,
    /// Notifications that decoded but matched no request the ledger accepts.
    pub notifications: u64,
    /// Of those, reads refused because this engine did not lend what they
    /// read under the incarnation they named.
    pub not_lent_reads: u64,
    /// Of those, writers' words refused because the blocks written were
    /// not their receive's (or the receive's blocks may hold another
    /// write's bytes).
    pub not_lent_writes: u64,
    /// Heartbeats for no live write or lend.
    pub heartbeats: u64,
    /// Retires the ledger refused.
    pub retires: u64,
    /// Release retries that failed again.
    pub release_retries: u64,
    /// Peer metadata refused as unauthenticated (an engine key missing on
    /// one side, or differing).
    pub unauthenticated_peers: u64,
    /// Notification messages without a valid tag of this engine's key.
    pub unauthenticated_notifications: u64,
    /// Notification messages that were copies of one received before.
    pub replayed_notifications: u64,
}

/// One ring between the engine thread and a poller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingMetrics {
    /// Which ring (`commands`, `events`, …).
    pub ring: String,
    /// Poller index.
    pub poller: u32,
    /// Entries it holds.
    pub capacity: u64,
    /// Entries in it when the snapshot was taken.
    pub occupancy: u64,
    /// Entries that went to the overflow because the ring was full.
    pub overflowed: u64,
}

/// Ledger slots.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlotUse {
    /// Slots in the ledger.
    pub capacity: u64,
    /// Slots holding a live or not yet retired request.
    pub in_use: u64,
    /// Of those, receives whose lease ran out while a named writer
    /// had not spoken: quarantined, their blocks held until it does or is
    /// lost.
    pub quarantined: u64,
}

/// Submit → report latency, per request kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RequestLatency {
    /// Reads (and receives).
    pub read: LatencyHistogram,
    /// Writes (push).
    pub write: LatencyHistogram,
    /// Lends (pull sources).
    pub lend: LatencyHistogram,
}

/// Every figure an operator scrapes, as plain data.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MetricsSnapshot {
    /// Per poller, in poller order.
    pub pollers: Vec<PollerMetrics>,
    /// Requests reported, by outcome.
    pub requests: RequestOutcomes,
    /// Handle failures, by cause.
    pub handle_failures: HandleFailures,
    /// Refused inputs, by kind.
    pub rejected: RejectedInputs,
    /// The rings' occupancy and overflow.
    pub rings: Vec<RingMetrics>,
    /// Ledger slots.
    pub slots: SlotUse,
    /// Submit → report latency, per kind.
    pub latency: RequestLatency,
    /// Releases of handles that failed (each handle is held and retried).
    pub release_failures: u64,
}

/// Adds `from`'s fields into `into`'s, field by field.
macro_rules! add_fields {
    ($into:expr, $from:expr; $($f:ident),+) => {
        $( $into.$f = $into.$f.wrapping_add($from.$f); )+
    };
}

impl MetricsSnapshot {
    /// Takes in another engine's snapshot as further pollers (rails): its
    /// pollers and rings after these (the rings renumbered to its pollers),
    /// its counts of handle failures, refused inputs, slots, latencies and
    /// release failures added to these. Request outcomes are left as they
    /// are: whoever reports whole requests counts them.
    pub fn absorb(&mut self, other: &MetricsSnapshot) {
        let base = self.pollers.len() as u32;
        self.pollers.extend_from_slice(&other.pollers);
        self.rings.extend(other.rings.iter().map(|r| RingMetrics {
            poller: base + r.poller,
            ..r.clone()
        }));
        add_fields!(self.handle_failures, other.handle_failures;
            transfer, setup, peer_lost, deadline, lease_expired, aborted, peer_stalled,
            shutdown, poller_died, lease_lost, not_lent);
        add_fields!(self.rejected, other.rejected;
            handle_inputs, malformed_notifications, notifications, not_lent_reads,
            not_lent_writes, heartbeats, retires, release_retries, unauthenticated_peers,
            unauthenticated_notifications, replayed_notifications);
        add_fields!(self.slots, other.slots; capacity, in_use, quarantined);
        for (mine, theirs) in [
            (&mut self.latency.read, &other.latency.read),
            (&mut self.latency.write, &other.latency.write),
            (&mut self.latency.lend, &other.latency.lend),
        ] {
            for (a, b) in mine.buckets.iter_mut().zip(&theirs.buckets) {
                *a += b;
            }
            mine.sum_ns = mine.sum_ns.wrapping_add(theirs.sum_ns);
        }
        self.release_failures += other.release_failures;
    }
}

/// What the engine thread counts as it reports: requests by outcome,
/// handle failures by cause, submit → report latency by kind. Plain
/// integers on the engine thread: no lock, no allocation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Tally {
    pub(crate) requests: RequestOutcomes,
    pub(crate) handle_failures: HandleFailures,
    pub(crate) latency: RequestLatency,
}

impl Tally {
    /// A terminal report of a request of `kind`, `elapsed` after its submit.
    pub(crate) fn record(&mut self, kind: Kind, outcome: &Outcome, elapsed: Duration) {
        let r = &mut self.requests;
        match (outcome, kind) {
            (Outcome::Finished, _) => r.finished_recving += 1,
            (Outcome::Failed(_), Kind::Write { .. }) => r.failed_sending += 1,
            (Outcome::Failed(_), Kind::Lend { .. }) => r.expired += 1,
            (Outcome::Failed(_), _) => r.failed_recving += 1,
            (Outcome::SendDone | Outcome::LendReleased, _) => r.finished_sending += 1,
            (Outcome::SendExpired | Outcome::LendExpired, _) => r.expired += 1,
            (Outcome::HandleFailed { .. }, _) => return,
        }
        let ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        match kind {
            Kind::Write { .. } => self.latency.write.record(ns),
            Kind::Lend { .. } => self.latency.lend.record(ns),
            _ => self.latency.read.record(ns),
        }
    }
}

type Labels = Vec<(&'static str, String)>;

/// A counter or gauge family whose values are already known.
#[derive(Debug)]
struct Fixed<V> {
    kind: MetricType,
    rows: Vec<(Labels, V)>,
}

impl<V> Fixed<V> {
    fn new(kind: MetricType) -> Self {
        Fixed {
            kind,
            rows: Vec::new(),
        }
    }

    fn row(&mut self, labels: Labels, v: V) {
        self.rows.push((labels, v));
    }
}

/// What a counter or gauge sample holds.
trait Value: std::fmt::Debug + Send + Sync + 'static {
    fn encode_as(&self, kind: MetricType, e: MetricEncoder<'_>) -> Result<(), std::fmt::Error>;
}

impl Value for u64 {
    fn encode_as(&self, kind: MetricType, mut e: MetricEncoder<'_>) -> Result<(), std::fmt::Error> {
        match kind {
            MetricType::Counter => e.encode_counter::<NoLabelSet, u64, f64>(self, None),
            _ => e.encode_gauge(self),
        }
    }
}

impl Value for f64 {
    fn encode_as(&self, kind: MetricType, mut e: MetricEncoder<'_>) -> Result<(), std::fmt::Error> {
        match kind {
            MetricType::Counter => e.encode_counter::<NoLabelSet, f64, f64>(self, None),
            _ => e.encode_gauge(self),
        }
    }
}

impl<V: Value> EncodeMetric for Fixed<V> {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        for (labels, v) in &self.rows {
            v.encode_as(self.kind, encoder.encode_family(labels)?)?;
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        self.kind
    }

    fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }
}

/// Latency histograms, one per label set, from fixed log2 buckets.
#[derive(Debug)]
struct Histograms {
    rows: Vec<(Labels, LatencyHistogram)>,
}

impl EncodeMetric for Histograms {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        for (labels, h) in &self.rows {
            let buckets: Vec<(f64, u64)> = h
                .buckets
                .iter()
                .enumerate()
                .map(|(i, &n)| {
                    let le = LatencyHistogram::upper_bound_ns(i)
                        .map_or(f64::INFINITY, |ns| ns as f64 / 1e9);
                    (le, n)
                })
                .collect();
            encoder
                .encode_family(labels)?
                .encode_histogram::<NoLabelSet>(h.sum_ns as f64 / 1e9, h.count(), &buckets, None)?;
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

fn label(key: &'static str, value: impl ToString) -> (&'static str, String) {
    (key, value.to_string())
}

/// The snapshot as an OpenMetrics text exposition (serve it with
/// [`OPENMETRICS_CONTENT_TYPE`]). Every name starts `kvpoll_`;
/// times are in seconds, as Prometheus expects.
pub fn render(s: &MetricsSnapshot) -> Result<String, std::fmt::Error> {
    let mut registry = Registry::with_prefix("kvpoll");

    let mut busy = Fixed::<f64>::new(MetricType::Counter);
    let mut idle = Fixed::<f64>::new(MetricType::Counter);
    let mut iterations = Fixed::<u64>::new(MetricType::Counter);
    let mut posted = Fixed::<u64>::new(MetricType::Counter);
    let mut completed = Fixed::<u64>::new(MetricType::Counter);
    let mut bytes = Fixed::<u64>::new(MetricType::Counter);
    let mut notes = Fixed::<u64>::new(MetricType::Counter);
    let mut messages = Fixed::<u64>::new(MetricType::Counter);
    for (i, p) in s.pollers.iter().enumerate() {
        let poller = || vec![label("poller", i)];
        busy.row(poller(), p.busy_ns as f64 / 1e9);
        idle.row(poller(), p.idle_ns as f64 / 1e9);
        iterations.row(
            vec![label("poller", i), label("state", "busy")],
            p.busy_iterations,
        );
        iterations.row(
            vec![label("poller", i), label("state", "idle")],
            p.idle_iterations,
        );
        posted.row(poller(), p.ops_posted);
        completed.row(poller(), p.ops_completed);
        bytes.row(poller(), p.bytes);
        notes.row(poller(), p.notifications_sent);
        messages.row(poller(), p.notification_messages);
    }
    registry.register(
        "poller_busy_seconds",
        "Time the poller spent in iterations that did work",
        busy,
    );
    registry.register(
        "poller_idle_seconds",
        "Time the poller spent in iterations that found nothing to do",
        idle,
    );
    registry.register(
        "poller_iterations",
        "Poller loop iterations, by whether they did work",
        iterations,
    );
    registry.register("poller_operations_posted", "UCX operations posted", posted);
    registry.register(
        "poller_operations_completed",
        "UCX operations completed, successfully or not",
        completed,
    );
    registry.register("poller_bytes", "Bytes moved by completed operations", bytes);
    registry.register(
        "poller_notifications_sent",
        "Notifications sent to other engines",
        notes,
    );
    registry.register(
        "poller_notification_messages",
        "Messages the notifications travelled in (those for one endpoint at once share one)",
        messages,
    );

    let r = &s.requests;
    let mut requests = Fixed::<u64>::new(MetricType::Counter);
    for (outcome, n) in [
        ("finished_recving", r.finished_recving),
        ("failed_recving", r.failed_recving),
        ("finished_sending", r.finished_sending),
        ("failed_sending", r.failed_sending),
        ("expired", r.expired),
    ] {
        requests.row(vec![label("outcome", outcome)], n);
    }
    registry.register("requests", "Requests reported, by outcome", requests);

    let mut failures = Fixed::<u64>::new(MetricType::Counter);
    for (cause, n) in s.handle_failures.rows() {
        failures.row(vec![label("cause", cause)], n);
    }
    registry.register("handle_failures", "Handle failures, by cause", failures);

    let x = &s.rejected;
    let mut rejected = Fixed::<u64>::new(MetricType::Counter);
    for (kind, n) in [
        ("handle_input", x.handle_inputs),
        ("malformed_notification", x.malformed_notifications),
        ("notification", x.notifications),
        ("not_lent_read", x.not_lent_reads),
        ("not_lent_write", x.not_lent_writes),
        ("heartbeat", x.heartbeats),
        ("retire", x.retires),
        ("release_retry", x.release_retries),
        ("unauthenticated_peer", x.unauthenticated_peers),
        (
            "unauthenticated_notification",
            x.unauthenticated_notifications,
        ),
        ("replayed_notification", x.replayed_notifications),
    ] {
        rejected.row(vec![label("kind", kind)], n);
    }
    registry.register(
        "rejected_inputs",
        "Inputs refused and dropped (nothing changed), by kind",
        rejected,
    );
    let mut release_failures = Fixed::<u64>::new(MetricType::Counter);
    release_failures.row(Vec::new(), s.release_failures);
    registry.register(
        "release_failures",
        "Handle releases that failed (the handle is held and retried)",
        release_failures,
    );

    let mut capacity = Fixed::<u64>::new(MetricType::Gauge);
    let mut occupancy = Fixed::<u64>::new(MetricType::Gauge);
    let mut overflowed = Fixed::<u64>::new(MetricType::Counter);
    for ring in &s.rings {
        let labels = || vec![label("ring", &ring.ring), label("poller", ring.poller)];
        capacity.row(labels(), ring.capacity);
        occupancy.row(labels(), ring.occupancy);
        overflowed.row(labels(), ring.overflowed);
    }
    registry.register("ring_capacity", "Entries a ring holds", capacity);
    registry.register("ring_occupancy", "Entries in a ring", occupancy);
    registry.register(
        "ring_overflowed",
        "Entries that went to the overflow because the ring was full",
        overflowed,
    );

    let mut slots = Fixed::<u64>::new(MetricType::Gauge);
    slots.row(vec![label("state", "capacity")], s.slots.capacity);
    slots.row(vec![label("state", "in_use")], s.slots.in_use);
    slots.row(vec![label("state", "quarantined")], s.slots.quarantined);
    registry.register("ledger_slots", "Ledger request slots", slots);

    let l = &s.latency;
    registry.register(
        "request_latency_seconds",
        "Submit to report latency of requests, by kind",
        Histograms {
            rows: vec![
                (vec![label("kind", "read")], l.read),
                (vec![label("kind", "write")], l.write),
                (vec![label("kind", "lend")], l.lend),
            ],
        },
    );

    let mut out = String::new();
    encode(&mut out, &registry)?;
    Ok(out)
}

/// The snapshot in the Prometheus text format 0.0.4 (serve it with
/// [`TEXT_CONTENT_TYPE`]): [`render`]'s samples, with each counter's `HELP`
/// and `TYPE` naming its `_total` series and without the OpenMetrics `EOF`
/// marker.
pub fn render_text(s: &MetricsSnapshot) -> Result<String, std::fmt::Error> {
    let open = render(s)?;
    let counters: Vec<&str> = open
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(open.len() + 16 * counters.len());
    for line in open.lines() {
        if line == "# EOF" {
            continue;
        }
        let descriptor = ["# HELP ", "# TYPE "].into_iter().find_map(|p| {
            let rest = line.strip_prefix(p)?;
            let (name, tail) = rest.split_once(' ')?;
            counters.contains(&name).then_some((p, name, tail))
        });
        match descriptor {
            Some((p, name, tail)) => {
                out.push_str(p);
                out.push_str(name);
                out.push_str("_total ");
                out.push_str(tail);
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Outcomes;

    #[test]
    fn bucket_bounds_are_powers_of_two_from_256_ns_and_the_last_is_open() {
        assert_eq!(LatencyHistogram::bucket_of(0), 0);
        assert_eq!(LatencyHistogram::bucket_of(256), 0);
        assert_eq!(LatencyHistogram::bucket_of(257), 1);
        assert_eq!(LatencyHistogram::bucket_of(512), 1);
        assert_eq!(LatencyHistogram::bucket_of(u64::MAX), LATENCY_BUCKETS - 1);
        assert_eq!(LatencyHistogram::upper_bound_ns(0), Some(256));
        assert_eq!(LatencyHistogram::upper_bound_ns(3), Some(2048));
        assert_eq!(LatencyHistogram::upper_bound_ns(LATENCY_BUCKETS - 1), None);
        for ns in [1u64, 300, 4096, 4097, 1 << 30, (1 << 38) + 1] {
            let i = LatencyHistogram::bucket_of(ns);
            if let Some(hi) = LatencyHistogram::upper_bound_ns(i) {
                assert!(ns <= hi, "{ns} above bucket {i}'s bound {hi}");
            }
            if i > 0 {
                let lo = LatencyHistogram::upper_bound_ns(i - 1).unwrap();
                assert!(ns > lo, "{ns} belongs below bucket {i}");
            }
        }
    }

    #[test]
    fn rendered_histogram_buckets_are_cumulative_in_seconds_and_end_at_inf() {
        let mut s = MetricsSnapshot::default();
        s.latency.write.record(200);
        s.latency.write.record(300);
        s.latency.write.record(u64::MAX / 2);
        let text = render(&s).unwrap();
        let write = |suffix: &str| {
            text.lines()
                .find(|l| {
                    l.starts_with("kvpoll_request_latency_seconds_")
                        && l.contains("kind=\"write\"")
                        && l.contains(suffix)
                })
                .unwrap_or_else(|| panic!("{suffix}: {text}"))
                .to_owned()
        };
        assert!(write("le=\"2.56e-7\"").ends_with(" 1"), "{text}");
        assert!(write("le=\"5.12e-7\"").ends_with(" 2"), "{text}");
        assert!(write("le=\"+Inf\"").ends_with(" 3"), "{text}");
        assert!(write("_count").ends_with(" 3"), "{text}");
    }

    #[test]
    fn counting_outcomes_adds_requests_by_outcome_and_failures_by_cause() {
        use crate::ledger::{Reason, RequestId};
        let mut out = Outcomes::default();
        out.finished_recving.push(RequestId(1));
        out.finished_sending.extend([RequestId(2), RequestId(3)]);
        out.expired.push(RequestId(4));
        out.handle_failures
            .push((RequestId(5), 0, Reason::new(Cause::PeerLost, -1)));
        let mut s = MetricsSnapshot::default();
        s.count(&out);
        s.count(&out);
        assert_eq!(
            s.requests,
            RequestOutcomes {
                finished_recving: 2,
                failed_recving: 0,
                finished_sending: 4,
                failed_sending: 0,
                expired: 2
            }
        );
        assert_eq!(s.handle_failures.peer_lost, 2);
        let text = render(&s).unwrap();
        assert!(
            text.contains("kvpoll_requests_total{outcome=\"finished_sending\"} 4"),
            "{text}"
        );
        assert!(
            text.contains("kvpoll_handle_failures_total{cause=\"peer_lost\"} 2"),
            "{text}"
        );
    }

    #[test]
    fn every_family_has_help_and_type_and_empty_ring_families_are_left_out() {
        let text = render(&MetricsSnapshot::default()).unwrap();
        for family in [
            "kvpoll_requests",
            "kvpoll_handle_failures",
            "kvpoll_rejected_inputs",
            "kvpoll_ledger_slots",
            "kvpoll_request_latency_seconds",
        ] {
            assert!(
                text.contains(&format!("# HELP {family} ")),
                "{family}: {text}"
            );
            assert!(
                text.contains(&format!("# TYPE {family} ")),
                "{family}: {text}"
            );
        }
        assert!(!text.contains("kvpoll_ring_"), "{text}");
    }

    #[test]
    fn text_format_names_counter_series_in_help_and_type_and_keeps_every_sample() {
        let mut s = MetricsSnapshot::default();
        s.pollers.push(PollerMetrics::default());
        s.latency.lend.record(1000);
        let open = render(&s).unwrap();
        let text = render_text(&s).unwrap();
        assert!(
            text.contains("# TYPE kvpoll_requests_total counter\n"),
            "{text}"
        );
        assert!(
            text.contains("# HELP kvpoll_requests_total Requests"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE kvpoll_ledger_slots gauge\n"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE kvpoll_request_latency_seconds histogram\n"),
            "{text}"
        );
        assert!(!text.contains("# EOF"), "{text}");
        let samples = |t: &str| -> Vec<String> {
            t.lines()
                .filter(|l| !l.starts_with('#'))
                .map(str::to_owned)
                .collect()
        };
        assert_eq!(samples(&open), samples(&text));
    }
}
