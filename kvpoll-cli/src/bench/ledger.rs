//! Throughput of the ledger against a locked tracker, measured in one run.
//!
//! Both move the same work from a poller thread to an engine thread: requests
//! of `handles` handles begin in batches of `window`; their handles complete
//! in an order drawn from the seeded transport simulator; when a request's
//! last handle completes it is handed to the engine thread, which retires it.
//!
//! - **ledger**: [`kvpoll::ledger::Ledger`] + `kvpoll::ring::events`; the
//!   engine thread polls the event ring and hands each reported key back
//!   over a second ring; the poller retires them when it needs slots.
//! - **locked**: a `Mutex<HashMap<request, Vec<handle state>>>` plus a
//!   finished list under the same lock; the engine thread polls the finished
//!   list. Same bookkeeping: per-handle state, deferred failure check, one
//!   report per request.
//!
//! Both wait with the same `Backoff` (spin, then yield) when the other
//! thread is behind, so that neither burns a shared core waiting.
//!
//! Used by `kvpoll bench ledger`; the library's `benches/ledger.rs` measures
//! the same comparison with criterion.

use std::collections::HashMap;
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

use crossbeam_utils::Backoff;

use kvpoll::ledger::{
    BeginError, Begun, Cause, Event, HandleKey, Kind, Ledger, LedgerConfig, Nanos, PeerId, Reason,
    Request, RequestId, RequestKey, MAX_HANDLES,
};
use kvpoll::ring;
use kvpoll::transport::sim::{Sim, SimConfig, SimEvent};

const FAILED: Reason = Reason {
    cause: Cause::Transfer,
    status: kvpoll::Status::new(-3),
};

/// Ledger slots per window of requests: room for the engine to fall behind
/// by a few windows before the poller must wait (back-pressure).
const SLOTS_PER_WINDOW: u32 = 8;

/// The shape of one measured run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BenchConfig {
    /// Requests per run (rounded down to whole windows).
    pub requests: u32,
    /// Handles per request (1..=64).
    pub handles: u8,
    /// Requests begun together; their handles complete interleaved.
    pub window: u32,
    /// Seed of the completion order.
    pub seed: u64,
}

impl Default for BenchConfig {
    /// 32 768 requests of 8 handles (262 144 completions), windows of 256.
    fn default() -> Self {
        BenchConfig {
            requests: 1 << 15,
            handles: 8,
            window: 256,
            seed: 1,
        }
    }
}

/// A bench could not run.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BenchError {
    /// `handles` must be in 1..=64, `window` and `requests` at least 1 window.
    #[error("bench needs 1..=64 handles and at least one window of requests")]
    Shape,
    /// The ledger refused an input: a bug, reported rather than hidden.
    #[error("the ledger refused {0} inputs during the bench")]
    Refused(u64),
}

/// Completions per second of both trackers, from interleaved runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Throughput {
    /// Handle completions per second through ledger + event ring (median run).
    pub ledger_completions_per_s: f64,
    /// Handle completions per second through the locked tracker (median run).
    pub locked_completions_per_s: f64,
    /// `ledger / locked`.
    pub ratio: f64,
    /// Handle completions per run.
    pub completions: u64,
    /// Runs of each.
    pub runs: u32,
}

impl Throughput {
    /// One JSON object (hand-written: three numbers need no serializer).
    pub fn to_json(&self) -> String {
        format!(
            "{{\"ledger_completions_per_s\":{:.0},\"locked_completions_per_s\":{:.0},\"ratio\":{:.2},\"completions_per_run\":{},\"runs\":{}}}",
            self.ledger_completions_per_s,
            self.locked_completions_per_s,
            self.ratio,
            self.completions,
            self.runs
        )
    }
}

/// The completion orders of a few windows, drawn once from the simulator so
/// that drawing them costs nothing during the measurement.
pub struct Schedule {
    config: BenchConfig,
    /// Per window: (request index in the window, handle, succeeded), in
    /// completion order.
    orders: Vec<Vec<(u32, u8, bool)>>,
}

impl Schedule {
    /// Draws 8 window orders from the simulator seeded with `config.seed`.
    pub fn new(config: BenchConfig) -> Result<Self, BenchError> {
        if config.handles == 0
            || usize::from(config.handles) > MAX_HANDLES
            || config.window == 0
            || config.requests < config.window
        {
            return Err(BenchError::Shape);
        }
        let mut sim = Sim::new(SimConfig {
            seed: config.seed,
            ..SimConfig::default()
        });
        let orders = (0..8)
            .map(|_| {
                for i in 0..config.window {
                    for h in 0..config.handles {
                        // The key only carries (i, h) through the simulator.
                        let key =
                            HandleKey::new(RequestKey::new(i, 0), h).ok_or(BenchError::Shape)?;
                        let _ = sim.post(key, PeerId(u32::from(h)));
                    }
                }
                Ok(std::iter::from_fn(|| sim.step())
                    .filter_map(|e| match e {
                        SimEvent::Completed { handle, result, .. } => {
                            Some((handle.key().slot(), handle.handle(), result.is_ok()))
                        }
                        _ => None,
                    })
                    .collect())
            })
            .collect::<Result<_, BenchError>>()?;
        Ok(Schedule { config, orders })
    }

