//! Framing for bytes that cross a process boundary.
//!
//! UCX cannot validate a worker address or a packed rkey: garbage handed to
//! `ucp_ep_create` or `ucp_ep_rkey_unpack` can read out of bounds or crash.
//! So everything kvpoll sends to a peer is wrapped in a frame that carries a
//! magic, a kind, a version, the payload length and a checksum, and nothing
//! reaches UCX before the frame checked out — and, for UCX's own bytes
//! inside it, their layout (`transport::ucx::LayoutError`).
//!
//! ```text
//! offset  size  field
//! 0       4     magic "KVPL"
//! 4       1     kind (what the payload is)
//! 5       1     version
//! 6       2     reserved, zero
//! 8       4     payload length, little endian
//! 12      n     payload
//! 12+n    8     FNV-1a 64 of bytes 0..12+n, little endian
//! ```

use thiserror::Error;

const MAGIC: [u8; 4] = *b"KVPL";
const HEADER: usize = 12;
const TRAILER: usize = 8;
/// The frame version this build writes and accepts.
pub const VERSION: u8 = 4;
/// Largest payload a frame may carry (worker addresses and rkeys are far
/// smaller; the bound keeps a corrupt length from asking for gigabytes).
pub const MAX_PAYLOAD: usize = 1 << 20;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// A UCX worker address.
    WorkerAddress = 1,
    /// A packed UCX remote key.
    RemoteKey = 2,
    /// kvpoll peer metadata.
    PeerMetadata = 3,
    /// A consumer notification.
    Notification = 4,
}

/// Why a frame was rejected. Nothing is changed by a rejected frame.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum FrameError {
    /// Fewer bytes than the header and trailer need, or than the length says.
    #[error("frame truncated: {got} bytes, need {need}")]
    Truncated {
        /// Bytes given.
        got: usize,
        /// Bytes the frame needs.
        need: usize,
    },
    /// More bytes than the length says.
    #[error("frame has {extra} trailing bytes after its checksum")]
    TrailingBytes {
        /// Bytes past the end of the frame.
        extra: usize,
    },
    /// The bytes do not start with the kvpoll magic.
    #[error("not a kvpoll frame (bad magic)")]
    BadMagic,
    /// A frame of another kind was given.
    #[error("frame kind {got} where kind {expected:?} was expected")]
    WrongKind {
        /// The kind byte found.
        got: u8,
        /// The kind the caller asked for.
        expected: Kind,
    },
    /// A version this build does not speak.
    #[error("frame version {got}, this build speaks version {VERSION}")]
    WrongVersion {
        /// The version byte found.
        got: u8,
    },
    /// The payload length is over [`MAX_PAYLOAD`].
    #[error("frame payload of {len} bytes exceeds the {MAX_PAYLOAD}-byte limit")]
    TooLong {
        /// The length claimed.
        len: usize,
    },
    /// The reserved bytes are not zero (a frame this build cannot read).
    #[error("frame reserved bytes are not zero")]
    Reserved,
    /// The checksum does not match: the bytes were damaged.
    #[error("frame checksum mismatch")]
    BadChecksum,
}

