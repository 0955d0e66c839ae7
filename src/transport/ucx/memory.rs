use std::ffi::c_void;
use std::ptr;
use std::rc::Rc;

use ucx_sys as sys;

use super::context::Context;
use super::endpoint::{Endpoint, EndpointInner};
use super::error::{check, UcxError, UcxStatus};
use super::layout;
use crate::wire::{self, FrameError, Kind};

/// Memory registered with UCX, either mapped from the caller or allocated
/// by UCX (which, on one host, makes puts and gets truly one-sided over
/// shared memory).
pub struct MemoryRegion {
    context: Context,
    memh: sys::ucp_mem_h,
    base: *mut u8,
    len: usize,
}

/// Anonymous memory this process maps for a region (`mmap`, huge pages
/// asked for with `madvise(MADV_HUGEPAGE)`), unmapped when dropped; what
/// [`crate::transport::ucx::UcxTransport`] registers instead of asking UCX
/// to allocate where cma moves the bytes ([`Context::reads_by_cma`]): cma
/// pins every page it copies, so 2 MiB pages cost it less than 4 KiB ones.
pub struct HugePages {
    base: *mut u8,
    len: usize,
}

impl HugePages {
    /// At least `len` bytes, rounded up to whole 2 MiB, zeroed (touched
    /// only when first used). A kernel without transparent huge pages
    /// leaves 4 KiB pages, which work the same.
    pub fn map(len: usize) -> std::io::Result<Self> {
        let len = len.max(1).div_ceil(2 << 20) * (2 << 20);
        // SAFETY: a fresh private anonymous mapping; no memory is named.
        let base = unsafe {
            libc::mmap(
                ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: base..base+len is the mapping just made; advice only.
        unsafe { libc::madvise(base, len, libc::MADV_HUGEPAGE) };
        Ok(HugePages {
            base: base as *mut u8,
            len,
        })
    }

    /// The mapping's first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.base
    }

    /// Its length in bytes (whole 2 MiB).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never empty; for clippy.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

// SAFETY: a plain mapping owned by this value; nothing is tied to a thread.
unsafe impl Send for HugePages {}

impl Drop for HugePages {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once; its region was
        // unregistered before (the transport drops regions first).
        unsafe { libc::munmap(self.base as *mut c_void, self.len) };
    }
}

/// UCX's name for a memory type (`ucs_memory_type_t`).
fn memory_type_name(t: sys::ucs_memory_type_t) -> &'static str {
    match t {
        sys::UCS_MEMORY_TYPE_HOST => "host",
        sys::UCS_MEMORY_TYPE_CUDA => "CUDA device",
        sys::UCS_MEMORY_TYPE_CUDA_MANAGED => "CUDA managed",
        sys::UCS_MEMORY_TYPE_ROCM => "ROCm device",
        sys::UCS_MEMORY_TYPE_ROCM_MANAGED => "ROCm managed",
        _ => "non-host",
    }
}

impl MemoryRegion {
    /// Lets UCX allocate and register `len` bytes of host memory.
    pub fn allocate(context: &Context, len: usize) -> Result<Self, UcxError> {
        let params = sys::ucp_mem_map_params_t {
            field_mask: (sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | sys::UCP_MEM_MAP_PARAM_FIELD_FLAGS) as u64,
            address: ptr::null_mut(),
            length: len,
            flags: sys::UCP_MEM_MAP_ALLOCATE,
            ..Default::default()
        };
        // SAFETY: params ask UCX for fresh memory; no caller memory involved.
        unsafe { Self::map_params(context, &params) }
    }

