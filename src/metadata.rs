//! Peer metadata: what one kvpoll engine tells another so that it can read
//! or write its blocks — the worker address, the registered regions' rkeys
//! and the block layout — as one versioned, checksummed byte string. The
//! caller moves it by its own side channel (the `kvpoll` tool uses TCP).
//!
//! Payload inside a [`crate::wire`] frame of kind `PeerMetadata`:
//!
//! ```text
//! u64  instance      random per engine start: tells a restarted peer apart
//! u64  block_size
//! u32  address_len,  then the framed worker address
//! u16  region_count, then per region:
//!      u32 id, u64 blocks, u32 rkey_len, then the framed packed rkey
//! u32  words_rkey_len (0: no lend words), then the framed packed rkey of
//!      the lend words (a power of two of 64-bit words, at most
//!      `MAX_LEND_WORDS`)
//! u8   direct (0: none; 1: then the direct-read offer, which also
//!      lets a peer on the same host check that this process lives:)
//!      16 bytes boot id, u64 pid namespace inode, u32 pid,
//!      u64 probe address, u64 probe value,
//!      u16 count, then count × u32 ids of regions readable directly
//! u8   tagged (0: the engine has no key; 1: then a 32-byte tag, keyed
//!      BLAKE3 under the deployment's key ([`crate::auth`]) of every
//!      payload byte before it)
//! ```
//! (Frame version 4; version 3 had no tag, version 2 no direct-read
//! offer, version 1 no lend words.)
//! All integers little endian. Every length is checked against what is
//! left, every inner frame is checked, and nothing is kept from bytes that
//! fail.

use thiserror::Error;

use crate::auth::{AuthError, AuthKey, Purpose, TAG_LEN};
pub use crate::transport::peer::{BlockLayout, DirectReads, Host, PeerMetadata, RegionDescriptor};
use crate::transport::ucx::{PackedRkey, UcxError, WorkerAddress};
use crate::wire::{self, FrameError, Kind};

/// Most regions one peer may announce.
pub const MAX_REGIONS: usize = 1024;

/// Why peer metadata was refused. Nothing is changed by refused metadata.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum MetadataError {
    /// The outer frame is damaged, truncated or of another version.
    #[error("peer metadata: {0}")]
    Frame(#[from] FrameError),
    /// The payload ends before a field.
    #[error("peer metadata truncated while reading {0}")]
    Truncated(&'static str),
    /// Bytes left after the last region.
    #[error("peer metadata has {0} bytes after the last region")]
    TrailingBytes(usize),
    /// The worker address inside is invalid.
    #[error("peer metadata worker address: {0}")]
    Address(UcxError),
    /// A region's rkey is invalid.
    #[error("peer metadata region {region}: {error}")]
    RemoteKey {
        /// The region id.
        region: u32,
        /// What was wrong with its rkey.
        error: UcxError,
    },
    /// A region id appears twice.
    #[error("peer metadata announces region {0} twice")]
    DuplicateRegion(u32),
    /// More regions than [`MAX_REGIONS`].
    #[error("peer metadata announces {0} regions, at most {MAX_REGIONS} are accepted")]
    TooManyRegions(usize),
    /// A zero block size, or a region whose blocks do not fit its rkey.
    #[error("peer metadata layout is invalid: {0}")]
    BadLayout(String),
    /// The lend words' rkey is invalid.
    #[error("peer metadata lend words rkey: {0}")]
    LendWordsKey(UcxError),
    /// The lend words' region is not a power of two of 64-bit words, or
    /// holds more than `MAX_LEND_WORDS`.
    #[error(
        "peer metadata lend words: {0} bytes is not a power of two of 8-byte words up to the limit"
    )]
    BadLendWords(u64),
    /// The direct-read offer is malformed or names regions not announced.
    #[error("peer metadata direct-read offer: {0}")]
    BadDirectReads(String),
    /// The tag flag is neither 0 nor 1.
    #[error("peer metadata tag flag {0}")]
    BadTagFlag(u8),
    /// The metadata is not authenticated by this engine's key, or carries
    /// a tag where this engine has none ([`PeerMetadata::decode_with_key`]).
    #[error("peer metadata refused: {0}")]
    Unauthenticated(AuthError),
    /// The peer's block size differs from ours.
    #[error("peer block size {theirs} is incompatible with ours ({ours})")]
    IncompatibleLayout {
        /// Our block size.
        ours: u64,
        /// The peer's.
        theirs: u64,
    },
}

