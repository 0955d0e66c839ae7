//! The layout of a peer's UCX worker address and packed rkey, checked before
//! UCX sees the bytes.
//!
//! `ucp_ep_create` and `ucp_ep_rkey_unpack` take no length: they walk the
//! bytes by the lengths and "last" flags inside them, and assert on a
//! version they do not know (`ucp_address_unpack`: an address version other
//! than v1 or v2, nibble 0 or 1, aborts the process). So kvpoll walks both
//! formats the way UCX 1.13 and UCX 1.22 read them (`src/ucp/wireup/address.c`,
//! `src/ucp/core/ucp_rkey.c`), with every read bounded, and refuses what
//! UCX would assert on, read past the end of, or index an array with out of
//! range. What it does not read — the transports' own device, interface and
//! memory keys, opaque to UCP — is handed to UCX with [`padded`] bytes
//! behind it. docs/design.md §4 says what that leaves.

use thiserror::Error;

/// UCX's `UCP_MAX_MDS`: memory-domain indices index arrays and 64-bit maps.
const MAX_MDS: u16 = 64;
/// UCX's `UCP_MAX_RESOURCES`: most transport entries in one address.
const MAX_RESOURCES: usize = 128;
/// `UCS_SYS_DEVICE_ID_UNKNOWN`, also the end of an rkey's distance list.
const SYS_DEVICE_UNKNOWN: u8 = 0xff;
/// System devices index 64-bit maps (`ucp_sys_dev_map_t`).
const MAX_SYS_DEVICES: u8 = 64;
/// Bytes handed to UCX after a peer's address or rkey, so that a transport
/// reading its own part by its own idea of the size (at most 255 bytes:
/// UCX packs each with a one-byte length) stays inside kvpoll's buffer.
const PAD: usize = 256;

/// What is wrong with a peer's worker address or packed rkey. Nothing is
/// kept from bytes that fail.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LayoutError {
    /// The bytes end inside a field.
    #[error("ends inside the {0}")]
    Truncated(&'static str),
    /// Not address format 1 or 2 (version nibble 0 or 1): UCX asserts on
    /// any other.
    #[error("worker address format version {0}, UCX reads versions 0 (v1) and 1 (v2)")]
    AddressVersion(u8),
    /// Header flags UCX does not define (they could add fields).
    #[error("worker address header flags {0:#04x} are not all defined")]
    AddressFlags(u8),
    /// No transport entry at all: nothing could connect.
    #[error("worker address names no transport")]
    NoTransports,
    /// A memory-domain index past UCX's arrays.
    #[error("worker address device {device}: memory domain index {index} is not below 64")]
    MemoryDomainIndex {
        /// The device, counted from 0.
        device: usize,
        /// The index as UCX would read it.
        index: u16,
    },
    /// A system device past UCX's 64-bit maps.
    #[error("{0}: system device {1} is not below 64")]
    SystemDevice(&'static str, u8),
    /// Interface figures UCX asserts on when it builds an endpoint: a
    /// negative or not-a-number overhead, latency or bandwidth (lane
    /// selection asserts on a negative score), or an active-message
    /// segment too small for this side's rkeys (`rkey_size <= max_bcopy`).
    #[error("worker address entry {0} has an unusable performance figure or segment size")]
    InterfaceFigures(usize),
    /// More transport entries than UCX keeps.
    #[error("worker address has more than {MAX_RESOURCES} transport entries")]
    TooManyTransports,
    /// Endpoint addresses, which only wire-up messages carry: UCX would
    /// trust their lane indices.
    #[error("worker address entry {0} carries endpoint addresses")]
    EndpointAddress(usize),
    /// Bytes after the last field.
    #[error("{0} bytes after the end")]
    TrailingBytes(usize),
    /// A memory type this UCX does not know; it indexes arrays with it.
    #[error("remote key memory type {0} is unknown to this UCX")]
    MemoryType(u8),
}

/// Reads a peer's bytes front to back, every read bounded.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Self { bytes, at: 0 }
    }

    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], LayoutError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let end = end.ok_or(LayoutError::Truncated(what))?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, LayoutError> {
        Ok(self.take(1, what)?[0])
    }

    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.at).copied()
    }

    fn left(&self) -> usize {
        self.bytes.len() - self.at
    }

    /// A value in the low bits of a byte (`mask`); in format 2 the value
    /// `mask` itself says "the value is the next byte".
    fn extended(&mut self, v2: bool, mask: u8, what: &'static str) -> Result<u16, LayoutError> {
        let v = self.u8(what)? & mask;
        if v2 && v == mask {
            return Ok(self.u8(what)?.into());
        }
        Ok(v.into())
    }

    fn finish(&self) -> Result<(), LayoutError> {
        match self.left() {
            0 => Ok(()),
            n => Err(LayoutError::TrailingBytes(n)),
        }
    }
}

