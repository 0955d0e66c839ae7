//! KV regions in GPU memory (feature `cuda`): device memory allocated with
//! cudarc and registered with UCX as `UCS_MEMORY_TYPE_CUDA`, so UCX moves
//! blocks straight to and from the GPU (GPUDirect RDMA where the NIC allows,
//! staged through host memory by `cuda_copy` otherwise).
//!
//! Two things must be present, and each absence is a typed error, never a
//! panic: the CUDA driver with a device ([`GpuError::NoDriver`],
//! [`GpuError::NoDevice`]), and a UCX built with CUDA support
//! ([`GpuError::UcxWithoutCuda`]; point `PKG_CONFIG_PATH` and
//! `LD_LIBRARY_PATH` at one). The driver is loaded at run time, so this
//! feature builds on machines without CUDA.
//!
//! A [`GpuRegion`] is not a [`MemoryRegion`] to its users: the latter's
//! `read`/`write` copy with `memcpy` through host pointers, which would fault
//! on device memory. `GpuRegion` copies with the CUDA driver instead and
//! hands the UCX registration only to the transport inside the crate.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DriverError};
use thiserror::Error;

use crate::transport::ucx::{
    BlockOp, Completion, Context, ContextOptions, Endpoint, MemoryRegion, PackedRkey, RemoteKey,
    UcxError, Worker,
};

