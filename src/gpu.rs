//! KV regions in GPU memory (feature `cuda`): device memory registered with
//! UCX as `UCS_MEMORY_TYPE_CUDA`, so UCX moves blocks straight to and from
//! the GPU (GPUDirect RDMA where the NIC allows, `cuda_ipc` between
//! processes of one host, staged through host memory by `cuda_copy`
//! otherwise). [`DeviceMemory`] is the caller's device memory as
//! [`crate::Engine::register_device_memory`] checks and keeps it;
//! [`GpuRegion`] allocates device memory for a transport-level region.
//!
//! Two things must be present, and each absence is a typed error, never a
//! panic: the CUDA driver with a device ([`GpuError::NoDriver`],
//! [`GpuError::NoDevice`]), and a UCX with CUDA transports
//! ([`GpuError::UcxWithoutCuda`]; the `libucx-cu12` wheel's UCX has them,
//! `KVPOLL_UCX_HOME` builds against it). The driver is loaded at run time,
//! so this feature builds on machines without CUDA.
//!
//! Neither is a [`MemoryRegion`] to its users: the latter's `read`/`write`
//! copy with `memcpy` through host pointers, which would fault on device
//! memory. Both copy with the CUDA driver instead, and the UCX
//! registration stays inside the crate.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream, DevicePtr, DriverError};
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
        "this UCX has no CUDA support (ucp_context_query lists no CUDA memory type: UCX \
         built without CUDA, its CUDA transports not loaded, or left out of the transport \
         list): use one with cuda_copy/cuda_ipc, such as the libucx-cu12 wheel's \
         (KVPOLL_UCX_HOME), and leave them in UCX_TLS"
    )]
    UcxWithoutCuda,
    /// A CUDA driver call failed.
    #[error("CUDA: {0}")]
    Cuda(#[from] DriverError),
    /// A UCX call failed.
    #[error("UCX: {0}")]
    Ucx(#[from] UcxError),
    /// Memory given as device memory that CUDA does not report as one
    /// device allocation covering the whole range.
    #[error("{len} bytes at {base:#x} are not CUDA device memory: {why}")]
    NotDeviceMemory {
        /// Start of the range.
        base: u64,
        /// Its length.
        len: usize,
        /// What CUDA said about it.
        why: String,
    },
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

/// Device memory a caller owns (a serving engine's KV cache), checked with
/// the CUDA driver before it is registered: one device allocation covers
/// the whole range. It holds the device's primary context, retained, for
/// as long as the region is registered, and makes it current on the threads
/// that copy blocks or progress UCX over the memory (UCX's CUDA transports
/// work in the calling thread's context).
#[derive(Clone)]
pub struct DeviceMemory {
    base: u64,
    len: usize,
    context: Arc<CudaContext>,
}

impl std::fmt::Debug for DeviceMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceMemory")
            .field("base", &format_args!("{:#x}", self.base))
            .field("len", &self.len)
            .field("ordinal", &self.context.ordinal())
            .finish()
    }
}

/// One attribute of the memory at `ptr`, as `cuPointerGetAttribute` gives it.
///
/// # Safety
/// `T` must be the type the driver writes for `attribute` (`c_uint` for
/// the memory type and flags, `c_int` for the ordinal, `CUdeviceptr` for
/// the range start, `usize` for its size); the driver must be loadable.
unsafe fn pointer_attribute<T: Default>(
    ptr: u64,
    attribute: sys::CUpointer_attribute,
) -> Result<T, DriverError> {
    let mut value = T::default();
    // SAFETY: value is a live out-parameter of the type the caller chose
    // for this attribute; the driver reads nothing through it.
    unsafe {
        sys::cuPointerGetAttribute(&mut value as *mut T as *mut c_void, attribute, ptr).result()?;
    }
    Ok(value)
}