// Worker address format (address.c): header, then devices, each with its
// transport entries.
const HEADER_DEBUG_INFO: u8 = 1 << 0;
const HEADER_WORKER_UUID: u8 = 1 << 1;
const HEADER_CLIENT_ID: u8 = 1 << 2;
const HEADER_FLAGS: u8 = 0x0f;
const NULL_RESOURCE: u8 = 0xff;
const MD_EMPTY_DEV: u8 = 0x80;
const MD_MASK: u8 = 0x7f;
/// Bits a format-1 packer before UCX 1.19 sets in the md byte (can
/// allocate, can register); every reader strips them from such addresses.
const MD_LEGACY_BITS: u8 = 0x60;
const LAST: u8 = 0x80;
const DEV_NUM_PATHS: u8 = 0x40;
const DEV_SYS_DEVICE: u8 = 0x20;
const DEV_LEN_MASK: u8 = 0x1f;
const IFACE_HAS_EP_ADDR: u8 = 0x40;
const IFACE_LEN_MASK: u8 = 0x3f;
/// Packed interface attributes: `ucp_address_packed_iface_attr_t` (format
/// 1, three floats and a word) or `ucp_address_v2_packed_iface_attr_t`.
const IFACE_ATTR_V1: usize = 16;
const IFACE_ATTR_V2: usize = 8;
/// `UCP_ADDR_IFACE_FLAG_AM_SYNC` in a format-2 entry's flags.
const IFACE_FLAG_AM_SYNC: u16 = 1 << 1;
/// Smallest active-message segment accepted from a peer. UCX asserts that
/// an endpoint's `am.max_bcopy` (its interface's, bounded by the peer's
/// segment) holds this side's whole packed rkey, a few dozen bytes per
/// memory domain; every UCX transport with active messages has segments
/// of kilobytes.
const MIN_AM_SEGMENT: usize = 1024;

/// Checks a worker address as `ucp_ep_create` unpacks it (the flags it
/// passes: uuid, name, device, interface and endpoint addresses; not
/// unified mode, which kvpoll turns off).
pub(crate) fn check_worker_address(bytes: &[u8]) -> Result<(), LayoutError> {
    let mut c = Cursor::new(bytes);
    let first = c.u8("address header")?;
    // The low nibble is `ucp_object_version_t`: 0 is v1, 1 is v2.
    let (v2, flags) = match first & 0x0f {
        0 => (false, first >> 4),
        1 => (true, c.u8("address header")?),
        v => return Err(LayoutError::AddressVersion(v)),
    };
    if flags & !HEADER_FLAGS != 0 {
        return Err(LayoutError::AddressFlags(flags));
    }
    // Format 1 always carries the uuid when the reader asks for it, as
    // ucp_ep_create does.
    if !v2 || flags & HEADER_WORKER_UUID != 0 {
        c.take(8, "worker uuid")?;
    }
    if flags & HEADER_CLIENT_ID != 0 {
        c.take(8, "client id")?;
    }
    if flags & HEADER_DEBUG_INFO != 0 {
        let n = c.u8("worker name")?;
        c.take(n.into(), "worker name")?;
    }
    if c.peek() == Some(NULL_RESOURCE) {
        return Err(LayoutError::NoTransports);
    }
    let attr_len = if v2 { IFACE_ATTR_V2 } else { IFACE_ATTR_V1 };
    let mut entries = 0;
    // (device, md byte) of the devices with entries, judged once the last
    // device (which may carry the packer's release version) is known.
    let mut mds = Vec::new();
    let mut device = 0;
    loop {
        let md = c.peek().ok_or(LayoutError::Truncated("device"))?;
        let index = c.extended(v2, MD_MASK, "memory domain index")?;
        let dev = c.peek().ok_or(LayoutError::Truncated("device"))?;
        let dev_len = c.extended(v2, DEV_LEN_MASK, "device address length")?;
        if dev & DEV_NUM_PATHS != 0 {
            c.u8("device path count")?;
        }
        if dev & DEV_SYS_DEVICE != 0 {
            let s = c.u8("device system device")?;
            if s >= MAX_SYS_DEVICES {
                return Err(LayoutError::SystemDevice("worker address", s));
            }
        }
        c.take(dev_len.into(), "device address")?;
        let empty = md & MD_EMPTY_DEV != 0;
        if !empty {
            mds.push((device, md, index));
            loop {
                if entries == MAX_RESOURCES {
                    return Err(LayoutError::TooManyTransports);
                }
                c.take(2, "transport entry")?;
                let attr = c.take(attr_len, "transport entry")?;
                if !scorable(attr, v2) {
                    return Err(LayoutError::InterfaceFigures(entries));
                }
                let iface = c.peek().ok_or(LayoutError::Truncated("transport entry"))?;
                let len = c.extended(v2, IFACE_LEN_MASK, "interface address length")?;
                c.take(len.into(), "interface address")?;
                if iface & IFACE_HAS_EP_ADDR != 0 {
                    return Err(LayoutError::EndpointAddress(entries));
                }
                entries += 1;
                if iface & LAST != 0 {
                    break;
                }
            }
        }
        if dev & LAST != 0 {
            // UCX 1.19 and later end a format-1 address with an empty
            // device whose md byte is their release version; with one, no
            // reader strips the legacy bits from the others.
            let strip = !v2 && !empty;
            for (device, md, index) in mds {
                let index = if strip {
                    u16::from(md & MD_MASK & !MD_LEGACY_BITS)
                } else {
                    index
                };
                if index >= MAX_MDS {
                    return Err(LayoutError::MemoryDomainIndex { device, index });
                }
            }
            break;
        }
        device += 1;
    }
    if entries == 0 {
        return Err(LayoutError::NoTransports);
    }
    c.finish()
}

