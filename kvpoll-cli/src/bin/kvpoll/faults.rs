//! The demo's injected faults, with or without the `fault-injection`
//! feature. With it, kvpoll's own [`Faults`] and engine hooks. Without it
//! (the production build `make bench` measures), a stand-in with the same
//! fields that injects nothing: the demo then refuses to run with faults,
//! and an engine's `faults` and `stall` do nothing.

#[cfg(feature = "fault-injection")]
pub use kvpoll::engine::Faults;

/// Faults to inject (none in a build without `fault-injection`).
#[cfg(not(feature = "fault-injection"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Faults {
    pub release_failure_every: u32,
    pub release_retry_after: std::time::Duration,
    pub handle_error_every: u32,
    pub panic_at_post: u32,
    pub slow_progress: std::time::Duration,
}

/// Whether this binary can inject faults.
pub const AVAILABLE: bool = cfg!(feature = "fault-injection");

/// `EngineBuilder::faults` where the feature is off.
#[cfg(not(feature = "fault-injection"))]
pub trait BuilderFaults {
    fn faults(self, faults: Faults) -> Self;
}

#[cfg(not(feature = "fault-injection"))]
impl BuilderFaults for kvpoll::EngineBuilder {
    fn faults(self, _faults: Faults) -> Self {
        self
    }
}

/// `Engine::stall` where the feature is off: refused.
#[cfg(not(feature = "fault-injection"))]
pub trait EngineStall {
    fn stall(&mut self, d: std::time::Duration) -> Result<(), kvpoll_cli::RunError>;
}

#[cfg(not(feature = "fault-injection"))]
impl EngineStall for kvpoll::Engine {
    fn stall(&mut self, _d: std::time::Duration) -> Result<(), kvpoll_cli::RunError> {
        Err(kvpoll_cli::RunError::Stuck(
            "built without fault-injection: no stalls",
        ))
    }
}
