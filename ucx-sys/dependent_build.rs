//! The build script of the crates that link executables against UCX
//! (kvpoll's tests, the tool, the C and Python libraries). Cargo hands
//! `ucx-sys`'s build facts (`DEP_UCP_*`) only to crates that depend on it
//! directly, as each of these does. Two things follow from them:
//!
//! - where `ucx-sys` linked a UCX that is not the system's, its rpath, so
//!   these binaries find that UCX at run time;
//! - cfgs naming what the UCX built against (and, through that rpath, run)
//!   no longer gets wrong, so tests of a UCX failure run where it is fixed
//!   (docs/design.md, UCX facts):
//!   - `ucx_cma_with_peer_errors`: an endpoint in peer error mode can have
//!     a `cma` lane (with rendezvous off), so a get from memory the caller
//!     registered is one-sided over shared memory.
//!   - `ucx_wireup_reply_purged_quietly`: a wire-up reply still waiting
//!     on a tcp endpoint whose peer died is dropped, not asserted against
//!     (`ucp_request_send_state_ff`, `src/ucp/core/ucp_request.c`: UCX
//!     1.13, built with assertions as Debian's is, aborts "got REP
//!     message"; 1.14 removed the assertion). Before it, a reader killed
//!     while its lender answers its connection's wire-up over tcp aborts
//!     the lender inside UCX.
//!
//! The same releases as `kvpoll::transport::ucx::KnownUcxLimits`, which
//! says it of the UCX loaded at run time.

/// The first UCX release (major, minor) without each failure.
const FIXED_IN: &[(&str, (u32, u32))] = &[
    ("ucx_cma_with_peer_errors", (1, 20)),
    ("ucx_wireup_reply_purged_quietly", (1, 14)),
];

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_UCP_RPATH");
    println!("cargo:rerun-if-env-changed=DEP_UCP_VERSION");
    if let Ok(rpath) = std::env::var("DEP_UCP_RPATH") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{rpath}");
    }
    let version = std::env::var("DEP_UCP_VERSION").unwrap_or_default();
    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    let built = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    for (cfg, fixed) in FIXED_IN {
        println!("cargo:rustc-check-cfg=cfg({cfg})");
        if built >= *fixed {
            println!("cargo:rustc-cfg={cfg}");
        }
    }
}
