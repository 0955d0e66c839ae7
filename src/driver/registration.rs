//! Memory registration: regions mapped (or allocated) by UCX, and their
//! layout handed to the core. Refused once a peer is added, since peers
//! hold this engine's rkeys.

use super::Driver;
use crate::error::RegionError;
use crate::transport::ucx::UcxTransport;

impl Driver {
    pub(super) fn ucx(&mut self) -> &mut UcxTransport {
        #[cfg(feature = "fault-injection")]
        return self.wire.inner();
        #[cfg(not(feature = "fault-injection"))]
        return &mut self.wire;
    }

    pub(super) fn register(
        &mut self,
        blocks: u64,
        len: usize,
        user: Option<usize>,
    ) -> Result<(usize, usize), RegionError> {
        if self.core.has_peers() {
            return Err(RegionError::Frozen);
        }
        // SAFETY: Engine::register_memory's caller guarantees the range
        // stays valid, writable and in place for the engine's lifetime.
        let out = unsafe { self.ucx().register(blocks, len, user)? };
        let regions = self.ucx().regions();
        self.core.set_local_layout(regions, blocks);
        Ok(out)
    }
}
