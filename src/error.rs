//! How engine calls fail, one type per phase, each returned by the calls
//! of its phase only (in the manner of quinn's `ConnectError`,
//! `ReadError`, `WriteError`): [`BuildError`] by
//! [`crate::EngineBuilder::build`]; [`RegionError`] by registering memory
//! and reading or writing a block of it; [`PeerError`] by metadata and
//! peers; [`SubmitError`] by the requests (read, write, lend, receive,
//! notify, heartbeat, abort). The last three carry [`Stopped`] for an
//! engine that takes nothing more, as quinn's carry `ConnectionError`.
//! [`Error`] is any of them, for a caller that wants one type (`?`
//! converts each). A failed call changes nothing.
//!
//! Apart from the engine so that the poller, which answers control calls
//! with them, does not depend on the engine that starts it.

use thiserror::Error;

use crate::auth::AuthError;
use crate::core::MAX_CONSUMERS;
use crate::ledger::{BlockId, ConfigError, PeerId, RequestId, MAX_HANDLES};
use crate::metadata::MetadataError;
use crate::placement::PlacementError;
use crate::transport::ucx::UcxError;

/// Building an engine failed ([`crate::EngineBuilder::build`],
/// [`crate::EngineBuilder::core_map`]): a setting, the poller's CPU, the
/// ledger's sizes, UCX or the poller thread. No engine exists.
#[derive(Debug, Error)]
pub enum BuildError {
    /// A block size of 0 bytes.
    #[error("block size {0}: a block holds at least one byte")]
    BlockSize(u64),
    /// A ring too small to carry anything.
    #[error("the {ring} ring of {entries} entries is too small: it needs at least {min}")]
    RingTooSmall {
        /// Which ring (`command`, `event`).
        ring: &'static str,
        /// Entries given.
        entries: usize,
        /// The fewest it may have.
        min: usize,
    },
    /// A core map without a poller entry.
    #[error("the core map names no poller CPU")]
    NoPoller,
    /// A poller CPU that this machine does not have.
    #[error("poller CPU {core} does not exist on this machine: it has {count} CPUs ({cpus})")]
    NoSuchCpu {
        /// The CPU asked for.
        core: usize,
        /// How many CPUs the machine has.
        count: usize,
        /// The machine's CPUs, as a CPU list (`0-3,8`).
        cpus: String,
    },
    /// The ledger sizes are invalid.
    #[error(transparent)]
    Ledger(#[from] ConfigError),
    /// Placing the poller failed (pinning a busy poller).
    #[error(transparent)]
    Placement(#[from] PlacementError),
    /// UCX could not start: among others, a transport list it cannot use
    /// ([`UcxError::NoUsableTransport`] names it and what UCX offers).
    #[error(transparent)]
    Ucx(#[from] UcxError),
    /// The poller thread could not be started.
    #[error("starting the poller thread: {0}")]
    Spawn(String),
    /// The shared key could not be made from the secret given (the test
    /// hook's environment variable; see [`crate::EngineBuilder::auth_key`]).
    #[error("the shared key: {0}")]
    AuthKey(#[from] crate::auth::AuthKeyError),
}

/// The engine takes nothing more: every call after this fails with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum Stopped {
    /// [`crate::Engine::shutdown`] was called.
    #[error("the engine is shut down")]
    Shutdown,
    /// The poller thread died (a bug): requests in flight were reported
    /// failed (`Cause::PollerDied`).
    #[error("the poller thread died; requests in flight were reported failed")]
    PollerDied,
    /// The engine's UCX worker receives no message again: a peer was
    /// killed inside a shared-memory send to it and left the worker's
    /// receive queue stopped (docs/design.md §4). Nothing new is started;
    /// what is in flight ends on its own and is reported once, as ever
    /// (lends at their leases, reads and writes at their deadlines or
    /// leases). Build a new engine (a new worker, at a new address) and
    /// give its peers its metadata ([`crate::Engine::is_deaf`] tells when).
    #[error("the engine's UCX worker hears no more messages (a peer died inside a shared-memory send to it): build a new engine")]
    Deaf,
}

/// Registering memory, or reading or writing a block of it, failed
/// ([`crate::Engine::register`], [`crate::Engine::register_memory`],
/// [`crate::Engine::write_block`], [`crate::Engine::read_block`]).
#[derive(Debug, Error)]
pub enum RegionError {
    /// A region of no blocks, more than `u32::MAX`, or more bytes than the
    /// engine maps (1 TiB).
    #[error("a region of {blocks} blocks of {block_size} bytes: {why}")]
    BadSize {
        /// Blocks asked for.
        blocks: u64,
        /// Bytes per block.
        block_size: u64,
        /// What is wrong.
        why: &'static str,
    },
    /// A region whose block count differs from the first region's.
    #[error("a region of {blocks} blocks: every region must hold the same number of blocks as the first, {first}")]
    Uneven {
        /// Blocks asked for.
        blocks: u64,
        /// Blocks of the regions registered.
        first: u64,
    },
    /// Caller memory at a null pointer.
    #[error("caller memory of {len} bytes at a null pointer")]
    NullMemory {
        /// Bytes given.
        len: usize,
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
    /// Memory registered after a peer was added: that peer holds metadata
    /// without the new region, and every later transfer with it would fail.
    #[error("register every region before adding peers (peers hold the metadata sent them)")]
    Frozen,
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
    /// A block past the region's end.
    #[error("block {} is out of range: region {region} holds {blocks} blocks", .block.0)]
    BlockOutOfRange {
        /// The region.
        region: usize,
        /// The block.
        block: BlockId,
        /// Blocks of the region.
        blocks: u64,
    },
    /// UCX could not map or allocate the memory.
    #[error(transparent)]
    Ucx(#[from] UcxError),
    /// The engine takes nothing more.
    #[error(transparent)]
    Stopped(#[from] Stopped),
}

/// This engine's metadata, or adding or removing a peer, failed
/// ([`crate::Engine::local_metadata`], [`crate::Engine::add_peer`],
/// [`crate::Engine::add_peer_any_block_size`],
/// [`crate::Engine::remove_peer`]).
#[derive(Debug, Error)]
pub enum PeerError {
    /// Peer metadata was refused: it does not decode, or its layout does
    /// not fit this engine's.
    #[error(transparent)]
    Metadata(MetadataError),
    /// Peer metadata was refused as unauthenticated: this engine has a
    /// key ([`crate::EngineBuilder::auth_key`]) and the peer has none or
    /// another, or the peer has one and this engine none. Counted in
    /// [`crate::PollerStats::unauthenticated_peers`]. Give both engines
    /// the same key.
    #[error("peer refused: {0}")]
    Unauthenticated(AuthError),
    /// The peer's metadata was given again (the same engine instance)
    /// with different contents while transfers of ours are in flight on
    /// it or a receive waits for its word: replacing its
    /// endpoint now could cut puts in flight or drop that fence. Retry
    /// once they ended; identical metadata returns the same peer at once.
    #[error("peer {} is in use (transfers in flight, or a receive awaits its word): its metadata can be replaced once they ended", .0.0)]
    Busy(PeerId),
    /// A peer id this engine never gave out.
    #[error("peer {} is not known: this engine never added it", .0.0)]
    Unknown(PeerId),
    /// A UCX call failed (packing this engine's metadata, or taking the
    /// peer's).
    #[error(transparent)]
    Ucx(#[from] UcxError),
    /// The engine takes nothing more.
    #[error(transparent)]
    Stopped(#[from] Stopped),
}

/// A request was refused ([`crate::Engine::read`], `write`, `lend`,
/// `receive`, `receive_from`, their variants, `notify_only`, `heartbeat`,
/// `abort`): nothing was submitted.
#[derive(Debug, Error)]
pub enum SubmitError {
    /// A request with this id is in flight or not yet reported.
    #[error("request {} is already in flight", .0.0)]
    Duplicate(RequestId),
    /// The request is not in flight.
    #[error("request {} is not in flight", .0.0)]
    UnknownRequest(RequestId),
    /// A read of parts or a write with no handle: nothing would move.
    #[error("no handles given: a read of parts or a write moves at least one")]
    NoHandles,
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
    /// No memory is registered yet.
    #[error("no region is registered: call Engine::register first")]
    NoRegions,
    /// A local block id outside the registered regions.
    #[error("local block {} is out of range: each region holds {blocks} blocks", .block.0)]
    BlockOutOfRange {
        /// The block.
        block: BlockId,
        /// Blocks per region.
        blocks: u64,
    },
    /// A lend or receive that awaits no notification.
    #[error("a lend or receive must await at least one notification")]
    NothingToAwait,
    /// More remote engines to await than one request can count.
    #[error("{0} remote engines to await; at most {MAX_CONSUMERS} per request")]
    TooManyConsumers(u32),
    /// A handle names a peer this engine never added.
    #[error("handle {handle}: peer {} is not known", .peer.0)]
    UnknownPeer {
        /// The handle's index.
        handle: usize,
        /// The peer it names.
        peer: PeerId,
    },
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
    /// A receive on an engine built with `EngineBuilder::remote_write(false)`:
    /// peers may not write into its blocks. Build the push destination
    /// with remote writes allowed, or read from the prefill (pull).
    #[error("this engine allows no remote writes, so it opens no receive: build it with remote_write(true) to be a push destination")]
    RemoteWriteOff,
    /// A write from an engine built with `EngineBuilder::remote_write(false)`
    /// over tcp alone: its UCX context goes without remote memory access,
    /// which is how peers' writes into it are refused, so it posts no put
    /// either. Read from it instead (pull), or build it with remote writes.
    #[error("this engine allows no remote writes over tcp alone, so it has no UCX remote memory access and cannot write: pull instead, or build it with remote_write(true)")]
    NoPuts,
    /// The engine takes nothing more.
    #[error(transparent)]
    Stopped(#[from] Stopped),
}

impl From<MetadataError> for PeerError {
    fn from(e: MetadataError) -> Self {
        match e {
            MetadataError::Unauthenticated(a) => PeerError::Unauthenticated(a),
            e => PeerError::Metadata(e),
        }
    }
}

/// Any kvpoll error, for a caller that wants one type: each phase's error
/// converts into it with `?`.
#[derive(Debug, Error)]
pub enum Error {
    /// Building the engine failed.
    #[error(transparent)]
    Build(#[from] BuildError),
    /// Registering or touching memory failed.
    #[error(transparent)]
    Region(#[from] RegionError),
    /// Metadata or a peer call failed.
    #[error(transparent)]
    Peer(#[from] PeerError),
    /// A request was refused.
    #[error(transparent)]
    Submit(#[from] SubmitError),
}

/// What an error asks of the caller, across phases: the classes the C
/// (`KVPOLL_ERR_*`) and Python (`kvpoll.*Error`) bindings report. A
/// block of a region given too many bytes or out of range is a request's
/// kind (the call's arguments are wrong, as for a read naming that block);
/// a request before any region is registered is a region's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// A setting of the engine (block size, rings, CPU, ledger sizes).
    Config,
    /// A region's size or layout, or no region registered yet.
    Region,
    /// A request's (or a block access's) arguments.
    Request,
    /// Peer metadata, or a peer not known.
    Peer,
    /// Only for now: poll, then retry.
    Busy,
    /// A UCX call.
    Transport,
    /// The engine takes nothing more.
    Stopped,
    /// None of these (the poller thread could not start).
    Other,
}

impl Error {
    /// What this error asks of the caller.
    pub fn kind(&self) -> ErrorKind {
        use ErrorKind as K;
        match self {
            Error::Build(e) => match e {
                BuildError::BlockSize(_)
                | BuildError::RingTooSmall { .. }
                | BuildError::NoPoller
                | BuildError::NoSuchCpu { .. }
                | BuildError::Ledger(_)
                | BuildError::Placement(_)
                | BuildError::AuthKey(_) => K::Config,
                BuildError::Ucx(_) => K::Transport,
                BuildError::Spawn(_) => K::Other,
            },
            Error::Region(e) => match e {
                RegionError::BadSize { .. }
                | RegionError::Uneven { .. }
                | RegionError::NullMemory { .. }
                | RegionError::NotWholeBlocks { .. }
                | RegionError::Frozen
                | RegionError::NoSuchRegion { .. } => K::Region,
                #[cfg(feature = "cuda")]
                RegionError::Device(_) => K::Region,
                RegionError::TooManyBytes { .. } | RegionError::BlockOutOfRange { .. } => {
                    K::Request
                }
                RegionError::Ucx(_) => K::Transport,
                RegionError::Stopped(_) => K::Stopped,
            },
            Error::Peer(e) => match e {
                PeerError::Metadata(_)
                | PeerError::Unauthenticated(_)
                | PeerError::Busy(_)
                | PeerError::Unknown(_) => K::Peer,
                PeerError::Ucx(_) => K::Transport,
                PeerError::Stopped(_) => K::Stopped,
            },
            Error::Submit(e) => match e {
                SubmitError::Duplicate(_)
                | SubmitError::UnknownRequest(_)
                | SubmitError::NoHandles
                | SubmitError::TooManyHandles(_)
                | SubmitError::BadPairing { .. }
                | SubmitError::TooManyBlocks { .. }
                | SubmitError::BlockOutOfRange { .. }
                | SubmitError::NothingToAwait
                | SubmitError::TooManyConsumers(_)
                | SubmitError::BadIncarnation { .. }
                | SubmitError::BadPart { .. }
                | SubmitError::RequestTooLarge { .. } => K::Request,
                SubmitError::UnknownPeer { .. } => K::Peer,
                SubmitError::NoRegions => K::Region,
                SubmitError::RemoteWriteOff | SubmitError::NoPuts => K::Config,
                SubmitError::Full(_) | SubmitError::RingFull(_) => K::Busy,
                SubmitError::Stopped(_) => K::Stopped,
            },
        }
    }

    /// The engine stopped, whatever the call: `None` for every other error.
    pub fn stopped(&self) -> Option<Stopped> {
        match self {
            Error::Region(RegionError::Stopped(s))
            | Error::Peer(PeerError::Stopped(s))
            | Error::Submit(SubmitError::Stopped(s)) => Some(*s),
            _ => None,
        }
    }
}
