//! The `kvpoll` tool's own library: the bench drivers and the checkable
//! block pattern that the tool, its criterion benches and its integration
//! tests share. Not for embedding: a serving engine needs only the `kvpoll`
//! crate.
#![warn(missing_docs)]

pub mod bench;
pub mod control;
pub mod pattern;

/// Whether this build's engines carry the `fault-injection` test hooks
/// (the bench says so next to its figures).
pub const FAULT_INJECTION: bool = cfg!(feature = "fault-injection");

/// A run of the tool failed: the engine refused a call (its own error,
/// whatever the phase), or the run could not go on (what it says).
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The engine refused a call.
    #[error(transparent)]
    Engine(#[from] kvpoll::Error),
    /// The rails refused a call.
    #[error(transparent)]
    Rails(#[from] kvpoll::rails::RailsError),
    /// The run could not go on.
    #[error("{0}")]
    Stuck(&'static str),
}

/// Each phase's engine error converts through `?` into an error type
/// that carries a `kvpoll::Error` in variant `$variant`.
macro_rules! from_engine_errors {
    ($target:ty, $variant:path) => {
        $crate::from_engine_errors!(
            @each $target, $variant,
            kvpoll::BuildError, kvpoll::RegionError, kvpoll::PeerError, kvpoll::SubmitError
        );
    };
    (@each $target:ty, $variant:path, $($phase:ty),*) => {$(
        impl From<$phase> for $target {
            fn from(e: $phase) -> Self {
                $variant(e.into())
            }
        }
    )*};
}
pub(crate) use from_engine_errors;
from_engine_errors!(RunError, RunError::Engine);
