//! Every way an engine call can fail ([`EngineError`], re-exported by
//! [`crate::engine`] and at the crate root). Apart from the engine so that
//! the poller, which answers control calls with it, does not depend on the
//! engine that starts it.

use thiserror::Error;

use crate::core::MAX_CONSUMERS;
use crate::ledger::{BlockId, ConfigError, PeerId, RequestId, MAX_HANDLES};
use crate::metadata::MetadataError;
use crate::placement::PlacementError;
use crate::transport::ucx::UcxError;

/// Every way an engine call can fail. A failed call changes nothing.
#[derive(Debug, Error)]
pub enum EngineError {
    /// A request with this id is in flight or not yet reported.
    #[error("request {0:?} is already in flight")]
    Duplicate(RequestId),
    /// More handles than a request can hold.
    #[error("{0} handles given; at most {MAX_HANDLES} fit in one request")]
    TooManyHandles(usize),
    /// A handle's local and remote lists differ in length, or are empty.
    #[error("handle {handle}: {local} local blocks paired with {remote} remote blocks")]
    BadPairing {
        /// The handle's index.
        handle: usize,
        /// Local blocks given.
        local: usize,
        /// Remote blocks given.
        remote: usize,
    },
    /// More local blocks than a request may name.
    #[error("{given} local blocks in one request; at most {max}")]
    TooManyBlocks {
        /// Blocks given.
        given: usize,
        /// The limit.
        max: u32,
    },
    /// A local block id outside the registered regions.
    #[error("local block {block:?} is out of range: regions hold {blocks} blocks")]
    BlockOutOfRange {
        /// The block.
        block: BlockId,
        /// Blocks per region.
        blocks: u64,
    },
    /// No memory is registered yet.
    #[error("no region is registered: call Engine::register first")]
    NoRegions,
    /// A region index past the registered regions.
    #[error("region {region} does not exist: {regions} region(s) are registered")]
    NoSuchRegion {
        /// The index given.
        region: usize,
        /// Regions registered (valid indices are below this).
        regions: usize,
    },
    /// More bytes given for one block (or asked of it) than a block holds.
    #[error("{given} bytes given for one block; the block size is {block_size} bytes")]
    TooManyBytes {
        /// Bytes given.
        given: usize,
        /// Bytes per block.
        block_size: u64,
    },
    /// Caller memory that is not a whole number of blocks.
    #[error("caller memory of {len} bytes is not a whole number of {block_size}-byte blocks")]
    NotWholeBlocks {
        /// Bytes given.
        len: usize,
        /// Bytes per block.
        block_size: u64,
    },
    /// Device memory that cannot be registered (feature `cuda`): no CUDA
    /// driver or GPU here, memory CUDA does not know as one device
    /// allocation, or a UCX without CUDA transports. The variant inside
    /// says which.
    #[cfg(feature = "cuda")]
    #[error("device memory: {0}")]
    Device(#[from] crate::gpu::GpuError),
    /// A poller CPU that this machine does not have.
    #[error("poller CPU {core} does not exist on this machine (CPUs: {cpus})")]
    NoSuchCpu {
        /// The CPU asked for.
        core: usize,
        /// The machine's CPUs, as a CPU list (`0-3,8`).
        cpus: String,
    },
    /// Every ledger slot is in use: poll and retire, or build a larger ledger.
    #[error("all {0} request slots are in use")]
    Full(u32),
    /// The command ring is full: the poller is behind. Retry after a poll.
    #[error("command ring full ({0} entries needed): retry after polling")]
    RingFull(usize),
    /// The request needs more command-ring entries than the ring holds: it
    /// can never be sent. Split it, or build the engine with a larger ring.
    #[error("request needs {entries} command-ring entries; the ring holds {capacity}")]
    RequestTooLarge {
        /// Entries the request needs (1 + handles + block pairs).
        entries: usize,
        /// The ring's capacity.
        capacity: usize,
    },
    /// A lend or write that awaits no notification.
    #[error("a lend must await at least one notification")]
    NothingToAwait,
    /// More remote engines to await than one request can count.
    #[error("{0} remote engines to await; at most {MAX_CONSUMERS} per request")]
    TooManyConsumers(u32),
    /// The request is not in flight.
    #[error("request {0:?} is not in flight")]
    UnknownRequest(RequestId),
    /// The peer is not known.
    #[error("peer {0:?} is not known")]
    UnknownPeer(PeerId),
    /// The peer's metadata was given again (the same engine instance)
    /// with different contents while transfers of ours are in flight on
    /// it or a receive waits for its word: replacing its
    /// endpoint now could cut puts in flight or drop that fence. Retry
    /// once they ended; identical metadata returns the same peer at once.
    #[error("peer {0:?} is in use (transfers in flight, or a receive awaits its word): its metadata can be replaced once they ended")]
    PeerBusy(PeerId),
    /// A handle names no incarnation, or handles to one peer name
    /// different ones.
    #[error("handle {handle}: {why}")]
    BadIncarnation {
        /// The handle's index.
        handle: usize,
        /// What is wrong.
        why: &'static str,
    },
    /// A part transfer's byte ranges are empty, of different lengths, or
    /// not inside a block on its side.
    #[error("handle {handle}: local bytes {local:?}, remote bytes {remote:?}: {why}")]
    BadPart {
        /// The handle's index.
        handle: usize,
        /// The local byte range given, within each local block.
        local: std::ops::Range<u64>,
        /// The remote byte range given, within each remote block.
        remote: std::ops::Range<u64>,
        /// What is wrong.
        why: &'static str,
    },
    /// Peer metadata was refused.
    #[error(transparent)]
    Metadata(#[from] MetadataError),
    /// A UCX call failed.
    #[error(transparent)]
    Ucx(#[from] UcxError),
    /// A region's size does not fit the layout.
    #[error("region of {blocks} blocks: {why}")]
    BadRegion {
        /// Blocks asked for.
        blocks: u64,
        /// What is wrong.
        why: &'static str,
    },
    /// Memory registered after a peer was added: that peer holds metadata
    /// without the new region, and every later transfer with it would fail.
    #[error("register every region before adding peers (peers hold the metadata sent them)")]
    RegionsFrozen,
    /// The ledger sizes are invalid.
    #[error(transparent)]
    Ledger(#[from] ConfigError),
    /// Placing the poller failed.
    #[error(transparent)]
    Placement(#[from] PlacementError),
    /// The builder's settings are invalid.
    #[error("invalid engine configuration: {0}")]
    Config(&'static str),
    /// The poller thread could not be started.
    #[error("starting the poller thread: {0}")]
    Spawn(String),
    /// The engine was shut down.
    #[error("the engine is shut down")]
    Shutdown,
    /// The poller thread died (a bug): requests in flight were reported
    /// failed (`Cause::PollerDied`); the engine accepts nothing more.
    #[error("the poller thread died; requests in flight were reported failed")]
    PollerDied,
}
