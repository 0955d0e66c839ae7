//! What can go wrong when reading a core map, reading the machine, or pinning
//! a thread. Every variant names the input that was wrong; core-map variants
//! name the file and the line.

use std::path::PathBuf;

use thiserror::Error;

/// An error from the placement layer.
#[derive(Debug, Error)]
pub enum PlacementError {
    /// The core-map file could not be read.
    #[error("{file}: cannot read core map: {source}")]
    Read {
        /// The path given.
        file: PathBuf,
        /// Why reading failed.
        source: std::io::Error,
    },
    /// The core-map file is larger than a core map can be
    /// ([`MAX_CORE_MAP_BYTES`](super::MAX_CORE_MAP_BYTES)); nothing past
    /// the limit was read.
    #[error("{file}: larger than {limit} bytes, the most a core map may be")]
    TooLarge {
        /// The path given.
        file: PathBuf,
        /// The limit, in bytes.
        limit: u64,
    },
    /// The file is not valid TOML.
    #[error("{file}:{line}: TOML syntax error: {message}")]
    Syntax {
        /// The core map's name (its path, or the name given to `parse`).
        file: String,
        /// 1-based line of the error.
        line: usize,
        /// What the TOML parser said.
        message: String,
    },
    /// A key the core-map format does not have (often a typo).
    #[error("{file}:{line}: unknown key `{key}` (expected one of: {expected})")]
    UnknownKey {
        /// The core map's name.
        file: String,
        /// 1-based line of the key.
        line: usize,
        /// The key as written.
        key: String,
        /// The keys allowed at that place.
        expected: String,
    },
    /// Valid TOML that does not fit the format: a wrong type, a missing
    /// key, an idle policy other than `busy` or `adaptive`.
    #[error("{file}:{line}: {message}")]
    Schema {
        /// The core map's name.
        file: String,
        /// 1-based line of the offending value (1 when unknown).
        line: usize,
        /// What was wrong.
        message: String,
    },
    /// The map has no pollers, or no engine cores: nothing to place.
    #[error("{file}: empty core map: {what}")]
    EmptyMap {
        /// The core map's name.
        file: String,
        /// What is missing.
        what: &'static str,
    },
    /// A poller names no UCX worker.
    #[error(
        "{file}:{line}: poller on CPU {core} owns no workers (give at least one, e.g. [\"all\"])"
    )]
    NoWorkers {
        /// The core map's name.
        file: String,
        /// 1-based line of the poller's `workers` (or its `core`).
        line: usize,
        /// The poller's CPU.
        core: usize,
    },
    /// One CPU is given to two pollers, or listed twice for the engine.
    #[error("{file}:{line}: CPU {core} is used twice (first at line {first_line})")]
    DuplicateCore {
        /// The core map's name.
        file: String,
        /// 1-based line of the second use.
        line: usize,
        /// The CPU.
        core: usize,
        /// 1-based line of the first use.
        first_line: usize,
    },
    /// A poller's CPU is also an engine-thread CPU.
    #[error("{file}:{line}: poller CPU {core} is also an engine CPU (line {engine_line}); a poller needs a CPU of its own")]
    PollerOnEngineCore {
        /// The core map's name.
        file: String,
        /// 1-based line of the poller's core.
        line: usize,
        /// The CPU.
        core: usize,
        /// 1-based line of the engine cores.
        engine_line: usize,
    },
    /// A CPU number this machine does not have.
    #[error("{file}:{line}: CPU {core} does not exist on this machine (CPUs: {known})")]
    UnknownCpu {
        /// The core map's name.
        file: String,
        /// 1-based line of the CPU.
        line: usize,
        /// The CPU.
        core: usize,
        /// This machine's CPUs, as a CPU list (`0-3,8`).
        known: String,
    },
    /// A CPU that exists but is offline.
    #[error("{file}:{line}: CPU {core} is offline (online: {online})")]
    OfflineCpu {
        /// The core map's name.
        file: String,
        /// 1-based line of the CPU.
        line: usize,
        /// The CPU.
        core: usize,
        /// The online CPUs, as a CPU list.
        online: String,
    },
    /// `auto` cannot place a poller: every usable CPU is the engine's.
    #[error("cannot derive a core map: {0}")]
    NoFreeCpu(String),
    /// hwloc could not read the machine.
    #[error("cannot read the machine topology with hwloc: {0}")]
    Topology(String),
    /// Pinning the thread failed or did not stick (an error only for the
    /// `busy` policy; `adaptive` gets a warning in its `PinOutcome`).
    #[error("cannot pin the thread to CPU {core}: {reason}")]
    Pin {
        /// The CPU asked for.
        core: usize,
        /// What failed: the system call, or what the read-back showed.
        reason: String,
    },
}