    /// Registers `len` bytes at `base`, which the caller owns.
    ///
    /// # Safety
    /// `base..base+len` must be valid, writable host memory that stays
    /// allocated, and is not freed or moved, until this region is dropped.
    pub unsafe fn map(context: &Context, base: *mut u8, len: usize) -> Result<Self, UcxError> {
        let params = sys::ucp_mem_map_params_t {
            field_mask: (sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH)
                as u64,
            address: base as *mut c_void,
            length: len,
            ..Default::default()
        };
        // SAFETY: the caller guarantees the range (see above).
        let region = unsafe { Self::map_params(context, &params) }?;
        // A UCX with device transports detects device memory by itself;
        // read and write would memcpy through it as host memory and fault.
        let mut attr = sys::ucp_mem_attr_t {
            field_mask: sys::UCP_MEM_ATTR_FIELD_MEM_TYPE as u64,
            ..Default::default()
        };
        // SAFETY: the region's memh is mapped until it drops.
        check("ucp_mem_query", unsafe {
            sys::ucp_mem_query(region.memh, &mut attr)
        })?;
        if attr.mem_type != sys::UCS_MEMORY_TYPE_HOST {
            return Err(UcxError::NotHostMemory {
                base: base as usize,
                memory_type: memory_type_name(attr.mem_type),
            });
        }
        Ok(region)
    }

    /// Registers `len` bytes of CUDA device memory at the device address
    /// `base` *as* device memory (`UCS_MEMORY_TYPE_CUDA`), so that UCX
    /// moves it over its CUDA transports. The region's `read` and `write`
    /// must not be used on it: they copy through host pointers.
    ///
    /// # Safety
    /// `base..base+len` must be one CUDA device allocation that stays
    /// allocated until this region is dropped, and the thread must have a
    /// CUDA context current in which it is valid.
    pub unsafe fn map_device(context: &Context, base: u64, len: usize) -> Result<Self, UcxError> {
        let params = sys::ucp_mem_map_params_t {
            field_mask: (sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | sys::UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE) as u64,
            address: base as usize as *mut c_void,
            length: len,
            memory_type: sys::UCS_MEMORY_TYPE_CUDA,
            ..Default::default()
        };
        // SAFETY: the caller's promise; the memory type tells UCX not to
        // touch it as host memory.
        unsafe { Self::map_params(context, &params) }
    }

    /// # Safety
    /// If `params` names caller memory, it must satisfy [`MemoryRegion::map`].
    pub(crate) unsafe fn map_params(
        context: &Context,
        params: &sys::ucp_mem_map_params_t,
    ) -> Result<Self, UcxError> {
        let mut params = *params;
        if !context.allows_remote_write() {
            // What the region is for, said to UCX; UCX 1.13.1 and 1.22.0
            // read no `prot` (`ucp_mem_map_params2uct_flags`, ucp_mm.c) and
            // ask every memory domain for remote puts whenever the context
            // has RMA, so no NIC refuses a write on their account: only a
            // UCX that honours it does (docs/design.md §4).
            params.field_mask |= sys::UCP_MEM_MAP_PARAM_FIELD_PROT as u64;
            params.prot = (sys::UCP_MEM_MAP_PROT_LOCAL_READ
                | sys::UCP_MEM_MAP_PROT_LOCAL_WRITE
                | sys::UCP_MEM_MAP_PROT_REMOTE_READ) as _;
        }
        let mut memh = ptr::null_mut();
        // SAFETY: the context is live; params are valid for the call.
        check("ucp_mem_map", unsafe {
            sys::ucp_mem_map(context.inner.handle, &params, &mut memh)
        })?;
        let mut attr = sys::ucp_mem_attr_t {
            field_mask: (sys::UCP_MEM_ATTR_FIELD_ADDRESS | sys::UCP_MEM_ATTR_FIELD_LENGTH) as u64,
            ..Default::default()
        };
        // SAFETY: memh was just mapped.
        let status = unsafe { sys::ucp_mem_query(memh, &mut attr) };
        if status != sys::ucs_status_t::UCS_OK {
            // SAFETY: unmapping what we mapped, once.
            unsafe { sys::ucp_mem_unmap(context.inner.handle, memh) };
            return Err(UcxError::Call {
                op: "ucp_mem_query",
                status: UcxStatus(status),
            });
        }
        Ok(Self {
            context: context.clone(),
            memh,
            base: attr.address as *mut u8,
            len: params.length.min(attr.length),
        })
    }