/// Why GPU memory is not available or an operation on it failed.
#[derive(Debug, Error)]
pub enum GpuError {
    /// The CUDA driver library (`libcuda.so`) cannot be loaded: no NVIDIA
    /// driver on this machine.
    #[error("no GPU: the CUDA driver library (libcuda.so) cannot be loaded on this machine")]
    NoDriver,
    /// The driver loads but has no device with this ordinal.
    #[error("no GPU {ordinal}: {detail}")]
    NoDevice {
        /// The device asked for.
        ordinal: usize,
        /// What the driver said (device count or error).
        detail: String,
    },
    /// The UCX library in use cannot register CUDA memory.
    #[error(
        "this UCX has no CUDA support (ucp_context_query lists no CUDA memory type): \
         build UCX --with-cuda and point PKG_CONFIG_PATH / LD_LIBRARY_PATH at it"
    )]
    UcxWithoutCuda,
    /// A CUDA driver call failed.
    #[error("CUDA: {0}")]
    Cuda(#[from] DriverError),
    /// A UCX call failed.
    #[error("UCX: {0}")]
    Ucx(#[from] UcxError),
    /// A copy outside the region.
    #[error("{len} bytes at offset {offset} do not fit the {region_len}-byte GPU region")]
    OutOfRange {
        /// Start of the copy.
        offset: u64,
        /// Its length.
        len: usize,
        /// The region's length.
        region_len: usize,
    },
}

/// Whether the CUDA driver library can be loaded. Safe to call anywhere:
/// it only tries to open the library.
pub fn driver_present() -> bool {
    // SAFETY: is_culib_present only attempts dlopen of the library names and
    // drops the handle; it calls no CUDA function.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Device memory registered with UCX as CUDA memory.
pub struct GpuRegion {
    // Fields drop in declaration order: the UCX registration goes before
    // the device memory it describes is freed.
    region: MemoryRegion,
    memory: CudaSlice<u8>,
    stream: Arc<CudaStream>,
    ordinal: usize,
}

impl GpuRegion {
    /// Allocates `len` bytes (zeroed) on GPU `ordinal` and registers them
    /// with `context`.
    pub fn allocate(context: &Context, ordinal: usize, len: usize) -> Result<Self, GpuError> {
        // Check the GPU before UCX so that a machine without one says so.
        let cuda = open_device(ordinal)?;
        if !context.supports_cuda()? {
            return Err(GpuError::UcxWithoutCuda);
        }
        let stream = cuda.default_stream();
        let memory = stream.alloc_zeros::<u8>(len)?;
        stream.synchronize()?;
        let address = {
            let (ptr, _sync) = memory.device_ptr(&stream);
            ptr
        };
        let params = ucx_sys::ucp_mem_map_params_t {
            field_mask: (ucx_sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | ucx_sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | ucx_sys::UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE) as u64,
            address: address as usize as *mut c_void,
            length: len,
            memory_type: ucx_sys::UCS_MEMORY_TYPE_CUDA,
            ..Default::default()
        };
        // SAFETY: address..address+len is device memory owned by `memory`,
        // which this struct keeps alive until after `region` is dropped (field
        // order); the memory type tells UCX not to touch it as host memory.
        let region = unsafe { MemoryRegion::map_params(context, &params)? };
        tracing::debug!(ordinal, len, "GPU region registered");
        Ok(Self {
            region,
            memory,
            stream,
            ordinal,
        })
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.memory.len()
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The GPU it lives on.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device address of the region's start (for logs; not a host pointer).
    pub fn device_address(&self) -> u64 {
        self.region.as_ptr() as u64
    }

    fn range(&self, offset: u64, len: usize) -> Result<std::ops::Range<usize>, GpuError> {
        let out_of_range = || GpuError::OutOfRange {
            offset,
            len,
            region_len: self.len(),
        };
        let start = usize::try_from(offset).map_err(|_| out_of_range())?;
        match start.checked_add(len) {
            Some(end) if end <= self.len() => Ok(start..end),
            _ => Err(out_of_range()),
        }
    }

    /// Copies `src` into the region at `offset` through the CUDA driver.
    pub fn write(&mut self, offset: u64, src: &[u8]) -> Result<(), GpuError> {
        let range = self.range(offset, src.len())?;
        let mut dst = self.memory.slice_mut(range);
        self.stream.memcpy_htod(src, &mut dst)?;
        self.stream.synchronize()?;
        Ok(())
    }

    /// Copies the region's bytes at `offset` into `dst` through the CUDA driver.
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), GpuError> {
        let range = self.range(offset, dst.len())?;
        let src = self.memory.slice(range);
        self.stream.memcpy_dtoh(&src, dst)?;
        self.stream.synchronize()?;
        Ok(())
    }

    /// Packs a remote key so that a peer can read or write this region.
    pub fn pack_rkey(&self) -> Result<PackedRkey, GpuError> {
        Ok(self.region.pack_rkey()?)
    }

    /// The UCX registration, for posting operations. Crate-only: its
    /// `read`/`write` must never be used on device memory.
    pub(crate) fn transport_region(&self) -> &MemoryRegion {
        &self.region
    }
}

fn open_device(ordinal: usize) -> Result<Arc<CudaContext>, GpuError> {
    if !driver_present() {
        tracing::debug!(ordinal, "no CUDA driver: GPU memory unavailable");
        return Err(GpuError::NoDriver);
    }
    let count = CudaContext::device_count().map_err(|e| GpuError::NoDevice {
        ordinal,
        detail: e.to_string(),
    })?;
    if ordinal >= usize::try_from(count).unwrap_or(0) {
        return Err(GpuError::NoDevice {
            ordinal,
            detail: format!("the driver reports {count} device(s)"),
        });
    }
    CudaContext::new(ordinal).map_err(|e| GpuError::NoDevice {
        ordinal,
        detail: e.to_string(),
    })
}

/// What [`loopback_check`] moved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoopbackReport {
    /// The GPU used.
    pub ordinal: usize,
    /// Bytes in the block.
    pub block_size: usize,
    /// The block arrived intact in GPU memory (UCX get: host → GPU).
    pub host_to_gpu: bool,
    /// The block arrived intact back in host memory (UCX put: GPU → host).
    pub gpu_to_host: bool,
}

/// Moves one block through UCX between two workers in this process: a get
/// from host memory into a [`GpuRegion`], then a put from the GPU region
/// into a second host region, checking the bytes each way. The prepared
/// check for GPU machines (`scripts/gpu-check.sh`).
pub fn loopback_check(ordinal: usize, block_size: usize) -> Result<LoopbackReport, GpuError> {
    let options = ContextOptions::default();
    let (host_ctx, gpu_ctx) = (Context::new(&options)?, Context::new(&options)?);
    let gpu = GpuRegion::allocate(&gpu_ctx, ordinal, block_size)?;
    let host_worker = Worker::new(&host_ctx)?;
    let gpu_worker = Worker::new(&gpu_ctx)?;
    let source = MemoryRegion::allocate(&host_ctx, block_size)?;
    let sink = MemoryRegion::allocate(&host_ctx, block_size)?;
    let block: Vec<u8> = (0..block_size).map(|i| (i * 131 + 7) as u8).collect();
    source.write(0, &block)?;

    let ep = Endpoint::connect(&gpu_worker, &host_worker.address()?, 1)?;
    let op = [BlockOp {
        local_offset: 0,
        remote_offset: 0,
        len: block_size,
        token: 1,
    }];
    let wait = |done: &mut Vec<Completion>| -> Result<(), GpuError> {
        while done.is_empty() {
            gpu_worker.progress();
            host_worker.progress();
            gpu_worker.take_completions(done);
        }
        match done.iter().find(|c| !c.status.is_ok()) {
            Some(c) => Err(GpuError::Ucx(UcxError::Call {
                op: "GPU loopback transfer",
                status: c.status,
            })),
            None => Ok(()),
        }
    };

    let mut done = Vec::new();
    let rkey = RemoteKey::unpack(&ep, &source.pack_rkey()?)?;
    ep.get_batch(gpu.transport_region(), &rkey, &op)
        .map_err(|e| e.error)?;
    wait(&mut done)?;
    let mut back = vec![0u8; block_size];
    gpu.read(0, &mut back)?;
    let host_to_gpu = back == block;

    done.clear();
    let sink_key = RemoteKey::unpack(&ep, &sink.pack_rkey()?)?;
    ep.put_batch(gpu.transport_region(), &sink_key, &op)
        .map_err(|e| e.error)?;
    wait(&mut done)?;
    // A completed put only means the source is reusable: flush so the bytes
    // are in the sink before reading it.
    done.clear();
    ep.flush(2)?;
    wait(&mut done)?;
    let mut landed = vec![0u8; block_size];
    sink.read(0, &mut landed)?;
    Ok(LoopbackReport {
        ordinal,
        block_size,
        host_to_gpu,
        gpu_to_host: landed == block,
    })
}