    fn windows(&self) -> u32 {
        self.config.requests / self.config.window
    }

    /// Writes the schedule as text, for baselines in other languages
    /// (`kvpoll-cli/benches/reference/vllm_style.py` replays it):
    ///
    /// ```text
    /// kvpoll-trace 1 <requests> <handles> <window> <seed> <orders>
    /// <i>:<h>:<ok> <i>:<h>:<ok> …     one line per window order
    /// ```
    ///
    /// `i` is the request's index in its window, `h` the handle, `ok` 1 or
    /// 0; window `w` completes in order `w % orders`.
    pub fn write_trace(&self, mut out: impl std::io::Write) -> std::io::Result<()> {
        let c = self.config;
        writeln!(
            out,
            "kvpoll-trace 1 {} {} {} {} {}",
            self.windows() * c.window,
            c.handles,
            c.window,
            c.seed,
            self.orders.len()
        )?;
        for order in &self.orders {
            let mut sep = "";
            for &(i, h, ok) in order {
                write!(out, "{sep}{i}:{h}:{}", u8::from(ok))?;
                sep = " ";
            }
            writeln!(out)?;
        }
        Ok(())
    }

    /// Handle completions per run.
    pub fn completions(&self) -> u64 {
        u64::from(self.windows()) * u64::from(self.config.window) * u64::from(self.config.handles)
    }
}

/// One run through ledger + event ring; the time from the first begin to the
/// engine's last retire.
pub fn run_ledger(s: &Schedule) -> Result<Duration, BenchError> {
    let cfg = s.config;
    let mut ledger = Ledger::new(LedgerConfig {
        slots: SLOTS_PER_WINDOW * cfg.window,
        max_blocks: 1,
    })
    .map_err(|_| BenchError::Shape)?;
    let slots = ledger.slots().clone();
    let (mut tx, mut rx) = ring::events::<Event>(4096, 4096);
    // Keys handed back for retirement: room for every slot, so the engine
    // never waits on it.
    let (mut back, mut returned) = ring::commands::<RequestKey>(ledger.stats().capacity as usize);
    let total = s.windows() * cfg.window;
    let peers: Vec<PeerId> = (0..u32::from(cfg.handles)).map(PeerId).collect();
    let start = Barrier::new(2);
    std::thread::scope(|scope| {
        let engine = scope.spawn(|| {
            start.wait();
            let mut invalid = Vec::with_capacity(4);
            let (mut seen, mut refused) = (0, 0u64);
            let idle = Backoff::new();
            while seen < total {
                match rx.recv() {
                    Some(e) if e.outcome.is_terminal() => {
                        invalid.clear();
                        refused +=
                            u64::from(slots.blocks_to_invalidate(e.key, &mut invalid).is_err());
                        refused += u64::from(back.send(e.key).is_err());
                        seen += 1;
                        idle.reset();
                    }
                    Some(_) => {}
                    None => idle.snooze(),
                }
            }
            (Instant::now(), refused)
        });
        start.wait();
        let t0 = Instant::now();
        let mut refused = 0u64;
        let mut keys = vec![RequestKey::new(0, 0); cfg.window as usize];
        let mut publish = |e| {
            // Back-pressure cannot build here: at most 2 windows of reports
            // are outstanding and the ring holds more.
            let _ = tx.publish(e);
        };
        for w in 0..s.windows() {
            for (i, key) in keys.iter_mut().enumerate() {
                let req = Request {
                    id: RequestId(u64::from(w * cfg.window) + i as u64),
                    kind: Kind::Read,
                    peers: &peers,
                    blocks: &[],
                    expires: Nanos(u64::MAX),
                };
                let full = Backoff::new();
                *key = loop {
                    match ledger.begin_posting(&req, &mut publish) {
                        Ok(Begun::Tracked(k)) => break k,
                        // Retire what the engine handed back, or wait for it.
                        Err(BeginError::Full { .. }) => {
                            let mut any = false;
                            while let Some(k) = returned.recv() {
                                refused += u64::from(ledger.retire(k).is_err());
                                any = true;
                            }
                            if !any {
                                full.snooze();
                            }
                        }
                        _ => return Err(BenchError::Refused(1)),
                    }
                };
            }
            for &(i, h, ok) in &s.orders[w as usize % s.orders.len()] {
                let hk = HandleKey::new(keys[i as usize], h).ok_or(BenchError::Shape)?;
                let result = if ok { Ok(()) } else { Err(FAILED) };
                refused += u64::from(slots.completed(hk, result, &mut publish).is_err());
            }
        }
        let full = Backoff::new();
        while tx.flush() > 0 {
            full.snooze();
        }
        let (t1, engine_refused) = engine.join().map_err(|_| BenchError::Refused(1))?;
        match refused + engine_refused {
            0 => Ok(t1 - t0),
            n => Err(BenchError::Refused(n)),
        }
    })
}

