//! The control plane: the engine's rare requests (register memory, this
//! engine's metadata, add or remove a peer, shut down), sent over a channel
//! and each answered on its own reply channel. The driver looks at the
//! channel only when the engine flagged a message.

use std::sync::atomic::Ordering;
use std::sync::mpsc;

use super::Driver;
use crate::error::{PeerError, RegionError};
use crate::ledger::PeerId;
use crate::transport::peer::PeerMetadata;
use crate::transport::ucx::{UcxError, UcxStatus};
use crate::transport::Transport;

type Reply<T, E> = mpsc::Sender<Result<T, E>>;

/// Device memory to register (feature `cuda`); without the feature there
/// is none to give.
#[cfg(feature = "cuda")]
pub(crate) type DeviceMemory = crate::gpu::DeviceMemory;
/// Device memory to register (feature `cuda`); without the feature there
/// is none to give.
#[cfg(not(feature = "cuda"))]
pub(crate) type DeviceMemory = std::convert::Infallible;

/// Rare requests from the engine thread, answered on a reply channel.
pub(crate) enum Control {
    Register {
        blocks: u64,
        len: usize,
        /// Caller memory to map (its address), or `None` to let UCX allocate.
        user: Option<usize>,
        /// The caller memory is this device memory (`user` is its address).
        device: Option<DeviceMemory>,
        reply: Reply<(usize, usize), RegionError>,
    },
    Metadata {
        reply: Reply<Vec<u8>, PeerError>,
    },
    AddPeer {
        meta: PeerMetadata,
        reply: Reply<PeerId, PeerError>,
    },
    RemovePeer {
        peer: PeerId,
        reply: Reply<(), PeerError>,
    },
    Shutdown,
}

impl Driver {
    pub(super) fn drain_control(&mut self) -> u32 {
        // A swap: a flag set after a message this drain misses stays set
        // for the next iteration (the engine sends, then sets).
        if !self.shared.control_pending.load(Ordering::Relaxed)
            || !self.shared.control_pending.swap(false, Ordering::AcqRel)
        {
            return 0;
        }
        let mut n = 0;
        while let Ok(msg) = self.control.try_recv() {
            n += 1;
            match msg {
                Control::Register {
                    blocks,
                    len,
                    user,
                    device,
                    reply,
                } => {
                    let _ = reply.send(self.register(blocks, len, user, device));
                }
                Control::Metadata { reply } => {
                    let instance = self.cfg.instance;
                    let meta = self.ucx().describe(instance);
                    let bytes = meta.map(|m| m.encode_keyed(self.cfg.auth.as_ref()));
                    let _ = reply.send(bytes.map_err(PeerError::from));
                }
                Control::AddPeer { meta, reply } => {
                    self.drain_commands(&mut None);
                    let _ = reply.send(self.add_peer(&meta));
                }
                Control::RemovePeer { peer, reply } => {
                    // What the engine submitted before this call (a lend
                    // that names the peer as its writer) comes first.
                    self.drain_commands(&mut None);
                    let known = self.core.remove_peer(peer);
                    self.execute(self.now());
                    let _ = reply.send(if known {
                        Ok(())
                    } else {
                        Err(PeerError::Unknown(peer))
                    });
                }
                Control::Shutdown => self.shared.stop.store(true, Ordering::Release),
            }
        }
        n
    }

    /// Adds a peer; the same engine's metadata again is a refresh: the
    /// same peer if nothing changed, a new entry if nothing uses the old
    /// one, refused while something does.
    fn add_peer(&mut self, meta: &PeerMetadata) -> Result<PeerId, PeerError> {
        if let Some(old) = self.core.peer_of(meta.instance) {
            if self.ucx().peer_metadata(old) == Some(meta) {
                return Ok(old);
            }
        }
        let peer = self
            .core
            .add_peer(meta.instance, meta.regions.len(), region_blocks(meta))
            .map_err(PeerError::Busy)?;
        self.execute(self.now());
        self.wire
            .add_peer(peer, meta)
            .map(|()| peer)
            .map_err(|status| {
                PeerError::Ucx(UcxError::Call {
                    op: "taking the peer's metadata",
                    status: UcxStatus(status),
                })
            })
    }
}

fn region_blocks(meta: &PeerMetadata) -> u64 {
    meta.regions.iter().map(|r| r.blocks).min().unwrap_or(0)
}
