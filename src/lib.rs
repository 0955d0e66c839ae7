//! kvpoll: moves KV-cache blocks between prefill and decode ranks over UCX and
//! reports, exactly once and without locks, which requests finished and which
//! failed.
//!
//! The everyday types are at the crate root: build an [`Engine`] with
//! [`Engine::builder`], submit [`Transfer`]s with [`Engine::read`],
//! [`Engine::write`] and [`Engine::lend`], and collect [`Outcomes`] with
//! [`Engine::poll`]. The modules hold the rest: [`engine`] (fault injection,
//! the API's details), [`ledger`] (the sans-IO request ledger the engine is
//! built on), [`placement`] (core maps, topology, pinning), [`metadata`]
//! (what peers exchange), [`metrics`] (a snapshot and its Prometheus
//! exposition), [`transport`] (the safe UCX layer and a seeded
//! simulator).
#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod core;
/// The poller thread's body. Internal; its `execute` step is public for
/// the simulator's tests.
#[doc(hidden)]
pub mod driver;
pub mod engine;
mod error;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod ledger;
pub mod metadata;
pub mod metrics;
/// Consumer notifications on the wire: internal, public for the tests that
/// send malformed ones.
#[doc(hidden)]
pub mod notification;
pub mod placement;
/// The SPSC rings between the engine thread and the poller: internal,
/// public for the ledger benches and tests that drive the ledger directly.
#[doc(hidden)]
pub mod ring;
pub(crate) mod sync;
pub mod transport;
pub(crate) mod wake;
pub mod wire;

pub use engine::{
    Engine, EngineBuilder, EngineError, EngineWaker, FailedRecv, IdlePolicy, LendTo, Outcomes,
    PollerStats, Transfer,
};
pub use ledger::{BlockId, Cause, Incarnation, PeerId, Reason, RequestId};
pub use placement::CoreMap;
pub use transport::ucx::ContextOptions;

/// The README's example compiles (checked by `cargo test --doc`).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
