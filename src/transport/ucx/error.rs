use std::fmt;

use thiserror::Error;
use ucx_sys::ucs_status_t as st;

use super::layout::LayoutError;
use crate::wire::FrameError;

/// A UCX status code (`ucs_status_t`, one signed byte).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct UcxStatus(pub i8);

impl UcxStatus {
    /// `UCS_OK`.
    pub const OK: Self = Self(st::UCS_OK);
    /// `UCS_ERR_CANCELED`: what a forced endpoint close gives every
    /// outstanding operation.
    pub const CANCELED: Self = Self(st::UCS_ERR_CANCELED);
    /// `UCS_ERR_ENDPOINT_TIMEOUT`: a peer that stopped answering.
    pub const ENDPOINT_TIMEOUT: Self = Self(st::UCS_ERR_ENDPOINT_TIMEOUT);
    /// `UCS_ERR_CONNECTION_RESET`.
    pub const CONNECTION_RESET: Self = Self(st::UCS_ERR_CONNECTION_RESET);
    /// `UCS_ERR_UNREACHABLE`.
    pub const UNREACHABLE: Self = Self(st::UCS_ERR_UNREACHABLE);

    /// Whether this is `UCS_OK`.
    pub fn is_ok(self) -> bool {
        self.0 == st::UCS_OK
    }

    /// UCX's own text for the status.
    pub fn as_str(self) -> &'static str {
        ucx_sys::status_str(self.0)
    }
}

impl fmt::Debug for UcxStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.as_str(), self.0)
    }
}

impl fmt::Display for UcxStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (ucs_status_t {})", self.as_str(), self.0)
    }
}

/// Every way the UCX layer can fail. Each variant says what was attempted.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum UcxError {
    /// A UCX call returned an error status.
    #[error("{op} failed: {status}")]
    Call {
        /// The UCX function that failed.
        op: &'static str,
        /// The status it returned.
        status: UcxStatus,
    },
    /// `ucp_init` found no usable device for the transport list asked for
    /// (`UCS_ERR_NO_DEVICE`): a misspelt or absent transport.
    #[error("no UCX transport in {asked:?} is usable on this machine; this UCX offers: {offered}")]
    NoUsableTransport {
        /// The transport list given (`UCX_TLS`).
        asked: String,
        /// The transports UCX can use here, comma separated.
        offered: String,
    },
    /// Worker address bytes from a peer did not check out.
    #[error("invalid worker address: {0}")]
    BadWorkerAddress(FrameError),
    /// Packed rkey bytes from a peer did not check out.
    #[error("invalid remote key: {0}")]
    BadRemoteKey(FrameError),
    /// Worker address bytes whose frame checked out but whose UCX layout
    /// does not: refused before `ucp_ep_create` could assert on it or read
    /// past its end.
    #[error("invalid worker address: {0}")]
    WorkerAddressLayout(LayoutError),
    /// Packed rkey bytes whose frame checked out but whose UCX layout does
    /// not: refused before `ucp_ep_rkey_unpack` could read past its end.
    #[error("invalid remote key: {0}")]
    RemoteKeyLayout(LayoutError),
    /// A remote key names a region that does not fit the address space
    /// (`base + len` overflows): refused before anything is posted with it.
    #[error("remote key region {base:#x}+{len} overflows the address space")]
    RemoteKeyBounds {
        /// The region's base address, as packed.
        base: u64,
        /// Its length, as packed.
        len: u64,
    },
    /// A configuration option could not be set.
    #[error("UCX option {name}={value} rejected: {status}")]
    BadOption {
        /// Option name, without the `UCX_` prefix.
        name: String,
        /// The value given.
        value: String,
        /// What `ucp_config_modify` said.
        status: UcxStatus,
    },
    /// An option name or value contained a NUL byte.
    #[error("UCX option {0:?} contains a NUL byte")]
    NulInOption(String),
    /// The endpoint was closed or failed; nothing more can be posted on it.
    #[error("endpoint is closed{}", match .0 { Some(s) => format!(" after an error: {s}"), None => String::new() })]
    EndpointClosed(Option<UcxStatus>),
    /// An operation's local range lies outside the registered region.
    #[error("local range {offset}+{len} is outside the {region_len}-byte region")]
    OutOfRange {
        /// Offset asked for.
        offset: u64,
        /// Length asked for.
        len: usize,
        /// Size of the region.
        region_len: usize,
    },
    /// The memory of a region could not be mapped.
    #[error("mapping {len} bytes for a region failed: {why}")]
    Allocate {
        /// Bytes asked for.
        len: usize,
        /// What the kernel said.
        why: String,
    },
    /// An active message payload over [`super::MAX_AM_PAYLOAD`].
    #[error("active message of {0} bytes exceeds the {max}-byte limit", max = super::MAX_AM_PAYLOAD)]
    MessageTooLong(usize),
    /// Caller memory that UCX found to be device memory, given where host
    /// memory was expected: refused (and unregistered) before anything
    /// copies through it with `memcpy`.
    #[error(
        "the memory at {base:#x} is {memory_type} memory, not host memory: regions of caller \
         memory are host memory; device memory is registered through kvpoll::gpu (feature cuda)"
    )]
    NotHostMemory {
        /// Start of the memory.
        base: usize,
        /// What UCX said it is.
        memory_type: &'static str,
    },
    /// The UCX library loaded is older than the one kvpoll was built
    /// against (or another major release): its structures and calls may
    /// lack what the build uses. Refused before any context is created.
    #[error(
        "UCX {runtime} is loaded but kvpoll was built against UCX {built} ({libdir}); \
         run with UCX {built_major}.{built_minor} or a newer 1.x, or rebuild against this one",
        built_major = .built.major, built_minor = .built.minor
    )]
    IncompatibleVersion {
        /// The version the loaded library reports (`ucp_get_version`).
        runtime: ucx_sys::Version,
        /// The version built against.
        built: ucx_sys::Version,
        /// Where the UCX built against was linked from.
        libdir: &'static str,
    },
}

impl UcxError {
    /// The UCX status behind this error: the one a call returned, the one
    /// an endpoint failed with (`CANCELED` for a plain close), or `None` for
    /// errors kvpoll found before calling UCX.
    pub fn status(&self) -> Option<UcxStatus> {
        match self {
            UcxError::Call { status, .. } | UcxError::BadOption { status, .. } => Some(*status),
            UcxError::EndpointClosed(s) => Some(s.unwrap_or(UcxStatus::CANCELED)),
            _ => None,
        }
    }
}

/// Turns a status into `Ok(())` or a [`UcxError::Call`] naming `op`.
pub(crate) fn check(op: &'static str, status: ucx_sys::Status) -> Result<(), UcxError> {
    if status == st::UCS_OK {
        Ok(())
    } else {
        Err(UcxError::Call {
            op,
            status: UcxStatus(status),
        })
    }
}
