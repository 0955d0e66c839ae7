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

/// CPU time of every thread of process `pid` so far, ns (the scheduler's
/// own accounting, `/proc/<pid>/task/*/schedstat`). Threads that ended are
/// not counted: measure across a span in which the process's threads live.
pub fn cpu_ns(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .filter_map(Result::ok)
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
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
    fn a_busy_thread_shows_in_the_cpu_time_of_its_process() {
        let pid = std::process::id();
        let before = cpu_ns(pid);
        let t = std::time::Instant::now();
        let mut x = 0u64;
        while t.elapsed() < std::time::Duration::from_millis(30) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        assert!(cpu_ns(pid) - before >= 10_000_000, "{x}");
    }
}
