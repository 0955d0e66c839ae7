//! kvpoll: moves KV-cache blocks between prefill and decode ranks over UCX and
//! reports, exactly once and without locks, which requests finished and which
//! failed.
#![warn(missing_docs)]

pub mod engine;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod ledger;
pub mod metadata;
pub mod notification;
pub mod placement;
pub(crate) mod poller;
pub mod ring;
pub(crate) mod sync;
pub mod transport;
pub mod wire;

/// The README's example compiles (checked by `cargo test --doc`).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
