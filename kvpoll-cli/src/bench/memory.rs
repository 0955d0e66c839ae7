//! Memory the engine did not allocate, as a serving engine has it: an
//! anonymous private mapping, on transparent huge pages where the kernel
//! offers them (`madvise`), and what the machine says about huge pages.
//! Also the CPU time of a process, all its threads, to the nanosecond.

use std::io;

/// An anonymous private mapping, faulted in (every page touched), unmapped
/// on drop. Registered with [`kvpoll::Engine::register_memory`] it is
/// caller memory: UCX did not allocate it.
pub struct CallerMemory {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a plain mapping owned by this value; nothing is tied to a thread.
unsafe impl Send for CallerMemory {}

impl CallerMemory {
    /// `len` bytes (rounded up to whole 2 MiB), huge pages asked for with
    /// `madvise(MADV_HUGEPAGE)`, every page written once.
    pub fn new(len: usize) -> io::Result<Self> {
        let len = len.max(1).div_ceil(2 << 20) * (2 << 20);
        // SAFETY: a fresh anonymous mapping; no existing memory is named.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: ptr..ptr+len is the mapping just made. A refusal (no THP
        // in this kernel) leaves 4 KiB pages, which is what it says.
        unsafe { libc::madvise(ptr, len, libc::MADV_HUGEPAGE) };
        // SAFETY: as above; writing faults every page in now, not inside a
        // measured transfer.
        unsafe { std::ptr::write_bytes(ptr as *mut u8, 0, len) };
        Ok(CallerMemory {
            ptr: ptr as *mut u8,
            len,
        })
    }

    /// The mapping's first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never empty; for clippy.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes at `offset..offset + len`, which must lie inside.
    pub fn slice(&self, offset: usize, len: usize) -> &[u8] {
        assert!(offset + len <= self.len, "slice outside the mapping");
        // SAFETY: inside the mapping (checked), which lives as long as self.
        unsafe { std::slice::from_raw_parts(self.ptr.add(offset), len) }
    }

    /// The bytes at `offset..offset + len`, writable.
    pub fn slice_mut(&mut self, offset: usize, len: usize) -> &mut [u8] {
        assert!(offset + len <= self.len, "slice outside the mapping");
        // SAFETY: as in slice, and &mut self makes it the only view.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(offset), len) }
    }
}

impl Drop for CallerMemory {
    fn drop(&mut self) {
        // SAFETY: the mapping made in new, unmapped once.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
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