impl PeerMetadata {
    /// The bytes to hand to a peer, untagged (an engine without a key).
    pub fn encode(&self) -> Vec<u8> {
        self.encode_keyed(None)
    }

    /// The bytes to hand to a peer, tagged with `key` if given.
    pub fn encode_keyed(&self, key: Option<&AuthKey>) -> Vec<u8> {
        let mut p = Vec::new();
        p.extend_from_slice(&self.instance.to_le_bytes());
        p.extend_from_slice(&self.layout.block_size.to_le_bytes());
        let addr = self.worker.as_bytes();
        p.extend_from_slice(&(addr.len() as u32).to_le_bytes());
        p.extend_from_slice(addr);
        p.extend_from_slice(&(self.regions.len() as u16).to_le_bytes());
        for r in &self.regions {
            p.extend_from_slice(&r.id.to_le_bytes());
            p.extend_from_slice(&r.blocks.to_le_bytes());
            let k = r.rkey.as_bytes();
            p.extend_from_slice(&(k.len() as u32).to_le_bytes());
            p.extend_from_slice(k);
        }
        let words = self.words.as_ref().map_or(&[][..], |k| k.as_bytes());
        p.extend_from_slice(&(words.len() as u32).to_le_bytes());
        p.extend_from_slice(words);
        match &self.direct {
            None => p.push(0),
            Some(d) => {
                p.push(1);
                p.extend_from_slice(&d.host.boot);
                p.extend_from_slice(&d.host.pid_ns.to_le_bytes());
                p.extend_from_slice(&d.host.pid.to_le_bytes());
                p.extend_from_slice(&d.probe_addr.to_le_bytes());
                p.extend_from_slice(&d.probe.to_le_bytes());
                p.extend_from_slice(&(d.regions.len() as u16).to_le_bytes());
                for id in &d.regions {
                    p.extend_from_slice(&id.to_le_bytes());
                }
            }
        }
        match key {
            None => p.push(0),
            Some(key) => {
                p.push(1);
                let tag = key.tag(Purpose::Metadata, &[&p]);
                p.extend_from_slice(&tag);
            }
        }
        wire::encode(Kind::PeerMetadata, &p)
    }

    /// Checks the bytes from a peer, but not who made them: a tag, if
    /// any, is not checked ([`PeerMetadata::decode_with_key`] does). On
    /// error nothing is kept.
    pub fn decode(bytes: &[u8]) -> Result<Self, MetadataError> {
        Self::decode_with(bytes, None, false)
    }

    /// Checks the bytes from a peer and that they are tagged with `key`
    /// (or, without a key, untagged): what [`crate::Engine::add_peer`]
    /// does. On error nothing is kept.
    pub fn decode_with_key(bytes: &[u8], key: Option<&AuthKey>) -> Result<Self, MetadataError> {
        Self::decode_with(bytes, key, true)
    }

    fn decode_with(
        bytes: &[u8],
        key: Option<&AuthKey>,
        check: bool,
    ) -> Result<Self, MetadataError> {
        let decoded = Self::decode_checked(bytes).and_then(|(meta, tagged)| {
            let refused = match (check, key, tagged) {
                (false, ..) | (true, None, None) => return Ok(meta),
                (true, Some(_), None) => AuthError::Missing,
                (true, None, Some(_)) => AuthError::Unexpected,
                (true, Some(key), Some((covered, tag))) => {
                    if key.verify(Purpose::Metadata, &[covered], tag) {
                        return Ok(meta);
                    }
                    AuthError::BadTag
                }
            };
            Err(MetadataError::Unauthenticated(refused))
        });
        if let Err(e) = &decoded {
            // Control path (adding a peer): rare, and the caller gets the
            // error; this event is for whoever watches the process.
            tracing::debug!(len = bytes.len(), error = %e, "peer metadata refused");
        }
        decoded
    }

