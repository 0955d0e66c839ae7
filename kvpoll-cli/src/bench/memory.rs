//! Memory the engine did not allocate, as a serving engine has it: an
//! anonymous private mapping, on transparent huge pages where the kernel
//! offers them (`madvise`), and what the machine says about huge pages.
//! Also the CPU time of a process, all its threads, to the nanosecond.

use std::io;

use kvpoll::transport::ucx::HugePages;

/// An anonymous private mapping ([`HugePages`]: huge pages asked for,
/// whole 2 MiB), faulted in (every page touched), unmapped on drop.
/// Registered with [`kvpoll::Engine::register_memory`] it is caller
/// memory: the engine did not allocate it.
pub struct CallerMemory {
    pages: HugePages,
}

impl CallerMemory {
    /// `len` bytes (rounded up to whole 2 MiB), every page written once.
    pub fn new(len: usize) -> io::Result<Self> {
        let pages = HugePages::map(len)?;
        // SAFETY: the whole mapping just made; writing faults every page
        // in now, not inside a measured transfer.
        unsafe { std::ptr::write_bytes(pages.as_ptr(), 0, pages.len()) };
        Ok(CallerMemory { pages })
    }

    /// The mapping's first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.pages.as_ptr()
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    /// Never empty; for clippy.
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    /// The bytes at `offset..offset + len`, which must lie inside.
    pub fn slice(&self, offset: usize, len: usize) -> &[u8] {
        assert!(offset + len <= self.len(), "slice outside the mapping");
        // SAFETY: inside the mapping (checked), which lives as long as self.
        unsafe { std::slice::from_raw_parts(self.as_ptr().add(offset), len) }
    }

    /// The bytes at `offset..offset + len`, writable.
    pub fn slice_mut(&mut self, offset: usize, len: usize) -> &mut [u8] {
        assert!(offset + len <= self.len(), "slice outside the mapping");
        // SAFETY: as in slice, and &mut self makes it the only view.
        unsafe { std::slice::from_raw_parts_mut(self.as_ptr().add(offset), len) }
    }
}

/// What this machine gives caller memory in huge pages: the transparent
/// huge page mode, the reserved hugetlbfs pages, and how much anonymous
/// memory is on huge pages right now (`/proc/meminfo`).
pub fn huge_pages() -> String {
    let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .ok()
        .and_then(|s| {
            let s = s.trim().to_owned();
            let start = s.find('[')? + 1;
            let end = s[start..].find(']')? + start;
            Some(s[start..end].to_owned())
        })
        .unwrap_or_else(|| "unknown".into());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |name: &str| {
        meminfo
            .lines()
            .find_map(|l| {
                l.strip_prefix(name)?
                    .split_whitespace()
                    .next()
                    .map(str::to_owned)
            })
            .unwrap_or_else(|| "?".into())
    };
    format!(
        "transparent huge pages {thp} (asked for with madvise), AnonHugePages {} kB now; hugetlbfs pages reserved: {}",
        field("AnonHugePages:"),
        field("HugePages_Total:")
    )
}

/// CPU time of `clock` (this process's or this thread's), ns.
pub fn cpu_clock(clock: libc::clockid_t) -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid timespec for the call to write.
    if unsafe { libc::clock_gettime(clock, &mut t) } != 0 {
        return 0;
    }
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// Spins until this thread used `ns` of CPU, however long a loaded
/// machine makes that take (tests that need a thread's CPU to show).
#[cfg(test)]
pub(crate) fn burn_cpu(ns: u64) {
    let from = cpu_clock(libc::CLOCK_THREAD_CPUTIME_ID);
    let mut x = 1u64;
    while cpu_clock(libc::CLOCK_THREAD_CPUTIME_ID) - from < ns {
        x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
    }
}

/// CPU time of every thread of process `pid` so far, ns (the scheduler's
/// own accounting, `/proc/<pid>/task/*/schedstat`). Threads that ended are
/// not counted: measure across a span in which the process's threads live.
pub fn cpu_ns(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .filter_map(Result::ok)
        .filter_map(|t| task_cpu_ns(&t.path()))
        .sum()
}

/// One thread's CPU so far, ns, from its `/proc/<pid>/task/<tid>`
/// directory (`schedstat`'s first field).
fn task_cpu_ns(task: &std::path::Path) -> Option<u64> {
    let s = std::fs::read_to_string(task.join("schedstat")).ok()?;
    s.split_whitespace().next()?.parse().ok()
}

/// The CPU of every thread of this process and of some others across a
/// span, thread by thread: where a system's CPU goes. Printed when
/// `KVPOLL_BENCH_THREADS` is set (see [`ThreadSplit::start`]).
pub struct ThreadSplit {
    pids: Vec<u32>,
    before: Vec<ThreadCpu>,
}

