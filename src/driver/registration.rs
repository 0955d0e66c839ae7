//! Memory registration: regions mapped (or allocated) by UCX, and their
//! layout handed to the core. Refused once a peer is added, since peers
//! hold this engine's rkeys.

use super::control::DeviceMemory;
use super::Driver;
use crate::error::RegionError;
use crate::transport::ucx::{UcxTransport, UserMemory};

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
        device: Option<DeviceMemory>,
    ) -> Result<(usize, usize), RegionError> {
        if self.core.has_peers() {
            return Err(RegionError::Frozen);
        }
        let memory = match (user, &device) {
            (None, _) => None,
            (Some(base), None) => Some(UserMemory::Host(base)),
            (Some(_), Some(d)) => Some(self.prepare_device(d)?),
        };
        // SAFETY: Engine::register_memory's caller guarantees the range
        // stays valid, writable and in place for the engine's lifetime
        // (register_device_memory's likewise, and prepare_device made its
        // device's context current here).
        let out = unsafe { self.ucx().register(blocks, len, memory)? };
        if let Some(d) = device {
            self.ucx().keep_until_drop(Box::new(d));
        }
        let regions = self.ucx().regions();
        self.core.set_local_layout(regions, blocks);
        Ok(out)
    }

    /// Makes the device's context current on the poller thread (UCX's CUDA
    /// transports register and move device memory in it) and checks that
    /// this UCX can register CUDA memory at all.
    #[cfg(feature = "cuda")]
    fn prepare_device(&mut self, device: &DeviceMemory) -> Result<UserMemory, RegionError> {
        device.bind()?;
        if !self.ucx().supports_cuda()? {
            return Err(crate::gpu::GpuError::UcxWithoutCuda.into());
        }
        Ok(UserMemory::Cuda(device.base()))
    }

    #[cfg(not(feature = "cuda"))]
    fn prepare_device(&mut self, device: &DeviceMemory) -> Result<UserMemory, RegionError> {
        match *device {}
    }
}
