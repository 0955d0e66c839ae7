//! Latency figures of the engine, measured in one run next to their
//! physical anchor (docs/design.md §6):
//!
//! - **cache-line round trip**: two threads (pinned to two cores when the
//!   machine has them) bounce one `AtomicU64`; the time of one round trip is
//!   the floor of any cross-core handoff.
//! - **completion → visible**: the poller thread feeds a handle completion
//!   to the ledger (which publishes the request's report on the event ring)
//!   and the engine thread, spinning on the ring, sees it. One request at a
//!   time; each sample is one completion. Both ends read the same monotonic
//!   clock (`Instant`), whose own cost (~20 ns a read) is included.
//! - **`Engine::poll` with nothing new**: a real engine, nothing in flight.
//!
//! Used by `kvpoll bench engine`; the library's `benches/rings.rs`,
//! `benches/ledger.rs` and `benches/engine.rs` measure the round trips and
//! the idle poll with criterion.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpoll::ledger::{Begun, HandleKey, Kind, Ledger, LedgerConfig, Nanos, Request};
use kvpoll::{Engine, IdlePolicy, Outcomes, PeerId, RequestId};

use crate::RunError;

/// The figures of one run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineFigures {
    /// Cache-line round trip between the two threads, median, ns.
    pub cache_line_round_trip_ns: f64,
    /// Completion → visible to the engine thread, median, ns.
    pub completion_visible_p50_ns: f64,
    /// Completion → visible, 99th percentile, ns.
    pub completion_visible_p99_ns: f64,
    /// p50 over the round trip (target ≤ 1.5).
    pub ratio_p50: f64,
    /// `Engine::poll` with nothing new, ns a call.
    pub poll_idle_ns: f64,
    /// Whether the two threads were pinned to distinct cores.
    pub pinned: bool,
}

impl EngineFigures {
    /// One JSON object.
    pub fn to_json(&self) -> String {
        format!(
            "{{\"cache_line_round_trip_ns\":{:.1},\"completion_visible_p50_ns\":{:.1},\"completion_visible_p99_ns\":{:.1},\"ratio_p50\":{:.3},\"target_ratio_p50\":1.5,\"poll_idle_ns\":{:.2},\"target_poll_idle_ns\":20,\"pinned\":{}}}",
            self.cache_line_round_trip_ns,
            self.completion_visible_p50_ns,
            self.completion_visible_p99_ns,
            self.ratio_p50,
            self.poll_idle_ns,
            self.pinned
        )
    }
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Pins the calling thread to `core` if the machine has more than one;
/// returns whether it did.
fn try_pin(core: usize) -> bool {
    cores() > 1 && kvpoll::placement::pin_current_thread(core % cores(), IdlePolicy::Busy).is_ok()
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i] as f64
}

/// `trips` round trips of `line` from the measuring end: store the next odd
/// value (after `v`), wait for the echo's even one; how long they took.
fn ping(line: &AtomicU64, v: &mut u64, trips: u64) -> Duration {
    let t = Instant::now();
    for _ in 0..trips {
        line.store(*v + 1, Ordering::Release);
        while line.load(Ordering::Acquire) != *v + 2 {
            std::hint::spin_loop();
        }
        *v += 2;
    }
    t.elapsed()
}

/// A read of request `id` from `peers` with no blocks, never expiring:
/// the request the hand-off figures feed through the ledger.
pub fn bare_read(id: u64, peers: &[PeerId]) -> Request<'_> {
    Request {
        id: RequestId(id),
        kind: Kind::Read,
        peers,
        blocks: &[],
        expires: Nanos(u64::MAX),
    }
}

/// Cache-line round trips and completion → visible latencies measured by
/// the same two threads, alternately, round by round (see [`handoff`]).
#[derive(Debug, Clone, Default)]
pub struct Handoff {
    /// Each round's cache-line round trip, ns (the mean of its trips).
    pub round_trip_ns: Vec<f64>,
    /// Each round's completion → visible latencies, ns.
    pub completion_visible_ns: Vec<Vec<u64>>,
    /// Whether the two threads were pinned to distinct cores.
    pub pinned: bool,
}

impl Handoff {
    /// The median round's round trip, ns.
    pub fn round_trip_p50(&self) -> f64 {
        median_f64(self.round_trip_ns.clone())
    }