    /// Start of the region.
    pub fn as_ptr(&self) -> *mut u8 {
        self.base
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(crate) fn memh(&self) -> sys::ucp_mem_h {
        self.memh
    }

    /// The address of `offset..offset+len`, if inside the region.
    pub(crate) fn range_ptr(&self, offset: u64, len: usize) -> Result<*mut u8, UcxError> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.len as u64 => {
                // SAFETY: offset + len <= self.len, so the result stays
                // inside the allocation.
                Ok(unsafe { self.base.add(offset as usize) })
            }
            _ => Err(UcxError::OutOfRange {
                offset,
                len,
                region_len: self.len,
            }),
        }
    }

    /// Copies `src` into the region at `offset` (local writes, e.g. to fill
    /// blocks before a transfer).
    pub fn write(&self, offset: u64, src: &[u8]) -> Result<(), UcxError> {
        let dst = self.range_ptr(offset, src.len())?;
        // SAFETY: dst..dst+len is inside the region (checked); src cannot
        // overlap it (it is a Rust slice the caller owns).
        unsafe { ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        Ok(())
    }

    /// Copies the region's bytes at `offset` into `dst`.
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), UcxError> {
        let src = self.range_ptr(offset, dst.len())?;
        // SAFETY: src..src+len is inside the region (checked).
        unsafe { ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Packs a remote key for a peer: framed, with the region's bounds, so
    /// the peer can check every remote range before posting.
    pub fn pack_rkey(&self) -> Result<PackedRkey, UcxError> {
        let mut buf = ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: context and memh are live; UCX allocates buf, released below.
        check("ucp_rkey_pack", unsafe {
            sys::ucp_rkey_pack(self.context.inner.handle, self.memh, &mut buf, &mut size)
        })?;
        let mut payload = Vec::with_capacity(16 + size);
        payload.extend_from_slice(&(self.base as u64).to_le_bytes());
        payload.extend_from_slice(&(self.len as u64).to_le_bytes());
        // SAFETY: UCX gave `size` readable bytes at buf.
        payload.extend_from_slice(unsafe { std::slice::from_raw_parts(buf as *const u8, size) });
        // SAFETY: releasing the buffer ucp_rkey_pack allocated, once.
        unsafe { sys::ucp_rkey_buffer_release(buf) };
        Ok(PackedRkey(wire::encode(Kind::RemoteKey, &payload)))
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: memh was mapped on this (live) context and is unmapped once.
        // Endpoints that posted into it hold no reference: the caller must not
        // drop a region with operations outstanding (the poller's ledger
        // guarantees quiescence before regions go).
        unsafe { sys::ucp_mem_unmap(self.context.inner.handle, self.memh) };
    }
}

/// A packed remote key as a peer sends it: framed and checksummed, carrying
/// the remote region's base address and length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedRkey(Vec<u8>);

impl PackedRkey {
    /// Checks bytes received from a peer.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, UcxError> {
        let payload = wire::decode(bytes, Kind::RemoteKey).map_err(UcxError::BadRemoteKey)?;
        if payload.len() <= 16 {
            return Err(UcxError::BadRemoteKey(FrameError::Truncated {
                got: payload.len(),
                need: 17,
            }));
        }
        let key = Self(bytes.to_vec());
        let (base, len, raw) = key.parts();
        layout::check_rkey(raw).map_err(UcxError::RemoteKeyLayout)?;
        if base.checked_add(len).is_none() {
            return Err(UcxError::RemoteKeyBounds { base, len });
        }
        Ok(key)
    }

    /// The framed bytes to send to a peer.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// Size of the region the key opens, as its owner packed it.
    pub fn region_len(&self) -> u64 {
        self.parts().1
    }

    /// The region's base address in its owner's process, and its length.
    pub fn span(&self) -> (u64, u64) {
        let (base, len, _) = self.parts();
        (base, len)
    }

    fn parts(&self) -> (u64, u64, &[u8]) {
        // Checked at construction.
        let p = wire::decode(&self.0, Kind::RemoteKey).unwrap_or(&[0; 17]);
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&p[i..i + 8]);
            u64::from_le_bytes(w)
        };
        (word(0), word(8), &p[16..])
    }
}