/// The locked tracker's state: what a straightforward tracker keeps.
#[derive(Default)]
struct Locked {
    requests: HashMap<u64, Vec<HandleState>>,
    finished: Vec<u64>,
}

#[derive(Clone, Copy, PartialEq)]
enum HandleState {
    InFlight,
    Done,
    Failed,
}

/// One run through the locked tracker; the time from the first begin to the
/// engine's last finished request.
pub fn run_locked(s: &Schedule) -> Result<Duration, BenchError> {
    let cfg = s.config;
    let tracker = Mutex::new(Locked::default());
    let total = s.windows() * cfg.window;
    let start = Barrier::new(2);
    std::thread::scope(|scope| {
        let engine = scope.spawn(|| {
            start.wait();
            let mut seen = 0;
            let mut taken = Vec::new();
            let idle = Backoff::new();
            while seen < total {
                {
                    let mut t = tracker.lock().unwrap_or_else(|p| p.into_inner());
                    std::mem::swap(&mut t.finished, &mut taken);
                }
                if taken.is_empty() {
                    idle.snooze();
                } else {
                    idle.reset();
                }
                seen += taken.len() as u32;
                taken.clear();
            }
            Instant::now()
        });
        start.wait();
        let t0 = Instant::now();
        for w in 0..s.windows() {
            let base = u64::from(w * cfg.window);
            for i in 0..u64::from(cfg.window) {
                let mut t = tracker.lock().unwrap_or_else(|p| p.into_inner());
                t.requests.insert(
                    base + i,
                    vec![HandleState::InFlight; usize::from(cfg.handles)],
                );
            }
            for &(i, h, ok) in &s.orders[w as usize % s.orders.len()] {
                let id = base + u64::from(i);
                let mut t = tracker.lock().unwrap_or_else(|p| p.into_inner());
                let Some(handles) = t.requests.get_mut(&id) else {
                    continue;
                };
                handles[usize::from(h)] = if ok {
                    HandleState::Done
                } else {
                    HandleState::Failed
                };
                // Deferred failure: report only when no handle is in flight.
                if handles.iter().all(|s| *s != HandleState::InFlight) {
                    let _failed = handles.contains(&HandleState::Failed);
                    t.requests.remove(&id);
                    t.finished.push(id);
                }
            }
        }
        let t1 = engine.join().map_err(|_| BenchError::Refused(1))?;
        Ok(t1 - t0)
    })
}

/// `runs` interleaved runs of each; medians. Runs are interleaved so that
/// both trackers see the same machine noise.
pub fn compare(config: BenchConfig, runs: u32) -> Result<Throughput, BenchError> {
    let s = Schedule::new(config)?;
    let runs = runs.max(1);
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        a.push(run_ledger(&s)?);
        b.push(run_locked(&s)?);
    }
    let median = |v: &mut Vec<Duration>| {
        v.sort();
        v[v.len() / 2].as_secs_f64()
    };
    let n = s.completions() as f64;
    let ledger = n / median(&mut a);
    let locked = n / median(&mut b);
    Ok(Throughput {
        ledger_completions_per_s: ledger,
        locked_completions_per_s: locked,
        ratio: ledger / locked,
        completions: s.completions(),
        runs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_trackers_complete_every_request_of_a_small_run() {
        let cfg = BenchConfig {
            requests: 64,
            handles: 3,
            window: 16,
            seed: 3,
        };
        let s = Schedule::new(cfg).unwrap();
        assert_eq!(s.completions(), 64 * 3);
        assert!(s.orders.iter().all(|o| o.len() == 16 * 3));
        run_ledger(&s).unwrap();
        run_locked(&s).unwrap();
        let mut trace = Vec::new();
        s.write_trace(&mut trace).unwrap();
        let text = String::from_utf8(trace).unwrap();
        assert!(text.starts_with("kvpoll-trace 1 64 3 16 3 8\n"), "{text}");
        assert_eq!(text.lines().count(), 9);
        assert_eq!(text.lines().nth(1).unwrap().split(' ').count(), 16 * 3);
        let t = compare(cfg, 1).unwrap();
        assert!(t.to_json().starts_with("{\"ledger_completions_per_s\":"));
    }

    #[test]
    fn bench_refuses_a_shape_it_cannot_run() {
        let bad = BenchConfig {
            handles: 65,
            ..BenchConfig::default()
        };
        assert_eq!(Schedule::new(bad).err(), Some(BenchError::Shape));
    }
}