impl DeviceMemory {
    /// Checks that `base..base+len` is CUDA device memory, all of it inside
    /// one allocation, and retains its device's primary context (making it
    /// current on this thread). A machine without the driver or a GPU, an
    /// address CUDA does not know (host memory, freed memory), pinned host
    /// or managed memory, and a range past its allocation are typed errors.
    pub fn probe(base: u64, len: usize) -> Result<Self, GpuError> {
        if !driver_present() {
            return Err(GpuError::NoDriver);
        }
        let count = CudaContext::device_count().map_err(|e| GpuError::NoDevice {
            ordinal: 0,
            detail: e.to_string(),
        })?;
        if count <= 0 {
            return Err(GpuError::NoDevice {
                ordinal: 0,
                detail: format!("the driver reports {count} device(s)"),
            });
        }
        let not = |why: String| GpuError::NotDeviceMemory { base, len, why };
        if base == 0 || len == 0 {
            return Err(not("a null or empty range".into()));
        }
        use sys::CUpointer_attribute::*;
        // SAFETY: the memory type is written as a c_uint; the driver was
        // found above (and likewise for each attribute below, of its type).
        let kind: u32 = unsafe { pointer_attribute(base, CU_POINTER_ATTRIBUTE_MEMORY_TYPE) }
            .map_err(|e| not(format!("CUDA does not know the address ({e})")))?;
        if kind != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            return Err(not(format!(
                "CUDA reports memory type {kind} (1: pinned host memory, which is registered \
                 as host memory)"
            )));
        }
        // SAFETY: a c_uint flag.
        let managed: u32 = unsafe { pointer_attribute(base, CU_POINTER_ATTRIBUTE_IS_MANAGED) }?;
        if managed != 0 {
            return Err(not("managed (unified) memory is not supported".into()));
        }
        // SAFETY: a c_int.
        let ordinal: i32 = unsafe { pointer_attribute(base, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL) }?;
        // SAFETY: a CUdeviceptr.
        let start: sys::CUdeviceptr =
            unsafe { pointer_attribute(base, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR) }?;
        // SAFETY: a size_t.
        let size: usize = unsafe { pointer_attribute(base, CU_POINTER_ATTRIBUTE_RANGE_SIZE) }?;
        let alloc_end = start.checked_add(size as u64);
        let end = base.checked_add(len as u64);
        match (alloc_end, end) {
            (Some(a), Some(e)) if e <= a => {}
            _ => {
                return Err(not(format!(
                    "it runs past its allocation of {size} bytes at {start:#x}"
                )))
            }
        }
        let ordinal = usize::try_from(ordinal).map_err(|_| GpuError::NoDevice {
            ordinal: 0,
            detail: format!("CUDA reports device ordinal {ordinal}"),
        })?;
        let context = open_device(ordinal)?;
        Ok(Self { base, len, context })
    }

    /// Start of the memory (a device address).
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty (never, once probed).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The GPU it lives on.
    pub fn ordinal(&self) -> usize {
        self.context.ordinal()
    }

    /// Makes the device's primary context current on this thread.
    pub fn bind(&self) -> Result<(), GpuError> {
        Ok(self.context.bind_to_thread()?)
    }

    fn check(&self, at: u64, len: usize) -> Result<(), GpuError> {
        let inside = at
            .checked_sub(self.base)
            .and_then(|off| off.checked_add(len as u64))
            .is_some_and(|end| end <= self.len as u64);
        if inside {
            Ok(())
        } else {
            Err(GpuError::OutOfRange {
                offset: at.wrapping_sub(self.base),
                len,
                region_len: self.len,
            })
        }
    }

    /// Copies `src` to the device address `at` (inside the memory).
    pub fn write(&self, at: u64, src: &[u8]) -> Result<(), GpuError> {
        self.check(at, src.len())?;
        self.bind()?;
        // SAFETY: at..at+len lies inside the probed device allocation
        // (checked), which the caller keeps allocated while registered.
        unsafe { cudarc::driver::result::memcpy_htod_sync(at, src) }?;
        // From pageable memory the copy may still be in flight to the
        // device when it returns: wait, so that a transfer posted next
        // moves these bytes.
        cudarc::driver::result::ctx::synchronize()?;
        Ok(())
    }

    /// Copies the bytes at device address `at` (inside the memory) into `dst`.
    pub fn read(&self, at: u64, dst: &mut [u8]) -> Result<(), GpuError> {
        self.check(at, dst.len())?;
        self.bind()?;
        // SAFETY: as in write; the copy is synchronous, so dst is filled
        // when it returns.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(dst, at) }?;
        Ok(())
    }
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
        // SAFETY: address..address+len is device memory owned by `memory`,
        // which this struct keeps alive until after `region` is dropped (field
        // order).
        let region = unsafe { MemoryRegion::map_device(context, address, len)? };
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
