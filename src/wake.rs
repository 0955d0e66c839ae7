//! How the engine thread wakes a sleeping poller without ever losing a
//! wake-up.
//!
//! One word, three states (the shape of crossbeam's `Parker`, with the OS
//! wait left to the caller):
//!
//! - `EMPTY`: the poller is awake, or nothing was pushed since it woke.
//! - `PARKED`: the poller announced that it is about to block.
//! - `NOTIFIED`: the engine pushed something since the poller last reset the
//!   word; the poller must look before it blocks.
//!
//! Engine, after every push (command, control message, stop flag):
//! `swap(NOTIFIED)`; if the old value was `PARKED`, signal the OS wait.
//!
//! Poller, when it wants to block: `swap(PARKED)`. If the old value was
//! `NOTIFIED`, something was pushed: reset to `EMPTY` and do not block.
//! Otherwise re-check the rings, block, and on waking `swap(EMPTY)`.
//!
//! Why no wake-up is lost: both sides touch the word only with
//! read-modify-writes, which are totally ordered on it and each read the
//! latest value. Take an engine push followed by its swap `E`, and the
//! poller's announcing swap `P`:
//!
//! - `E` before `P`: `P` reads `NOTIFIED` (or a later poller write that
//!   itself followed a `NOTIFIED` it consumed while awake, after which the
//!   poller drained the rings). `E` is a release and `P` an acquire, so the
//!   push happens-before `P`: the poller sees it.
//! - `P` before `E`: `E` reads `PARKED` (the poller resets only after its
//!   OS wait) and signals the OS wait. The OS signal is sticky (an eventfd
//!   counter; a park token in the loom model): signalled before the poller
//!   blocks, the block returns at once.
//!
//! The loom model at the bottom checks exactly this, with the OS wait as a
//! loom park/unpark: a lost wake-up there is a deadlock, which loom reports.

use std::time::Duration;

use crate::sync::{AtomicU32, Ordering};

const EMPTY: u32 = 0;
const PARKED: u32 = 1;
const NOTIFIED: u32 = 2;

/// The wake word shared by one engine thread and its poller.
pub(crate) struct WakeState {
    state: AtomicU32,
}

impl WakeState {
    pub(crate) fn new() -> Self {
        WakeState {
            state: AtomicU32::new(EMPTY),
        }
    }

    /// Engine side, after a push. Returns whether the poller is (about to
    /// be) blocked: the caller must then signal its OS wait.
    #[inline]
    pub(crate) fn notify(&self) -> bool {
        // AcqRel: the release half publishes the push to the poller's swap
        // that reads this NOTIFIED; the acquire half orders the OS signal
        // after the poller's PARKED announcement. A swap, never a load: a
        // plain load may read a stale EMPTY while the poller's PARKED is in
        // flight, and the poller would then block on a push it cannot see.
        self.state.swap(NOTIFIED, Ordering::AcqRel) == PARKED
    }

    /// Poller side: announces that it is about to block. `false`: the
    /// engine pushed since the last reset, so the caller must not block (the
    /// word is back to `EMPTY`; the next loop iteration drains the push).
    /// `true`: the caller re-checks what it waits on, then blocks (or not),
    /// and calls [`WakeState::woke`] in either case.
    #[inline]
    pub(crate) fn prepare_park(&self) -> bool {
        // AcqRel: the acquire half makes every push whose notify came
        // before this swap visible to the re-check that follows; the
        // release half is what a later notify's acquire reads.
        if self.state.swap(PARKED, Ordering::AcqRel) == NOTIFIED {
            // A swap, not a store: an engine notify may land between the
            // two swaps (it reads PARKED and signals, a spurious but
            // harmless wake). Overwriting its NOTIFIED with a plain store
            // would drop the acquire of its push; this swap reads it.
            // Acquire: see above.
            self.state.swap(EMPTY, Ordering::Acquire);
            return false;
        }
        true
    }

    /// Poller side: back from the OS wait (or from deciding not to block).
    /// Returns whether a notify arrived while it was announced parked.
    #[inline]
    pub(crate) fn woke(&self) -> bool {
        // Acquire: pushes whose notify this swap reads are visible to the
        // iteration that follows. From here on notifies only mark the word
        // NOTIFIED and signal nothing, until the next prepare_park.
        self.state.swap(EMPTY, Ordering::Acquire) == NOTIFIED
    }
}

/// A non-blocking Linux `eventfd`: the OS half of the wake-up. The engine
/// writes it when [`WakeState::notify`] says the poller blocks; the poller
/// waits on it (next to the UCX worker's event fd) and drains it before it
/// next announces that it blocks (not on waking: no syscall on the way to
/// the work).
pub(crate) struct EventFd {
    fd: libc::c_int,
}