/// FNV-1a, 64 bit: cheap, dependency-free, and enough to tell damaged or
/// foreign bytes from a frame (this is not a defence against an attacker).
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Wraps `payload` in a frame of `kind`.
///
/// ```
/// use kvpoll::wire::{encode, decode, Kind};
/// let f = encode(Kind::RemoteKey, b"abc");
/// assert_eq!(decode(&f, Kind::RemoteKey).unwrap(), b"abc");
/// ```
pub fn encode(kind: Kind, payload: &[u8]) -> Vec<u8> {
    assert!(
        payload.len() <= MAX_PAYLOAD,
        "frame payload over MAX_PAYLOAD"
    );
    let mut out = Vec::with_capacity(HEADER + payload.len() + TRAILER);
    out.extend_from_slice(&MAGIC);
    out.push(kind as u8);
    out.push(VERSION);
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(payload);
    let sum = fnv1a64(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

/// Checks a frame of `kind` and returns its payload.
pub fn decode(bytes: &[u8], kind: Kind) -> Result<&[u8], FrameError> {
    if bytes.len() < HEADER + TRAILER {
        return Err(FrameError::Truncated {
            got: bytes.len(),
            need: HEADER + TRAILER,
        });
    }
    if bytes[0..4] != MAGIC {
        return Err(FrameError::BadMagic);
    }
    let len = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize;
    if len > MAX_PAYLOAD {
        return Err(FrameError::TooLong { len });
    }
    let need = HEADER + len + TRAILER;
    if bytes.len() < need {
        return Err(FrameError::Truncated {
            got: bytes.len(),
            need,
        });
    }
    if bytes.len() > need {
        return Err(FrameError::TrailingBytes {
            extra: bytes.len() - need,
        });
    }
    let mut sum = [0u8; 8];
    sum.copy_from_slice(&bytes[HEADER + len..need]);
    if fnv1a64(&bytes[..HEADER + len]) != u64::from_le_bytes(sum) {
        return Err(FrameError::BadChecksum);
    }
    // Kind and version are checked after the checksum so that a damaged byte
    // is reported as damage, not as a confusing kind or version.
    if bytes[4] != kind as u8 {
        return Err(FrameError::WrongKind {
            got: bytes[4],
            expected: kind,
        });
    }
    if bytes[5] != VERSION {
        return Err(FrameError::WrongVersion { got: bytes[5] });
    }
    if bytes[6..8] != [0, 0] {
        return Err(FrameError::Reserved);
    }
    Ok(&bytes[HEADER..HEADER + len])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_keeps_payload() {
        let f = encode(Kind::WorkerAddress, &[1, 2, 3, 4, 5]);
        assert_eq!(decode(&f, Kind::WorkerAddress), Ok(&[1u8, 2, 3, 4, 5][..]));
    }

    #[test]
    fn every_single_byte_flip_is_rejected() {
        let f = encode(Kind::RemoteKey, b"some packed rkey bytes");
        for i in 0..f.len() {
            let mut g = f.clone();
            g[i] ^= 0x40;
            assert!(decode(&g, Kind::RemoteKey).is_err(), "flip at {i} accepted");
        }
    }

    #[test]
    fn truncation_and_trailing_bytes_are_rejected() {
        let f = encode(Kind::RemoteKey, b"payload");
        for n in 0..f.len() {
            assert!(matches!(
                decode(&f[..n], Kind::RemoteKey),
                Err(FrameError::Truncated { .. }) | Err(FrameError::BadMagic)
            ));
        }
        let mut g = f.clone();
        g.push(0);
        assert_eq!(
            decode(&g, Kind::RemoteKey),
            Err(FrameError::TrailingBytes { extra: 1 })
        );
    }

    /// Found by fuzzing (rkey_address): a frame with non-zero reserved
    /// bytes and a matching checksum was accepted.
    #[test]
    fn nonzero_reserved_bytes_are_rejected_even_with_a_matching_checksum() {
        let mut f = encode(Kind::Notification, &[0u8; 8]);
        f[7] = 0xfd;
        let n = f.len() - TRAILER;
        let sum = fnv1a64(&f[..n]);
        f[n..].copy_from_slice(&sum.to_le_bytes());
        assert_eq!(decode(&f, Kind::Notification), Err(FrameError::Reserved));
    }

    #[test]
    fn wrong_kind_and_huge_length_are_rejected() {
        let f = encode(Kind::RemoteKey, b"x");
        assert!(matches!(
            decode(&f, Kind::WorkerAddress),
            Err(FrameError::WrongKind { got: 2, .. })
        ));
        let mut g = f.clone();
        g[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            decode(&g, Kind::RemoteKey),
            Err(FrameError::TooLong { .. })
        ));
    }
}

/// Lower-case hex of `bytes`, for carrying frames in text lines.
pub fn to_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

/// Why a hex string was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum HexError {
    /// An odd number of digits.
    #[error("hex string has an odd length ({0})")]
    OddLength(usize),
    /// A character that is not a hex digit.
    #[error("not a hex digit at position {0}")]
    BadDigit(usize),
}

/// Parses [`to_hex`] output (either case).
pub fn from_hex(s: &str) -> Result<Vec<u8>, HexError> {
    let b = s.as_bytes();
    if b.len() % 2 != 0 {
        return Err(HexError::OddLength(b.len()));
    }
    let digit = |i: usize| -> Result<u8, HexError> {
        match b[i] {
            c @ b'0'..=b'9' => Ok(c - b'0'),
            c @ b'a'..=b'f' => Ok(c - b'a' + 10),
            c @ b'A'..=b'F' => Ok(c - b'A' + 10),
            _ => Err(HexError::BadDigit(i)),
        }
    };
    (0..b.len() / 2)
        .map(|i| Ok((digit(2 * i)? << 4) | digit(2 * i + 1)?))
        .collect()
}

#[cfg(test)]
mod hex_tests {
    use super::*;

    #[test]
    fn hex_round_trips_and_rejects_bad_input() {
        let v: Vec<u8> = (0..=255).collect();
        assert_eq!(from_hex(&to_hex(&v)), Ok(v));
        assert_eq!(from_hex("abc"), Err(HexError::OddLength(3)));
        assert_eq!(from_hex("0g"), Err(HexError::BadDigit(1)));
    }
}
