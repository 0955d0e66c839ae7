//! How a `kvpoll` process ends on a signal, and what UCX may do with
//! signals and standard output.
//!
//! SIGHUP, SIGINT and SIGTERM set a flag that `serve`, `connect` and `demo`
//! look at in their loops: each then stops what it runs (engines shut
//! down, the demo's prefill processes stopped) and exits — `serve` with 0,
//! `connect` and `demo` with 128 + the signal's number after their summary.
//!
//! UCX reads its settings when its library loads, before `main`: three of
//! them are set (and the program executed again, once) unless the
//! environment already sets them. `UCX_LOG_FILE=stderr`
//! keeps UCX's log lines off standard output, which is the command's own
//! (tables, JSON, `LISTEN` lines); `UCX_DEBUG_SIGNO=0` stops UCX from taking
//! SIGHUP as its "switch to debug logging" signal; `UCX_TCP_TX_SEG_SIZE=64K`
//! sends tcp data in 64 KiB segments instead of 8 KiB (UCX 1.13 answers an
//! emulated get over tcp in send segments: eight times fewer `sendto`
//! calls a gigabyte; 64 KiB is the default receive segment, so a peer
//! with UCX's defaults still takes them). UCX 1.13 does not take tcp
//! options through `ucp_config_modify` (it warns "invalid configuration"
//! and ignores them), so the library cannot set this one itself.

use std::sync::atomic::{AtomicI32, Ordering};

/// The signal that asked this process to stop (0: none yet).
static CAUGHT: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    CAUGHT.store(sig, Ordering::Release);
}

/// Installs the handler for SIGHUP, SIGINT and SIGTERM.
pub fn install() {
    for sig in [libc::SIGHUP, libc::SIGINT, libc::SIGTERM] {
        // SAFETY: a zeroed sigaction with a handler that only stores to an
        // atomic; SA_RESTART keeps blocking calls of other threads going.
        unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            act.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut act.sa_mask);
            libc::sigaction(sig, &act, std::ptr::null_mut());
        }
    }
}

/// The signal caught, if one was.
pub fn caught() -> Option<i32> {
    match CAUGHT.load(Ordering::Acquire) {
        0 => None,
        s => Some(s),
    }
}

/// The exit status of a run a signal cut short: 128 + its number.
pub fn exit_code(sig: i32) -> u8 {
    u8::try_from(128 + sig).unwrap_or(255)
}

/// Makes sure UCX runs with its log stream on standard error and without
/// a debug signal (see the module docs), unless the environment says
/// otherwise. UCX reads these when its library loads, before `main`: when
/// either is unset, it is set and this program executes itself again
/// (same process, same arguments), once.
pub fn ucx_defaults() {
    let mut missing: Vec<(&str, &str)> = [
        ("UCX_LOG_FILE", "stderr"),
        ("UCX_DEBUG_SIGNO", "0"),
        ("UCX_TCP_TX_SEG_SIZE", "64K"),
    ]
    .into_iter()
    .filter(|(name, _)| std::env::var_os(name).is_none())
    .collect();
    // A transport list without tcp leaves that default unused, which UCX
    // would warn about on every start: not when it is this program's own.
    if missing.iter().any(|(n, _)| *n == "UCX_TCP_TX_SEG_SIZE")
        && std::env::var_os("UCX_WARN_UNUSED_ENV_VARS").is_none()
    {
        missing.push(("UCX_WARN_UNUSED_ENV_VARS", "n"));
    }
    if missing.is_empty() {
        return;
    }
    let mut again = std::process::Command::new("/proc/self/exe");
    again.args(std::env::args_os().skip(1));
    if let Some(arg0) = std::env::args_os().next() {
        use std::os::unix::process::CommandExt as _;
        again.arg0(arg0);
    }
    for (name, value) in missing {
        again.env(name, value);
    }
    use std::os::unix::process::CommandExt as _;
    // Only returns if the exec failed: go on with UCX's own defaults.
    let e = again.exec();
    tracing::debug!("re-executing with UCX defaults failed: {e}");
}