/// Whether UCX can build an endpoint on an entry's packed figures. Format 1
/// packs `f32` overhead, bandwidth and latency (a negative bandwidth is an
/// old peer's "shared" figure, and taken as its magnitude) and no segment
/// size. Format 2 packs them as `ucs_fp8` bytes, never negative, whose
/// exponent nibble `0xf` is infinity or not-a-number, then the priority,
/// the segment size in units of 64 bytes, and the flags; an entry that can
/// carry active messages (`UCP_ADDR_IFACE_FLAG_AM_SYNC`) bounds the
/// endpoint's `am.max_bcopy` by its segment, which must hold an rkey.
fn scorable(attr: &[u8], v2: bool) -> bool {
    if v2 {
        let seg = usize::from(u16::from_le_bytes([attr[4], attr[5]])) * 64;
        let flags = u16::from_le_bytes([attr[6], attr[7]]);
        return attr[..3].iter().all(|&b| b & 0x0f != 0x0f)
            && (flags & IFACE_FLAG_AM_SYNC == 0 || seg >= MIN_AM_SEGMENT);
    }
    let f = |i: usize| f32::from_le_bytes([attr[i], attr[i + 1], attr[i + 2], attr[i + 3]]);
    let (overhead, bandwidth, latency) = (f(0), f(4), f(8));
    overhead.is_finite()
        && overhead >= 0.0
        && latency.is_finite()
        && latency >= 0.0
        && bandwidth.is_finite()
        && bandwidth != 0.0
}

/// Checks a packed rkey as `ucp_ep_rkey_unpack` reads it: the map of
/// memory domains, the memory type, one length-prefixed part per domain,
/// then (UCX 1.20 and later, which read it even though the caller passes
/// no length) the memory's system device and its distance list. An empty
/// map is UCX's own key for memory no domain registered (UCX 1.22 packs
/// it over tcp, whose memory domain registers nothing): operations on it
/// go through UCX's software emulation.
pub(crate) fn check_rkey(bytes: &[u8]) -> Result<(), LayoutError> {
    let mut c = Cursor::new(bytes);
    let map = u64::from_le_bytes(c.take(8, "memory domain map")?.try_into().unwrap_or([0; 8]));
    let mem_type = c.u8("memory type")?;
    if u32::from(mem_type) >= ucx_sys::UCS_MEMORY_TYPE_LAST {
        return Err(LayoutError::MemoryType(mem_type));
    }
    for _ in 0..map.count_ones() {
        let n = c.u8("memory domain key")?;
        c.take(n.into(), "memory domain key")?;
    }
    if c.left() == 0 {
        return Ok(());
    }
    if c.u8("system device")? == SYS_DEVICE_UNKNOWN {
        return c.finish();
    }
    // Distances (sys_dev, latency, bandwidth) up to the end or to the
    // terminator, which UCX 1.22 stops at.
    while let Some(s) = c.peek() {
        if s == SYS_DEVICE_UNKNOWN {
            c.u8("distance list")?;
            return c.finish();
        }
        if s >= MAX_SYS_DEVICES {
            return Err(LayoutError::SystemDevice("remote key distance", s));
        }
        c.take(3, "distance")?;
    }
    Ok(())
}

