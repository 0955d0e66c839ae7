//! What a transport must know of a peer to reach its blocks: its worker
//! address, its regions' packed rkeys and its block layout. The types live
//! here, below [`crate::metadata`], which encodes and checks them as the
//! byte string engines exchange; transports take them already checked.

use crate::transport::ucx::{PackedRkey, WorkerAddress};

/// How blocks are laid out in every region of an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockLayout {
    /// Bytes per block.
    pub block_size: u64,
}

/// One registered region as a peer sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionDescriptor {
    /// The region id used in block descriptors.
    pub id: u32,
    /// Number of blocks in the region.
    pub blocks: u64,
    /// The packed remote key.
    pub rkey: PackedRkey,
}

/// Everything a peer needs to move blocks to or from this engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerMetadata {
    /// Random per engine start.
    pub instance: u64,
    /// Block layout.
    pub layout: BlockLayout,
    /// The worker to connect to.
    pub worker: WorkerAddress,
    /// The regions blocks live in.
    pub regions: Vec<RegionDescriptor>,
    /// The lend words readers read to confirm a read without asking
    /// ([`LendWords`](crate::transport::LendWords)), if the engine has them.
    pub words: Option<PackedRkey>,
    /// What a reader on the same host needs to read regions directly
    /// (`process_vm_readv`), if the engine lets it.
    pub direct: Option<DirectReads>,
}

/// A process's host and pid namespace, and its pid there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Host {
    /// The kernel's boot id (`/proc/sys/kernel/random/boot_id`).
    pub boot: [u8; 16],
    /// The pid namespace's inode (`/proc/self/ns/pid`).
    pub pid_ns: u64,
    /// The process id in that namespace.
    pub pid: u32,
}

/// An engine's offer to readers on its host: read these regions with
/// `process_vm_readv` from its pid, checking the probe word at
/// `probe_addr` holds `probe` in the same call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirectReads {
    /// Where the engine runs.
    pub host: Host,
    /// The probe word's address in the engine's process.
    pub probe_addr: u64,
    /// Its value (random per engine).
    pub probe: u64,
    /// Ids of the regions that may be read directly.
    pub regions: Vec<u32>,
}
