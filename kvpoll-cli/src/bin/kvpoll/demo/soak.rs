//! `kvpoll demo --soak SECS`: the demo's modes, with the full fault mix,
//! over and over until the time is up, sampling every few seconds the
//! resident memory and open file descriptors of this process (the decode
//! ranks) and of the prefill rank processes, and the decode ranks' ring
//! occupancy. At the end it judges whether anything grew without bound.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// Seconds since the soak began.
    pub at_s: u64,
    /// Resident memory of this process, KiB.
    pub rss_kib: u64,
    /// Open file descriptors of this process.
    pub fds: u64,
    /// Resident memory of the prefill rank processes, summed, KiB.
    pub ranks_rss_kib: u64,
    /// Their open file descriptors, summed.
    pub ranks_fds: u64,
    /// Commands and events waiting in the decode ranks' rings.
    pub ring_occupancy: u64,
}

/// `VmRSS` (KiB) and the number of open descriptors of process `pid`
/// (`None` when it is gone or unreadable).
pub fn rss_and_fds(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64;
    Some((rss, fds))
}

/// Samples in a thread until stopped.
pub struct Sampler {
    samples: Arc<Mutex<Vec<Sample>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Sampler {
    /// Starts sampling every `every`: this process, the processes `ranks`
    /// names at the time, and the sum of `rings`.
    pub fn start(
        every: Duration,
        ranks: impl Fn() -> Vec<u32> + Send + 'static,
        rings: Vec<Arc<AtomicU64>>,
    ) -> Sampler {
        let samples = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (out, halt) = (samples.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let start = Instant::now();
            let me = std::process::id();
            loop {
                let (rss_kib, fds) = rss_and_fds(me).unwrap_or((0, 0));
                let pids = ranks();
                let (mut ranks_rss_kib, mut ranks_fds) = (0, 0);
                for pid in pids {
                    if let Some((r, f)) = rss_and_fds(pid) {
                        ranks_rss_kib += r;
                        ranks_fds += f;
                    }
                }
                let s = Sample {
                    at_s: start.elapsed().as_secs(),
                    rss_kib,
                    fds,
                    ranks_rss_kib,
                    ranks_fds,
                    ring_occupancy: rings.iter().map(|r| r.load(Ordering::Relaxed)).sum(),
                };
                if let Ok(mut v) = out.lock() {
                    v.push(s);
                }
                let next = Instant::now() + every;
                while Instant::now() < next {
                    if halt.load(Ordering::Acquire) {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        });
        Sampler {
            samples,
            stop,
            thread: Some(thread),
        }
    }

    /// Stops sampling; the samples taken.
    pub fn finish(mut self) -> Vec<Sample> {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.samples.lock().map(|v| v.clone()).unwrap_or_default()
    }
}

/// What grew without bound, if anything: after a warm-up (the first fifth
/// of the samples), the last quarter's peak is compared with the peak of
/// the quarter that follows the warm-up. Memory may grow by a quarter plus
/// 16 MiB (allocator and UCX caches settling), descriptors by 32 (a rank
/// restarted mid-sample), ring occupancy by twice plus 4096 entries.
pub fn growth(samples: &[Sample]) -> Vec<String> {
    let n = samples.len();
    if n < 8 {
        return Vec::new();
    }
    let early = &samples[n / 5..n / 5 + n / 4];
    let late = &samples[n - n / 4..];
    let peak = |w: &[Sample], f: fn(&Sample) -> u64| w.iter().map(f).max().unwrap_or(0);
    let mut grew = Vec::new();
    let checks: [Check; 5] = [
        ("decode RSS (KiB)", |s| s.rss_kib, |e| e + e / 4 + 16 * 1024),
        ("decode fds", |s| s.fds, |e| e + 32),
        (
            "prefill RSS (KiB)",
            |s| s.ranks_rss_kib,
            |e| e + e / 4 + 16 * 1024,
        ),
        ("prefill fds", |s| s.ranks_fds, |e| e + 32),
        ("ring occupancy", |s| s.ring_occupancy, |e| 2 * e + 4096),
    ];
    for (what, f, bound) in checks {
        let (e, l) = (peak(early, f), peak(late, f));
        if l > bound(e) {
            grew.push(format!("{what} grew from a peak of {e} to {l}"));
        }
    }
    grew
}

/// A figure's name, how to read it from a sample, and the most its late
/// peak may reach given its early one.
type Check = (&'static str, fn(&Sample) -> u64, fn(u64) -> u64);

/// The samples as CSV.
pub fn csv(samples: &[Sample]) -> String {
    let mut o = String::from(
        "seconds,decode_rss_kib,decode_fds,prefill_rss_kib,prefill_fds,ring_occupancy\n",
    );
    for s in samples {
        o.push_str(&format!(
            "{},{},{},{},{},{}\n",
            s.at_s, s.rss_kib, s.fds, s.ranks_rss_kib, s.ranks_fds, s.ring_occupancy
        ));
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flat(n: u64, rss: impl Fn(u64) -> u64) -> Vec<Sample> {
        (0..n)
            .map(|i| Sample {
                at_s: i * 5,
                rss_kib: rss(i),
                fds: 40,
                ranks_rss_kib: 200_000,
                ranks_fds: 160,
                ring_occupancy: 10,
            })
            .collect()
    }

    #[test]
    fn steady_figures_do_not_count_as_growth() {
        assert!(growth(&flat(100, |i| 300_000 + (i % 7) * 100)).is_empty());
    }

    #[test]
    fn memory_that_keeps_climbing_is_named() {
        let grew = growth(&flat(100, |i| 300_000 + i * 4_000));
        assert_eq!(grew.len(), 1, "{grew:?}");
        assert!(grew[0].starts_with("decode RSS"), "{grew:?}");
    }

    #[test]
    fn this_process_can_be_sampled() {
        let (rss, fds) = rss_and_fds(std::process::id()).unwrap();
        assert!(rss > 0 && fds > 0);
    }
}