/// A remote key unpacked on one endpoint; only that endpoint may use it.
pub struct RemoteKey {
    rkey: sys::ucp_rkey_h,
    base: u64,
    len: u64,
    /// The key names host memory (its packed memory type).
    host: bool,
    pub(crate) endpoint: Rc<EndpointInner>,
}

impl RemoteKey {
    /// Unpacks `packed` for use on `endpoint`.
    pub fn unpack(endpoint: &Endpoint, packed: &PackedRkey) -> Result<Self, UcxError> {
        let (base, len, raw) = packed.parts();
        let host = layout::rkey_memory_type(raw) == Some(sys::UCS_MEMORY_TYPE_HOST as u8);
        let ep = endpoint.inner.raw();
        if ep.is_null() {
            return Err(UcxError::EndpointClosed(endpoint.failure()));
        }
        let mut rkey = ptr::null_mut();
        // UCX takes no length: the padding bounds what a transport reads of
        // its own part of the key (src/transport/ucx/layout.rs).
        let raw = layout::padded(raw);
        // SAFETY: ep is live; raw's layout was walked when `packed` was made
        // (every length inside it fits it) and it lives for the call.
        check("ucp_ep_rkey_unpack", unsafe {
            sys::ucp_ep_rkey_unpack(ep, raw.as_ptr() as *const c_void, &mut rkey)
        })?;
        Ok(Self {
            rkey,
            base,
            len,
            host,
            endpoint: endpoint.inner.clone(),
        })
    }

    pub(crate) fn raw(&self) -> sys::ucp_rkey_h {
        self.rkey
    }

    /// Size of the remote region.
    pub fn remote_len(&self) -> u64 {
        self.len
    }

    /// The address in this process of the remote region's first byte,
    /// where UCX mapped the whole region here when it unpacked the key
    /// (`ucp_rkey_ptr`: a shared-memory segment the peer allocated through
    /// UCX, `posix` or `sysv`); the region's bytes follow it. `None` for
    /// memory UCX reaches only through a transport (memory the peer
    /// registered itself, anything over tcp), for device memory (UCX 1.22
    /// maps CUDA memory of a peer too, as device addresses), for an empty
    /// region, and where the two ends of the region do not map `len - 1`
    /// bytes apart.
    pub fn mapped(&self) -> Option<*mut u8> {
        if !self.host {
            return None;
        }
        let last = self.base.checked_add(self.len.checked_sub(1)?)?;
        let at = |addr: u64| {
            let mut p = ptr::null_mut();
            // SAFETY: the key is live; UCX only computes an address.
            let status = unsafe { sys::ucp_rkey_ptr(self.rkey, addr, &mut p) };
            (status == sys::ucs_status_t::UCS_OK && !p.is_null()).then_some(p as usize)
        };
        let (first, end) = (at(self.base)?, at(last)?);
        (end.checked_sub(first) == Some((self.len - 1) as usize)).then_some(first as *mut u8)
    }

    pub(crate) fn range_addr(&self, offset: u64, len: usize) -> Result<u64, UcxError> {
        // Checked all the way: base + len was checked at unpacking, but the
        // sum is recomputed without trusting that.
        let end = offset.checked_add(len as u64);
        match (end, self.base.checked_add(offset)) {
            (Some(end), Some(addr)) if end <= self.len => Ok(addr),
            _ => Err(UcxError::OutOfRange {
                offset,
                len,
                region_len: self.len as usize,
            }),
        }
    }
}

impl Drop for RemoteKey {
    fn drop(&mut self) {
        // SAFETY: unpacked once, destroyed once, while the endpoint's worker
        // is alive (we hold the endpoint, which holds the worker).
        unsafe { sys::ucp_rkey_destroy(self.rkey) }
    }
}
