//! The safe UCX layer: small types with clear ownership over the raw
//! bindings of `ucx-sys`.
//!
//! Ownership decides drop order, which UCX requires: a [`RemoteKey`] keeps its
//! [`Endpoint`] alive, an endpoint keeps its [`Worker`], a worker and a
//! [`MemoryRegion`] keep the [`Context`]. So rkeys are destroyed before the
//! endpoints they were unpacked on, endpoints before their worker, and the
//! context last.
//!
//! Everything here is single-threaded by construction (`Rc`, raw handles):
//! workers run in `UCS_THREAD_MODE_SINGLE`, and only the thread that created
//! them — the poller — may touch them. The types are therefore neither `Send`
//! nor `Sync`.
//!
//! Completions carry a caller-chosen `u64` token and are collected, without
//! allocation per operation, in the worker's completion list; read them with
//! [`Worker::take_completions`] after [`Worker::progress`].

mod context;
mod direct;
mod endpoint;
mod error;
mod layout;
mod maps;
mod memory;
mod probe;
mod request;
mod returns;
mod soft;
mod transport;
mod worker;

pub use context::{check_version, version_line, Context, ContextOptions, KnownUcxLimits};
pub use endpoint::{BlockOp, Endpoint, PostError};
pub use error::{UcxError, UcxStatus};
pub use layout::LayoutError;
pub use memory::{HugePages, MemoryRegion, PackedRkey, RemoteKey};
#[doc(hidden)]
pub use soft::{PIECE_AM_ID as SOFT_PIECE_AM_ID, REQUEST_AM_ID as SOFT_REQUEST_AM_ID};
#[doc(hidden)]
pub use transport::NOTIFY_AM_ID;
pub use transport::{UcxTransport, UserMemory};
pub use worker::{ActiveMessage, Completion, EndpointFailure, Worker, WorkerAddress};

/// Largest active-message payload kvpoll sends or accepts (notifications are
/// tens of bytes). Larger messages would take the rendezvous path.
pub const MAX_AM_PAYLOAD: usize = 4096;
