//! Pinning the calling thread to one CPU, and checking that it stuck.
//!
//! `sched_setaffinity` can "succeed" and still leave a thread elsewhere (a
//! cgroup cpuset narrowed later, a container runtime that rewrites masks),
//! so after pinning we read the mask back and ask the kernel which CPU the
//! thread runs on. For a `busy` poller a failure is an error: spinning on
//! the wrong CPU steals it from someone else. For `adaptive` it is a
//! warning: the poller still works, just with less predictable latency.

use std::mem;

use super::core_map::IdlePolicy;
use super::error::PlacementError;

/// What pinning did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PinOutcome {
    /// The CPU asked for.
    pub core: usize,
    /// The thread's affinity mask after pinning, read back.
    pub affinity: Vec<usize>,
    /// The CPU the thread was running on right after pinning (`sched_getcpu`).
    pub running_on: Option<usize>,
    /// Why pinning did not fully succeed, for an `adaptive` poller (a
    /// `busy` one gets an error instead). `None` when pinned as asked.
    pub warning: Option<String>,
}

impl PinOutcome {
    /// Whether the thread is pinned to exactly the CPU asked for.
    pub fn is_pinned(&self) -> bool {
        self.warning.is_none()
    }
}

/// The calling thread's CPU affinity mask, ascending.
pub fn current_affinity() -> Result<Vec<usize>, String> {
    // SAFETY: cpu_set_t is plain bits; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { mem::zeroed() };
    // SAFETY: pid 0 is the calling thread; set is a valid, writable
    // cpu_set_t of the size passed.
    let rc = unsafe { libc::sched_getaffinity(0, mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return Err(format!(
            "sched_getaffinity: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok((0..libc::CPU_SETSIZE as usize)
        // SAFETY: i < CPU_SETSIZE, inside the set.
        .filter(|&i| unsafe { libc::CPU_ISSET(i, &set) })
        .collect())
}

/// Every CPU this machine has, online or not (`/sys/devices/system/cpu/possible`);
/// `None` where that cannot be read.
pub fn machine_cpus() -> Option<Vec<usize>> {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/possible").ok()?;
    super::parse_cpu_list(text.trim()).ok()
}

/// The CPU the calling thread is running on now.
pub fn current_cpu() -> Option<usize> {
    // SAFETY: no arguments; returns -1 on error.
    let cpu = unsafe { libc::sched_getcpu() };
    usize::try_from(cpu).ok()
}

/// Pins the calling thread to `core` and verifies it by reading the
/// affinity back. A failure is an error for [`IdlePolicy::Busy`] and a
/// warning in the outcome for [`IdlePolicy::Adaptive`].
///
/// ```
/// use kvpoll::placement::{current_affinity, pin_current_thread, IdlePolicy};
/// let cpu = current_affinity().unwrap()[0];
/// let outcome = std::thread::spawn(move || pin_current_thread(cpu, IdlePolicy::Adaptive))
///     .join()
///     .unwrap()
///     .unwrap();
/// assert_eq!(outcome.affinity, vec![cpu]);
/// ```
pub fn pin_current_thread(core: usize, policy: IdlePolicy) -> Result<PinOutcome, PlacementError> {
    let problem = pin_and_verify(core);
    let affinity = current_affinity().unwrap_or_default();
    let running_on = current_cpu();
    match &problem {
        None => tracing::debug!(core, ?running_on, "thread pinned"),
        Some(reason) => match policy {
            IdlePolicy::Busy => tracing::debug!(core, %reason, "pinning a busy thread failed"),
            IdlePolicy::Adaptive => {
                tracing::warn!(core, %reason, "adaptive thread left unpinned")
            }
        },
    }
    match problem {
        None => Ok(PinOutcome {
            core,
            affinity,
            running_on,
            warning: None,
        }),
        Some(reason) => match policy {
            IdlePolicy::Busy => Err(PlacementError::Pin { core, reason }),
            IdlePolicy::Adaptive => Ok(PinOutcome {
                core,
                affinity,
                running_on,
                warning: Some(format!("not pinned to CPU {core}: {reason}")),
            }),
        },
    }
}

/// Pins and checks; `Some(reason)` when it did not work.
fn pin_and_verify(core: usize) -> Option<String> {
    // core_affinity indexes a cpu_set_t with the id: keep it in range.
    if core >= libc::CPU_SETSIZE as usize {
        return Some(format!(
            "CPU {core} is beyond the kernel's CPU set size ({})",
            libc::CPU_SETSIZE
        ));
    }
    if !core_affinity::set_for_current(core_affinity::CoreId { id: core }) {
        return Some(format!(
            "sched_setaffinity refused: {}",
            std::io::Error::last_os_error()
        ));
    }
    match current_affinity() {
        Err(e) => return Some(e),
        Ok(mask) if mask != [core] => {
            return Some(format!("the affinity read back is {mask:?}, not [{core}]"))
        }
        Ok(_) => {}
    }
    // The mask is set; the kernel migrates the thread before returning from
    // sched_setaffinity, so it must now run there.
    match current_cpu() {
        Some(cpu) if cpu == core => None,
        Some(cpu) => Some(format!("the thread runs on CPU {cpu} after pinning")),
        None => Some(format!(
            "sched_getcpu failed: {}",
            std::io::Error::last_os_error()
        )),
    }
}