    /// Every completion → visible latency, ns, unsorted.
    pub fn samples(&self) -> Vec<u64> {
        self.completion_visible_ns
            .iter()
            .flatten()
            .copied()
            .collect()
    }

    /// The median over rounds of (the round's completion → visible p50 /
    /// the round's round trip): each ratio compares two figures taken
    /// under one placement of the two threads. NaN without rounds.
    pub fn ratio_p50(&self) -> f64 {
        let ratios = self
            .round_trip_ns
            .iter()
            .zip(&self.completion_visible_ns)
            .filter(|(rtt, lat)| **rtt > 0.0 && !lat.is_empty())
            .map(|(rtt, lat)| quantile(lat, 0.5) / rtt)
            .collect();
        median_f64(ratios)
    }
}

fn median_f64(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_unstable_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The clock a hand-off sample is stamped with: the CPU's time-stamp
/// counter where the kernel itself keeps time with it (x86-64, clock
/// source `tsc`: synchronised across cores, ~12 ns a read here), else
/// `Instant` (~31 ns a read here, most of it inside each sample: a third of
/// a ~80 ns round trip). Ticks are turned into nanoseconds with a rate
/// measured against `Instant` over the run.
#[derive(Clone, Copy)]
struct Stamps {
    epoch: Instant,
    tsc: bool,
}

impl Stamps {
    fn new() -> Self {
        let tsc = cfg!(target_arch = "x86_64")
            && std::fs::read_to_string(
                "/sys/devices/system/clocksource/clocksource0/current_clocksource",
            )
            .is_ok_and(|s| s.trim() == "tsc");
        Stamps {
            epoch: Instant::now(),
            tsc,
        }
    }

    /// Now, in ticks (TSC) or nanoseconds since the epoch (`Instant`).
    #[inline]
    fn now(&self) -> u64 {
        #[cfg(target_arch = "x86_64")]
        if self.tsc {
            // SAFETY: RDTSC has no preconditions on x86-64.
            return unsafe { core::arch::x86_64::_rdtsc() };
        }
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Nanoseconds a tick, from two (stamp, `Instant`) pairs far apart.
    fn ns_per_tick(&self, from: (u64, Instant), to: (u64, Instant)) -> f64 {
        let ticks = to.0.saturating_sub(from.0);
        if !self.tsc || ticks == 0 {
            return 1.0;
        }
        to.1.duration_since(from.1).as_nanos() as f64 / ticks as f64
    }
}

/// Completion → visible next to the cache-line round trip, measured by the
/// same two threads (pinned to two cores when the machine has them) in
/// `rounds` alternating rounds: `trips` round trips of one line, timed
/// together, then `per_round` completions, each timed alone. On a VM the
/// two vCPUs' placement on the host changes while a run goes on (the
/// round trip here ranges from ~30 ns to ~500 ns between runs and within
/// one), so two figures measured one after the other can compare
/// different machines; round by round they compare the same one.
///
/// A completion: the poller thread feeds a handle completion to the
/// ledger, which publishes the request's report on the event ring, and the
/// engine thread, spinning on the ring, sees it. Each end reads the same
/// clock (`Stamps`: the time-stamp counter where the kernel keeps time with
/// it, else `Instant`; its own cost is included) and keeps its times to
/// itself until the run ends, so the timing moves no cache line between
/// the threads.
pub fn handoff(rounds: usize, trips: u64, per_round: usize) -> Handoff {
    let Ok(mut ledger) = Ledger::new(LedgerConfig {
        slots: 64,
        max_blocks: 4,
    }) else {
        return Handoff::default();
    };
    let slots = ledger.slots().clone();
    let (mut tx, mut rx) = kvpoll::ring::events::<kvpoll::ledger::Event>(1024, 1024);
    let (mut back, mut retired_keys) = kvpoll::ring::commands::<kvpoll::ledger::RequestKey>(64);
    let clock = Stamps::new();
    let start = (clock.now(), Instant::now());
    let line = Arc::new(crossbeam_utils::CachePadded::new(AtomicU64::new(0)));
    let seen = Arc::new(AtomicU64::new(0));
    // Set when the poller thread stops early; each spin looks at it.
    let gave_up = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (line2, seen2, gave_up2) = (line.clone(), seen.clone(), gave_up.clone());
    let engine_slots = slots.clone();
    let engine = std::thread::spawn(move || {
        let pinned = try_pin(0);
        let mut out = Vec::with_capacity(rounds);
        let mut invalid = Vec::new();
        let mut expect = 1u64;
        let mut answered = 0u64;
        'rounds: for _ in 0..rounds {
            // Answer each odd value with the next even one.
            for _ in 0..trips {
                while line2.load(Ordering::Acquire) != expect {
                    if gave_up2.load(Ordering::Relaxed) {
                        break 'rounds;
                    }
                    std::hint::spin_loop();
                }
                line2.store(expect + 1, Ordering::Release);
                expect += 2;
            }
            let mut lat = Vec::with_capacity(per_round);
            while lat.len() < per_round {
                if let Some(ev) = rx.recv() {
                    lat.push(clock.now());
                    let _ = engine_slots.blocks_to_invalidate(ev.key, &mut invalid);
                    let _ = back.send(ev.key);
                    answered += 1;
                    seen2.store(answered, Ordering::Release);
                } else if gave_up2.load(Ordering::Relaxed) {
                    break 'rounds;
                } else {
                    std::hint::spin_loop();
                }
            }
            out.push(lat);
        }
        (out, pinned)
    });
    let poller = std::thread::spawn(move || {
        let pinned = try_pin(1);
        let peers = [PeerId(0)];
        let mut round_trips = Vec::with_capacity(rounds);
        // When each completion was fed, kept here until both threads end:
        // the engine thread never reads it, so no line of it moves between
        // the two while a sample is timed.
        let mut stamps = Vec::with_capacity(rounds * per_round);
        let mut v = 0u64;
        let mut i = 0u64;
        let give_up = |round_trips, stamps| {
            gave_up.store(true, Ordering::Relaxed);
            (round_trips, stamps, pinned)
        };
        for _ in 0..rounds {
            let t = ping(&line, &mut v, trips);
            round_trips.push(t.as_nanos() as f64 / trips.max(1) as f64);
            for _ in 0..per_round {
                let req = bare_read(i, &peers);
                let mut publish = |e| {
                    let _ = tx.publish(e);
                };
                let hk = match ledger.begin(&req, &mut publish) {
                    Ok(Begun::Tracked(k)) => HandleKey::new(k, 0),
                    _ => None,
                };
                let Some(hk) = hk else {
                    return give_up(round_trips, stamps);
                };
                let _ = slots.posting(hk);
                stamps.push(clock.now());
                let _ = slots.completed(hk, Ok(()), &mut publish);
                while seen.load(Ordering::Acquire) < i + 1 {
                    std::hint::spin_loop();
                }
                while let Some(k) = retired_keys.recv() {
                    let _ = ledger.retire(k);
                }
                i += 1;
            }
        }
        (round_trips, stamps, pinned)
    });
    let (round_trip_ns, stamps, poller_pinned) = poller.join().unwrap_or_default();
    let (mut completion_visible_ns, engine_pinned) = engine.join().unwrap_or_default();
    // A round the poller did not finish has no pair.
    completion_visible_ns.truncate(round_trip_ns.len());
    // Receive times less feed times, in order (one request at a time).
    let ns_per_tick = clock.ns_per_tick(start, (clock.now(), Instant::now()));
    let mut fed = stamps.iter();
    for round in &mut completion_visible_ns {
        for t in round.iter_mut() {
            *t = fed.next().map_or(0, |&s| {
                (t.saturating_sub(s) as f64 * ns_per_tick).round() as u64
            });
        }
    }
    let round_trip_ns = if trips == 0 {
        Vec::new()
    } else {
        round_trip_ns
    };
    Handoff {
        round_trip_ns,
        completion_visible_ns,
        pinned: poller_pinned && engine_pinned,
    }
}

/// `Engine::poll` with nothing new, ns a call, over `calls` calls.
pub fn poll_idle(calls: u64) -> Result<f64, RunError> {
    let mut engine = Engine::builder().build()?;
    let mut out = Outcomes::default();
    for _ in 0..1000 {
        engine.poll(&mut out);
    }
    let t = Instant::now();
    let mut n = 0usize;
    for _ in 0..calls {
        n += engine.poll(std::hint::black_box(&mut out));
    }
    let ns = t.elapsed().as_nanos() as f64 / calls as f64;
    std::hint::black_box(n);
    engine.shutdown();
    Ok(ns)
}

/// Share of one core the poller thread of an engine with this idle policy
/// uses over `quiet` with nothing to do (0.0–1.0); `None` where the
/// poller's CPU time cannot be read.
pub fn idle_cpu(idle: IdlePolicy, quiet: Duration) -> Result<Option<f64>, RunError> {
    let mut engine = Engine::builder().idle(idle).build()?;
    // Let it settle into its idle state first.
    std::thread::sleep(Duration::from_millis(50));
    let (Some(c0), t0) = (engine.poller_cpu_time(), Instant::now()) else {
        engine.shutdown();
        return Ok(None);
    };
    std::thread::sleep(quiet);
    let c1 = engine.poller_cpu_time();
    let wall = t0.elapsed();
    engine.shutdown();
    Ok(c1.map(|c1| (c1 - c0).as_secs_f64() / wall.as_secs_f64()))
}

/// Wake-up latency of an adaptive poller, ns, `n` samples: after a quiet
/// spell long enough for the poller to park, a request with nothing to
/// move (a prefix hit) is submitted and the time until [`Engine::poll`]
/// reports it is one sample (engine → poller → engine).
pub fn wake_up(n: usize, quiet: Duration) -> Result<Vec<u64>, RunError> {
    let mut engine = Engine::builder().idle(IdlePolicy::Adaptive).build()?;
    let mut out = Outcomes::default();
    let mut samples = Vec::with_capacity(n);
    for i in 0..n as u64 {
        std::thread::sleep(quiet);
        out.clear();
        let t = Instant::now();
        engine.read(RequestId(i), &[])?;
        while out.finished_recving.is_empty() {
            engine.poll(&mut out);
            // Yield, as the park/unpark baseline does: the woken thread is
            // often placed on the waiter's CPU, and a spinning waiter holds
            // it for a whole slice (~4 ms measured with perf sched on a
            // loaded 2-vCPU machine).
            std::thread::yield_now();
            if t.elapsed() > Duration::from_secs(10) {
                engine.shutdown();
                return Err(RunError::Stuck("a prefix hit was not reported in 10 s"));
            }
        }
        samples.push(t.elapsed().as_nanos() as u64);
    }
    engine.shutdown();
    Ok(samples)
}

/// The OS floor of a wake-up, ns, `n` samples: after a quiet spell, one
/// thread unparks another that is parked (`std::thread::park`), which
/// answers through an atomic the first polls (yielding between looks);
/// one sample is unpark → answer seen. The same shape as [`wake_up`] (one
/// OS wake, the waiter polling the way back) with nothing else.
pub fn park_unpark(n: usize, quiet: Duration) -> Vec<u64> {
    let seen = Arc::new(AtomicU64::new(0));
    let seen2 = seen.clone();
    let sleeper = std::thread::spawn(move || {
        let mut answered = 0u64;
        while answered < n as u64 {
            std::thread::park();
            // Spurious wakes are allowed: answer only a new round.
            let round = answered + 1;
            if seen2.load(Ordering::Acquire) == u64::MAX - round {
                seen2.store(round, Ordering::Release);
                answered = round;
            }
        }
    });
    let mut samples = Vec::with_capacity(n);
    for round in 1..=n as u64 {
        std::thread::sleep(quiet);
        seen.store(u64::MAX - round, Ordering::Release);
        let t = Instant::now();
        sleeper.thread().unpark();
        while seen.load(Ordering::Acquire) != round {
            std::thread::yield_now();
        }
        samples.push(t.elapsed().as_nanos() as u64);
    }
    let _ = sleeper.join();
    samples
}

/// Wake-up of an adaptive poller on a *remote* event, ns, `n` samples:
/// engine P lends a block to one reader; engine C connects to it over
/// `tls`; both adaptive. After a quiet spell long enough for both pollers
/// to block, C sends the read-done notification (`notify_only`) and the
/// time until `P.poll` reports the lend released is one sample: C's
/// wake-up on the submit, the send, P's wake-up on its worker's event fd,
/// P's report. Two wake-ups, so an upper bound of the remote one. (A busy
/// C would leave only P's, but on a 2-core machine its spinning thread and
/// the measuring one starve P's poller.)
pub fn remote_wake_up(n: usize, quiet: Duration, tls: &str) -> Result<Vec<u64>, RunError> {
    let options = kvpoll::ContextOptions::with_transports(tls);
    let mut p = Engine::builder()
        .idle(IdlePolicy::Adaptive)
        .ucx(options.clone())
        .build()?;
    p.register(4)?;
    let mut c = Engine::builder()
        .idle(IdlePolicy::Adaptive)
        .ucx(options)
        .build()?;
    c.register(4)?;
    let peer = c.add_peer(&p.local_metadata()?)?;
    let mut out = Outcomes::default();
    let guard = Duration::from_secs(10);
    // Round 0 wires the endpoint up; it is not counted.
    let mut samples = Vec::with_capacity(n);
    for i in 0..=n as u64 {
        let id = RequestId(i);
        let lend = p.lend(id, &[kvpoll::BlockId(0)], 1, guard)?;
        std::thread::sleep(quiet);
        out.clear();
        let t = Instant::now();
        c.notify_only(id, &[(peer, lend)])?;
        wait_released(&mut p, &mut out, id, t, guard, || {})?;
        if i > 0 {
            samples.push(t.elapsed().as_nanos() as u64);
        }
    }
    c.shutdown();
    p.shutdown();
    Ok(samples)
}

/// Polls lender `p` until it reports lend `id` released (`also` runs
/// first each time round), yielding between looks as `wake_up`'s waiter
/// does; an error past `guard` from `t`.
fn wait_released(
    p: &mut Engine,
    out: &mut Outcomes,
    id: RequestId,
    t: Instant,
    guard: Duration,
    mut also: impl FnMut(),
) -> Result<(), RunError> {
    while !out.finished_sending.contains(&id) {
        also();
        p.poll(out);
        std::thread::yield_now();
        if t.elapsed() > guard {
            return Err(RunError::Stuck("a lend was not released in 10 s"));
        }
    }
    Ok(())
}

/// Wake-up of an adaptive poller on a remote notification alone, ns, `n`
/// samples: engine P lends a block to one reader; the measuring thread
/// holds a plain UCX worker connected to P over `tls` and, after a quiet
/// spell long enough for P's poller to block, sends it the reader's
/// give-up notification itself (an eager active message, as a reader's
/// poller sends it); one sample is send → `P.poll` reports the lend
/// released. One kvpoll wake-up (P's poller, on its worker's event fd),
/// where [`remote_wake_up`] chains two (the reader's poller on its
/// submit, then P's). Over tcp UCX's async thread relays the event to the
/// worker's fd (adaptive progress; kvpoll turns it off on shared-memory
/// transport lists): a thread wake-up that is UCX's.
pub fn remote_wake_up_direct(n: usize, quiet: Duration, tls: &str) -> Result<Vec<u64>, RunError> {
    use kvpoll::notification::{NoteKind, Notification};
    use kvpoll::transport::ucx::{Context, Endpoint, Worker, NOTIFY_AM_ID};
    let options = kvpoll::ContextOptions::with_transports(tls);
    let mut p = Engine::builder()
        .idle(IdlePolicy::Adaptive)
        .ucx(options.clone())
        .build()?;
    p.register(4)?;
    let meta = kvpoll::metadata::PeerMetadata::decode(&p.local_metadata()?)
        .map_err(|_| RunError::Stuck("own metadata does not decode"))?;
    let ucx = |_| RunError::Stuck("raw UCX sender could not start");
    let ctx = Context::new(&options).map_err(ucx)?;
    let worker = Worker::new(&ctx).map_err(ucx)?;
    let ep = Endpoint::connect(&worker, &meta.worker, 1).map_err(ucx)?;
    let mut out = Outcomes::default();
    let guard = Duration::from_secs(10);
    let mut done = Vec::new();
    // Round 0 wires the endpoint up; it is not counted.
    let mut samples = Vec::with_capacity(n);
    for i in 0..=n as u64 {
        let id = RequestId(i);
        let incarnation = p.lend(id, &[kvpoll::BlockId(0)], 1, guard)?;
        let note = Notification {
            kind: NoteKind::GaveUp,
            id,
            incarnation,
            nonce: kvpoll::Incarnation::NONE,
            sender: 0x5eed,
            blocks: Default::default(),
        }
        .encode();
        // Let the lend in, the sender's own send of the last round end,
        // and P's poller block.
        std::thread::sleep(quiet);
        worker.progress();
        out.clear();
        let t = Instant::now();
        ep.send_active_message(NOTIFY_AM_ID, &note, i)
            .map_err(|_| RunError::Stuck("raw UCX send failed"))?;
        // Progress the sender (a send over tcp may need it), then look.
        wait_released(&mut p, &mut out, id, t, guard, || {
            worker.progress();
        })?;
        if i > 0 {
            samples.push(t.elapsed().as_nanos() as u64);
        }
        done.clear();
        worker.take_completions(&mut done);
    }
    drop(ep);
    p.shutdown();
    Ok(samples)
}

/// The `p` quantile (0.0–1.0) of unsorted samples.
pub fn quantile(samples: &[u64], p: f64) -> f64 {
    let mut v = samples.to_vec();
    v.sort_unstable();
    percentile(&v, p)
}

/// Every figure, in one run: the hand-off figures in `rounds` rounds of
/// 2 000 round trips and `per_round` completions ([`handoff`]).
pub fn measure(rounds: usize, per_round: usize) -> Result<EngineFigures, RunError> {
    let h = handoff(rounds, 2_000, per_round);
    let mut lat = h.samples();
    lat.sort_unstable();
    let poll = poll_idle(2_000_000)?;
    // Let the OS settle the poller thread we just stopped.
    std::thread::sleep(Duration::from_millis(1));
    Ok(EngineFigures {
        cache_line_round_trip_ns: h.round_trip_p50(),
        completion_visible_p50_ns: percentile(&lat, 0.5),
        completion_visible_p99_ns: percentile(&lat, 0.99),
        ratio_p50: h.ratio_p50(),
        poll_idle_ns: poll,
        pinned: h.pinned,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_cpu_and_wake_ups_produce_figures() {
        let busy = idle_cpu(IdlePolicy::Busy, Duration::from_millis(50)).unwrap();
        if let Some(b) = busy {
            assert!(b > 0.0, "a busy poller used no CPU");
        }
        let w = wake_up(3, Duration::from_millis(5)).unwrap();
        assert_eq!(w.len(), 3);
        assert_eq!(park_unpark(3, Duration::from_millis(1)).len(), 3);
        let r = remote_wake_up(2, Duration::from_millis(5), "posix,sysv,cma").unwrap();
        assert_eq!(r.len(), 2);
        assert!(w.iter().all(|&ns| ns > 0));
        assert!(quantile(&w, 0.5) > 0.0);
    }

    #[test]
    fn every_completion_becomes_visible_once() {
        let lat: Vec<u64> = handoff(1, 0, 200)
            .completion_visible_ns
            .into_iter()
            .flatten()
            .collect();
        assert_eq!(lat.len(), 200);
        assert!(
            lat.iter().all(|&ns| ns > 0),
            "a latency of 0: the stamps were not paired"
        );
    }

    #[test]
    fn handoff_rounds_pair_a_round_trip_with_their_completions() {
        let h = handoff(4, 100, 50);
        assert_eq!(h.round_trip_ns.len(), 4);
        assert_eq!(h.completion_visible_ns.len(), 4);
        assert!(h.completion_visible_ns.iter().all(|r| r.len() == 50));
        assert!(h.round_trip_ns.iter().all(|&ns| ns > 0.0));
        assert_eq!(h.samples().len(), 200);
        let r = h.ratio_p50();
        assert!(r.is_finite() && r > 0.0, "ratio {r}");
        // The ratio is the median of the rounds' own ratios.
        let mut own: Vec<f64> = (0..4)
            .map(|i| quantile(&h.completion_visible_ns[i], 0.5) / h.round_trip_ns[i])
            .collect();
        own.sort_unstable_by(f64::total_cmp);
        assert_eq!(r, own[2]);
    }
}
