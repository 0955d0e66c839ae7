//! kvpoll: moves KV-cache blocks between prefill and decode ranks over UCX and
//! reports, exactly once and without locks, which requests finished and which
//! failed.
//!
//! The everyday types are at the crate root: build an [`Engine`] with
//! [`Engine::builder`] ([`EngineBuilder`]), submit [`Transfer`]s, and collect
//! [`Outcomes`] with [`Engine::poll`]; requests, blocks, peers and lends are
//! named by [`RequestId`], [`BlockId`], [`PeerId`] and [`Incarnation`]; a
//! deployment's engines may share an [`auth::AuthKey`]. By
//! surface: [`pull`] (lend and read) and [`push`] (receive and write) open
//! with their guarantees and an example; [`engine`] holds the API's
//! details, [`placement`] core maps, topology and pinning, [`metadata`]
//! what peers exchange, [`metrics`] a snapshot and its Prometheus
//! exposition, [`transport`] the safe UCX layer. The protocol core, the
//! ledger, the rings, the wire formats and the simulator are internal.
#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod auth;
#[doc(hidden)]
pub mod core;
// The poller thread's body. Internal; its `execute` step is public for
// the simulator's tests.
#[doc(hidden)]
pub mod driver;
pub mod engine;
mod error;
#[cfg(feature = "cuda")]
pub mod gpu;
// The request ledger the engine is built on. Internal; public for the
// benches and the tests that drive it directly.
#[doc(hidden)]
pub mod ledger;
pub mod metadata;
pub mod metrics;
/// Consumer notifications on the wire: internal, public for the tests that
/// send malformed ones.
#[doc(hidden)]
pub mod notification;
pub mod placement;
pub mod pull;
pub mod push;
pub mod rails;
/// The SPSC rings between the engine thread and the poller: internal,
/// public for the ledger benches and tests that drive the ledger directly.
#[doc(hidden)]
pub mod ring;
pub(crate) mod sync;
pub mod transport;
pub(crate) mod wake;
// Framing of everything peers exchange: internal, public for the fuzz
// targets.
#[doc(hidden)]
pub mod wire;

pub use engine::{
    BuildError, Engine, EngineBuilder, EngineWaker, Error, ErrorKind, FailedRecv, IdlePolicy,
    Outcomes, PeerError, PollerStats, RegionError, Stopped, SubmitError, Transfer,
};
pub use ledger::{BlockId, Cause, Incarnation, PeerId, Reason, RequestId, Status};
pub use placement::CoreMap;
pub use transport::ucx::ContextOptions;

/// The README's example compiles (checked by `cargo test --doc`).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