/// One thread's CPU so far: process, thread id, name, ns.
struct ThreadCpu {
    pid: u32,
    tid: u32,
    name: String,
    ns: u64,
}

fn threads_of(pid: u32, out: &mut Vec<ThreadCpu>) {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return;
    };
    for t in tasks.filter_map(Result::ok) {
        let Some(tid) = t.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        let ns = task_cpu_ns(&t.path());
        let name = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if let Some(ns) = ns {
            out.push(ThreadCpu {
                pid,
                tid,
                name: name.trim().to_owned(),
                ns,
            });
        }
    }
}

impl ThreadSplit {
    /// Starts a split of this process and `peers`, or `None` when
    /// `KVPOLL_BENCH_THREADS` is not set.
    pub fn start(peers: &[u32]) -> Option<Self> {
        std::env::var_os("KVPOLL_BENCH_THREADS")?;
        Some(Self::new(peers))
    }

    /// A split of this process and `peers` from now.
    fn new(peers: &[u32]) -> Self {
        let mut pids = vec![std::process::id()];
        pids.extend_from_slice(peers);
        let mut before = Vec::new();
        for &p in &pids {
            threads_of(p, &mut before);
        }
        ThreadSplit { pids, before }
    }

    /// Each thread's CPU since the start, µs per request of `requests`,
    /// threads of under 1 % of the whole left out: one line, `what` first.
    pub fn line(self, what: &str, requests: u32) -> String {
        let mut now = Vec::new();
        for &p in &self.pids {
            threads_of(p, &mut now);
        }
        let per = f64::from(requests.max(1));
        let mut parts: Vec<(f64, String)> = now
            .iter()
            .map(|t| {
                let was = self
                    .before
                    .iter()
                    .find(|b| b.pid == t.pid && b.tid == t.tid)
                    .map_or(0, |b| b.ns);
                let role = if t.pid == self.pids[0] {
                    "here"
                } else {
                    "peer"
                };
                let us = t.ns.saturating_sub(was) as f64 / 1e3 / per;
                (us, format!("{role} {} {}", t.name, t.tid))
            })
            .collect();
        let total: f64 = parts.iter().map(|p| p.0).sum();
        parts.retain(|p| p.0 >= total / 100.0);
        parts.sort_by(|a, b| b.0.total_cmp(&a.0));
        let listed: Vec<String> = parts
            .iter()
            .map(|(us, name)| format!("{name}: {us:.1}"))
            .collect();
        format!(
            "{what}: {requests} requests, CPU us a request by thread (the bench's data checks included): total {total:.1}; {}",
            listed.join("; ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caller_memory_is_whole_huge_pages_zeroed_and_writable() {
        let mut m = CallerMemory::new(3 << 20).unwrap();
        assert_eq!(m.len(), 4 << 20);
        assert!(m.slice(0, m.len()).iter().all(|&b| b == 0));
        m.slice_mut(4095, 2).copy_from_slice(&[7, 9]);
        assert_eq!(m.slice(4095, 2), &[7, 9]);
    }

    #[test]
    fn a_thread_busy_during_a_split_is_listed_by_name_with_its_cpu() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        let split = ThreadSplit::new(&[]);
        let (spun, stop) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
        );
        let (s, st) = (spun.clone(), stop.clone());
        let spinner = std::thread::Builder::new()
            .name("split-spinner".into())
            .spawn(move || {
                burn_cpu(5_000_000);
                s.store(true, Ordering::Release);
                // Alive (and idle) until the split was read: a thread that
                // ended is not listed.
                while !st.load(Ordering::Acquire) {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            })
            .unwrap();
        while !spun.load(Ordering::Acquire) {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let line = split.line("[g] s", 10);
        stop.store(true, Ordering::Release);
        spinner.join().unwrap();
        let us: f64 = line
            .split("; ")
            .find_map(|p| p.strip_prefix("here split-spinner "))
            .and_then(|p| p.split(": ").nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no split-spinner in {line}"));
        // 5 ms of its CPU over 10 requests: at least 500 us each.
        assert!(us >= 500.0, "{line}");
        assert!(line.starts_with("[g] s: 10 requests"), "{line}");
    }

    #[test]
    fn a_busy_thread_shows_in_the_cpu_time_of_its_process() {
        let pid = std::process::id();
        let before = cpu_ns(pid);
        // The process's figure may lag a running thread's by a scheduler
        // tick: burn twice what is asked of it.
        burn_cpu(20_000_000);
        let ns = cpu_ns(pid) - before;
        assert!(ns >= 10_000_000, "{ns}");
    }
}