/// The memory type a packed rkey (checked by [`check_rkey`]) names.
pub(crate) fn rkey_memory_type(bytes: &[u8]) -> Option<u8> {
    bytes.get(8).copied()
}

/// `raw` with [`PAD`] bytes of `0xff` behind it: what kvpoll hands UCX.
/// `0xff` is "unknown system device" and the end of a distance list, so a
/// reader that looks past a key which has neither stops there.
pub(crate) fn padded(raw: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(raw.len() + PAD);
    v.extend_from_slice(raw);
    v.resize(raw.len() + PAD, 0xff);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A format-1 address: header (uuid flag), uuid, one device (md 0,
    /// no device address, last) with one tcp-like entry (8-byte interface
    /// address, last).
    fn v1() -> Vec<u8> {
        let mut a = vec![0x20];
        a.extend_from_slice(&[7; 8]);
        a.extend_from_slice(&[0x00, LAST]);
        a.extend_from_slice(&[0xab, 0xcd]);
        a.extend_from_slice(&1e-9f32.to_le_bytes());
        a.extend_from_slice(&1e9f32.to_le_bytes());
        a.extend_from_slice(&1e-6f32.to_le_bytes());
        a.extend_from_slice(&[0; 4]);
        a.push(LAST | 8);
        a.extend_from_slice(&[1; 8]);
        a
    }

    fn v2() -> Vec<u8> {
        let mut a = vec![0x01, HEADER_WORKER_UUID];
        a.extend_from_slice(&[7; 8]);
        // md index 70 (extended), device address of 40 bytes (extended).
        a.extend_from_slice(&[MD_MASK, 3, LAST | DEV_LEN_MASK, 40]);
        a.extend_from_slice(&[0; 40]);
        a.extend_from_slice(&[0xab, 0xcd]);
        a.extend_from_slice(&[0; IFACE_ATTR_V2]);
        a.extend_from_slice(&[LAST | IFACE_LEN_MASK, 100]);
        a.extend_from_slice(&[1; 100]);
        a
    }

    #[test]
    fn well_formed_addresses_of_both_formats_pass() {
        check_worker_address(&v1()).unwrap();
        check_worker_address(&v2()).unwrap();
    }

    #[test]
    fn an_address_of_an_unknown_version_is_refused() {
        for v in [2u8, 3, 15] {
            let mut a = v1();
            a[0] = (a[0] & 0xf0) | v;
            assert_eq!(
                check_worker_address(&a),
                Err(LayoutError::AddressVersion(v))
            );
        }
    }

    #[test]
    fn every_truncation_of_an_address_is_refused() {
        for a in [v1(), v2()] {
            for n in 0..a.len() {
                assert!(check_worker_address(&a[..n]).is_err(), "accepted {n} bytes");
            }
        }
    }

    #[test]
    fn address_lengths_past_the_end_and_bytes_after_it_are_refused() {
        let mut a = v1();
        let n = a.len();
        a[n - 9] = LAST | 9;
        assert_eq!(
            check_worker_address(&a),
            Err(LayoutError::Truncated("interface address"))
        );
        let mut a = v2();
        a.push(0);
        assert_eq!(check_worker_address(&a), Err(LayoutError::TrailingBytes(1)));
    }

    #[test]
    fn memory_domain_indices_past_ucx_arrays_are_refused() {
        let mut a = v2();
        a[11] = 64;
        assert_eq!(
            check_worker_address(&a),
            Err(LayoutError::MemoryDomainIndex {
                device: 0,
                index: 64
            })
        );
        // Format 1 from an old packer: the legacy bits are stripped...
        let mut a = v1();
        a[9] = MD_LEGACY_BITS | 3;
        check_worker_address(&a).unwrap();
        // ...unless a release-version device follows, as only new packers
        // write (and then they are read as index bits).
        a[10] = 0;
        a.extend_from_slice(&[MD_EMPTY_DEV | 6, LAST]);
        assert_eq!(
            check_worker_address(&a),
            Err(LayoutError::MemoryDomainIndex {
                device: 0,
                index: 0x63
            })
        );
    }

    #[test]
    fn performance_figures_lane_selection_cannot_score_are_refused() {
        // Format 1: overhead at 13, bandwidth at 17, latency at 21.
        for (at, v) in [
            (13, -1.0f32),
            (17, 0.0),
            (17, f32::NAN),
            (21, f32::INFINITY),
        ] {
            let mut a = v1();
            a[at..at + 4].copy_from_slice(&v.to_le_bytes());
            assert_eq!(
                check_worker_address(&a),
                Err(LayoutError::InterfaceFigures(0))
            );
        }
        let mut a = v1();
        a[17..21].copy_from_slice(&(-1e9f32).to_le_bytes());
        check_worker_address(&a).unwrap();
        // Format 2: three fp8 bytes from 56, segment at 60, flags at 62.
        for at in 56..59 {
            let mut a = v2();
            a[at] = 0x3f;
            assert_eq!(
                check_worker_address(&a),
                Err(LayoutError::InterfaceFigures(0))
            );
        }
        let mut a = v2();
        a[60..64].copy_from_slice(&[15, 0, 2, 0]);
        assert_eq!(
            check_worker_address(&a),
            Err(LayoutError::InterfaceFigures(0))
        );
        a[60] = 16;
        check_worker_address(&a).unwrap();
        a[60..64].copy_from_slice(&[0, 0, 0x18, 0]);
        check_worker_address(&a).unwrap();
    }

    #[test]
    fn endpoint_addresses_unknown_flags_and_empty_lists_are_refused() {
        let mut a = v1();
        let n = a.len();
        a[n - 9] |= IFACE_HAS_EP_ADDR;
        assert_eq!(
            check_worker_address(&a),
            Err(LayoutError::EndpointAddress(0))
        );
        let mut a = v2();
        a[1] |= 0x10;
        assert_eq!(
            check_worker_address(&a),
            Err(LayoutError::AddressFlags(0x12))
        );
        let mut a = v1()[..9].to_vec();
        a.push(NULL_RESOURCE);
        assert_eq!(check_worker_address(&a), Err(LayoutError::NoTransports));
    }

    fn rkey() -> Vec<u8> {
        let mut k = 0b101u64.to_le_bytes().to_vec();
        k.push(0);
        k.extend_from_slice(&[4, 1, 2, 3, 4, 0]);
        k
    }

    #[test]
    fn rkeys_with_and_without_a_distance_list_pass() {
        // UCX's key for memory no domain registered: an empty map and
        // host memory (what UCX 1.22 packs over tcp).
        let mut empty = 0u64.to_le_bytes().to_vec();
        empty.push(0);
        check_rkey(&empty).unwrap();
        empty.push(SYS_DEVICE_UNKNOWN);
        check_rkey(&empty).unwrap();
        check_rkey(&rkey()).unwrap();
        let mut k = rkey();
        k.push(SYS_DEVICE_UNKNOWN);
        check_rkey(&k).unwrap();
        k.pop();
        k.extend_from_slice(&[2, 0, 1, 1, 3, 1, 1]);
        check_rkey(&k).unwrap();
        k.push(SYS_DEVICE_UNKNOWN);
        check_rkey(&k).unwrap();
    }

    #[test]
    fn bad_rkeys_are_refused_with_what_was_wrong() {
        let mut k = rkey();
        k[8] = 0xee;
        assert_eq!(check_rkey(&k), Err(LayoutError::MemoryType(0xee)));
        let mut k = rkey();
        k[9] = 5;
        assert!(check_rkey(&k).is_err());
        let mut k = rkey();
        k.extend_from_slice(&[2, 70, 1, 1]);
        assert_eq!(
            check_rkey(&k),
            Err(LayoutError::SystemDevice("remote key distance", 70))
        );
        let mut k = rkey();
        k.extend_from_slice(&[2, 0, 1]);
        assert_eq!(check_rkey(&k), Err(LayoutError::Truncated("distance")));
        let mut k = rkey();
        k.extend_from_slice(&[SYS_DEVICE_UNKNOWN, 0]);
        assert_eq!(check_rkey(&k), Err(LayoutError::TrailingBytes(1)));
        for n in 0..rkey().len() {
            assert!(check_rkey(&rkey()[..n]).is_err(), "accepted {n} bytes");
        }
    }

    #[test]
    fn padding_is_unknown_system_devices() {
        let p = padded(&[1, 2]);
        assert_eq!(p.len(), 2 + PAD);
        assert!(p[2..].iter().all(|&b| b == 0xff));
    }
}