    /// The metadata, and where it is tagged: the bytes the tag covers and
    /// the tag.
    #[allow(clippy::type_complexity)]
    fn decode_checked(bytes: &[u8]) -> Result<(Self, Option<(&[u8], &[u8])>), MetadataError> {
        let payload = wire::decode(bytes, Kind::PeerMetadata)?;
        let mut r = Reader(payload);
        let instance = r.u64("instance")?;
        let block_size = r.u64("block size")?;
        if block_size == 0 {
            return Err(MetadataError::BadLayout("block size 0".into()));
        }
        let alen = r.u32("address length")? as usize;
        let worker = WorkerAddress::from_bytes(r.take(alen, "worker address")?)
            .map_err(MetadataError::Address)?;
        let count = r.u16("region count")? as usize;
        if count > MAX_REGIONS {
            return Err(MetadataError::TooManyRegions(count));
        }
        let mut regions: Vec<RegionDescriptor> = Vec::with_capacity(count);
        for _ in 0..count {
            let id = r.u32("region id")?;
            let blocks = r.u64("region block count")?;
            let klen = r.u32("rkey length")? as usize;
            let rkey = PackedRkey::from_bytes(r.take(klen, "rkey")?)
                .map_err(|error| MetadataError::RemoteKey { region: id, error })?;
            if regions.iter().any(|x| x.id == id) {
                return Err(MetadataError::DuplicateRegion(id));
            }
            match blocks.checked_mul(block_size) {
                Some(bytes) if bytes <= rkey.region_len() => {}
                _ => {
                    return Err(MetadataError::BadLayout(format!(
                        "region {id}: {blocks} blocks of {block_size} bytes exceed its {} registered bytes",
                        rkey.region_len()
                    )))
                }
            }
            regions.push(RegionDescriptor { id, blocks, rkey });
        }
        let wlen = r.u32("lend words rkey length")? as usize;
        let words = match wlen {
            0 => None,
            n => {
                let rkey = PackedRkey::from_bytes(r.take(n, "lend words rkey")?)
                    .map_err(MetadataError::LendWordsKey)?;
                let len = rkey.region_len();
                let count = len / 8;
                let max = crate::transport::MAX_LEND_WORDS as u64;
                if len % 8 != 0 || !count.is_power_of_two() || count > max {
                    return Err(MetadataError::BadLendWords(len));
                }
                Some(rkey)
            }
        };
        let direct = match r.take(1, "direct-read flag")?[0] {
            0 => None,
            1 => {
                let mut boot = [0u8; 16];
                boot.copy_from_slice(r.take(16, "boot id")?);
                let pid_ns = r.u64("pid namespace")?;
                let pid = r.u32("pid")?;
                let probe_addr = r.u64("probe address")?;
                let probe = r.u64("probe value")?;
                let n = r.u16("direct region count")? as usize;
                let mut ids = Vec::with_capacity(n.min(MAX_REGIONS));
                for _ in 0..n {
                    let id = r.u32("direct region id")?;
                    if !regions.iter().any(|x| x.id == id) || ids.contains(&id) {
                        return Err(MetadataError::BadDirectReads(format!(
                            "region {id} is not announced, or named twice"
                        )));
                    }
                    ids.push(id);
                }
                Some(DirectReads {
                    host: Host { boot, pid_ns, pid },
                    probe_addr,
                    probe,
                    regions: ids,
                })
            }
            f => {
                return Err(MetadataError::BadDirectReads(format!("flag {f}")));
            }
        };
        let tagged = match r.take(1, "tag flag")?[0] {
            0 => None,
            1 => {
                let covered = &payload[..payload.len() - r.0.len()];
                Some((covered, r.take(TAG_LEN, "tag")?))
            }
            f => return Err(MetadataError::BadTagFlag(f)),
        };
        if !r.0.is_empty() {
            return Err(MetadataError::TrailingBytes(r.0.len()));
        }
        // Regions pair by id, not by the order a peer lists them in: our
        // region i moves to or from the peer's region of the i-th smallest
        // id (a kvpoll engine numbers its regions 0..n, one per layer).
        regions.sort_by_key(|r| r.id);
        let meta = Self {
            instance,
            layout: BlockLayout { block_size },
            worker,
            regions,
            words,
            direct,
        };
        Ok((meta, tagged))
    }

    /// Refuses a peer whose layout differs from `ours`.
    pub fn check_compatible(&self, ours: BlockLayout) -> Result<(), MetadataError> {
        if self.layout.block_size != ours.block_size {
            return Err(MetadataError::IncompatibleLayout {
                ours: ours.block_size,
                theirs: self.layout.block_size,
            });
        }
        Ok(())
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], MetadataError> {
        if self.0.len() < n {
            return Err(MetadataError::Truncated(what));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u16(&mut self, what: &'static str) -> Result<u16, MetadataError> {
        let b = self.take(2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, MetadataError> {
        let mut w = [0u8; 4];
        w.copy_from_slice(self.take(4, what)?);
        Ok(u32::from_le_bytes(w))
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, MetadataError> {
        let mut w = [0u8; 8];
        w.copy_from_slice(self.take(8, what)?);
        Ok(u64::from_le_bytes(w))
    }
}
