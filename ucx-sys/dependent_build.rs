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
//!   - `ucx_tcp_gets_without_soft_reads`: UCX's own get over tcp survives
//!     the reader's death, so kvpoll does not read softly there (and soft
//!     reads' answers on reply endpoints UCX may destroy are not sent).
//!
//! The same releases as `kvpoll::transport::ucx::KnownUcxLimits`, which
//! says it of the UCX loaded at run time.

/// The first UCX release (major, minor) without each failure.
const FIXED_IN: &[(&str, (u32, u32))] = &[
    ("ucx_cma_with_peer_errors", (1, 20)),
    ("ucx_tcp_gets_without_soft_reads", (1, 22)),
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