impl EventFd {
    pub(crate) fn new() -> std::io::Result<Self> {
        // SAFETY: eventfd has no memory preconditions; the fd is owned here
        // and closed once in Drop.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(EventFd { fd })
    }

    pub(crate) fn fd(&self) -> libc::c_int {
        self.fd
    }

    /// Makes the fd readable (adds 1 to its counter). A syscall: called
    /// only when the poller announced that it blocks.
    pub(crate) fn signal(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to an fd owned by self.
        // The only failure (EAGAIN at a counter of 2^64-2) still leaves the
        // fd readable, which is all a wake needs.
        let _ = unsafe { libc::write(self.fd, (&one as *const u64).cast(), 8) };
    }

    /// Resets the counter to zero (the fd stops being readable).
    pub(crate) fn drain(&self) {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64 from an fd owned by self;
        // non-blocking, so EAGAIN (already zero) returns at once.
        let _ = unsafe { libc::read(self.fd, (&mut v as *mut u64).cast(), 8) };
    }
}

impl Drop for EventFd {
    fn drop(&mut self) {
        // SAFETY: the fd was opened in new() and is closed once, here.
        unsafe { libc::close(self.fd) };
    }
}

/// The engine's handle on a poller's wake-up: the word and the eventfd.
pub(crate) struct Wake {
    pub(crate) state: WakeState,
    pub(crate) efd: EventFd,
}

impl Wake {
    pub(crate) fn new() -> std::io::Result<Self> {
        Ok(Wake {
            state: WakeState::new(),
            efd: EventFd::new()?,
        })
    }

    /// Engine side, after a push: wakes the poller if it blocks. No
    /// syscall unless it does.
    #[inline]
    pub(crate) fn notify(&self) {
        if self.state.notify() {
            self.efd.signal();
        }
    }
}

/// Waits until `efd` or `other` is readable or `timeout` passed (`ppoll`,
/// nanosecond timeout). Returns whether `efd` was readable.
pub(crate) fn wait_readable(
    efd: libc::c_int,
    other: Option<libc::c_int>,
    timeout: Duration,
) -> bool {
    let mut fds = [
        libc::pollfd {
            fd: efd,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: other.unwrap_or(-1),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    let n: libc::nfds_t = if other.is_some() { 2 } else { 1 };
    // SAFETY: fds holds `n` initialised pollfd entries and ts a valid
    // timespec, both alive for the call; a null sigmask keeps the mask.
    let r = unsafe { libc::ppoll(fds.as_mut_ptr(), n, &ts, std::ptr::null()) };
    r > 0 && fds[0].revents & libc::POLLIN != 0
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::WakeState;
    use loom::sync::atomic::{AtomicUsize, Ordering};
    use loom::thread;
    use std::sync::Arc;

    /// The engine pushes `pushes` items, notifying after each; the poller
    /// drains the ring and blocks (a loom park, whose token is as sticky as
    /// the eventfd) whenever it finds nothing. If a wake-up were lost the
    /// poller would park forever with items left: loom reports a deadlock.
    fn model(pushes: usize, recheck: bool) {
        let mut b = loom::model::Builder::new();
        b.preemption_bound = Some(3);
        b.check(move || {
            let wake = Arc::new(WakeState::new());
            // The ring, reduced to its tail counter.
            let ring = Arc::new(AtomicUsize::new(0));
            let (w, r) = (wake.clone(), ring.clone());
            let poller = thread::spawn(move || {
                let mut seen = 0;
                while seen < pushes {
                    // Drain (Acquire pairs with the push's Release).
                    let tail = r.load(Ordering::Acquire);
                    if tail > seen {
                        seen = tail;
                        continue;
                    }
                    if !w.prepare_park() {
                        continue;
                    }
                    // The re-check after announcing (the poller does it for
                    // what is pushed without a notify; the word alone must
                    // suffice for what is, so it is also modelled without).
                    if !recheck || r.load(Ordering::Acquire) == seen {
                        thread::park();
                    }
                    w.woke();
                }
            });
            let poller_thread = poller.thread().clone();
            for _ in 0..pushes {
                ring.fetch_add(1, Ordering::Release);
                if wake.notify() {
                    poller_thread.unpark();
                }
            }
            poller.join().unwrap();
        });
    }

    #[test]
    fn loom_wake_one_push_is_never_lost() {
        model(1, true);
        model(1, false);
    }

    #[test]
    fn loom_wake_two_pushes_across_a_park_are_never_lost() {
        model(2, true);
        model(2, false);
    }
}
