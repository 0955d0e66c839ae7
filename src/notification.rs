//! Consumer notifications: the small active messages engines send each other
//! when a transfer is done. Fixed size, encoded into a stack buffer (the hot
//! path allocates nothing), and checked on receipt: a malformed payload is a
//! typed error and is dropped (and counted) by the poller.
//!
//! One message carries 1 to
//! [`MAX_PER_MESSAGE`](crate::notification::MAX_PER_MESSAGE) notifications
//! back to back (the notifications the protocol core emits to one endpoint
//! in one go are coalesced): [`split`](crate::notification::split) checks
//! the message's length, and each notification is then checked on its own
//! (its own magic, version and checksum), so a damaged one is dropped
//! without its neighbours.
//!
//! ```text
//! 0   2  magic "KN"
//! 2   1  version (4)
//! 3   1  kind: 1 read done, 2 write done, 3 ack, 4 read confirmed,
//!          5 read refused, 6 gave up, 7 write abandoned, 8 heartbeat,
//!          9 write query, 10 write quiet, 11 read pending, 12 read not lent
//! 4   8  request id
//! 12  8  incarnation: the lend's or push destination's token
//! 20  8  nonce: the read's or write's own token (0 where none)
//! 28  8  sender instance (its metadata's instance)
//! 36  4  a read done's count of the distinct lender blocks it read (else 0)
//! 40  8  their digest (BlocksRead::digest; else 0)
//! 48  4  low 32 bits of FNV-1a 64 over bytes 0..48
//! ```
//!
//! Every notification names one incarnation of the lend or push
//! destination it is about (the token its owner drew and handed out with
//! the block ids) and, for the traffic of a read or a write, that attempt's
//! own token: a late note of an earlier incarnation, or an answer to an
//! earlier attempt under the same request id, names another token and is
//! refused. A read done also names the blocks read ([`BlocksRead`]): the
//! lender confirms, or counts, only a read of blocks of that lend.

use std::collections::HashMap;

use thiserror::Error;

use crate::auth::{AuthKey, Purpose, Window, TAG_LEN};
use crate::ledger::{BlockId, Incarnation, RequestId};
use crate::wire::fnv1a64;

/// Encoded size of a notification.
pub const LEN: usize = 52;
/// Most notifications one message carries (1 716 bytes: an eager message
/// on every transport).
pub const MAX_PER_MESSAGE: usize = 33;
const MAGIC: [u8; 2] = *b"KN";
const VERSION: u8 = 4;
const SUM: usize = LEN - 4;

/// The lender blocks a read read, as its question (or its one-way read
/// done) names them: how many distinct blocks, and the wrapping sum of a
/// 64-bit mix of each block id. The sum does not depend on order or on
/// how the blocks were split among handles, and the lender can slide it
/// along its lend's blocks: it confirms a read whose blocks are a run of
/// the lend's, in the order lent (all of them, or a suffix when the
/// reader holds a prefix itself), and nothing else.
///
/// A block is lent whole: a read of any bytes of a lent block (a
/// tensor-parallel share) names the block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BlocksRead {
    /// Distinct blocks (0: the note names none).
    pub count: u32,
    /// Their digest.
    pub digest: u64,
}

impl BlocksRead {
    /// Names no blocks (every note but a read done).
    pub const NONE: BlocksRead = BlocksRead {
        count: 0,
        digest: 0,
    };

    /// One block's share of a digest (SplitMix64's finalizer: any change
    /// of the id changes about half the bits).
    pub fn mix(b: BlockId) -> u64 {
        let mut z = u64::from(b.0).wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// These blocks, each named once (a reader's distinct blocks, a
    /// lend's blocks).
    pub fn of(blocks: impl Iterator<Item = BlockId>) -> BlocksRead {
        let (count, digest) = blocks.fold((0u32, 0u64), |(n, d), b| {
            (n + 1, d.wrapping_add(Self::mix(b)))
        });
        BlocksRead { count, digest }
    }

    /// Whether these are `lent[i..i + count]` for some `i` (the blocks of
    /// a lend, in the order lent; `full`, their digest). One pass, no
    /// allocation.
    pub fn within(self, lent: impl Iterator<Item = BlockId> + Clone, full: BlocksRead) -> bool {
        let k = self.count as usize;
        if k == 0 || self.count > full.count {
            return false;
        }
        if self.count == full.count {
            return self.digest == full.digest;
        }
        let mut sum = 0u64;
        for (i, (b, old)) in lent
            .clone()
            .zip(std::iter::repeat_n(None, k).chain(lent.map(Some)))
            .enumerate()
        {
            sum = sum.wrapping_add(Self::mix(b));
            if let Some(old) = old {
                sum = sum.wrapping_sub(Self::mix(old));
            }
            if i + 1 >= k && sum == self.digest {
                return true;
            }
        }
        false
    }

    /// The value a lend of incarnation `token` lending these blocks (all
    /// of them) keeps in its lend word, and a reader of exactly them
    /// expects there; 0 (no word) in the one case in 2^64 where it would
    /// be.
    pub fn word(self, token: Incarnation) -> u64 {
        token.0 ^ self.digest
    }
}

/// What a notification says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoteKind {
    /// Consumer → lender: "I read the request's lent blocks; was the lend
    /// live?" The lender answers [`NoteKind::ReadConfirmed`] (and counts the
    /// consumer) or [`NoteKind::ReadRefused`]; the read finishes only on a
    /// confirmation. Sent with no answer wanted, it says "I read them and
    /// your lend word confirmed the lend" (or, with confirmation off, just
    /// "I read them"): the lender counts the consumer.
    ReadDone = 1,
    /// Writer → destination: the request's blocks were written and flushed.
    WriteDone = 2,
    /// Destination → writer: the push arrived.
    Ack = 3,
    /// Lender → consumer: the lend was live when the read was done.
    ReadConfirmed = 4,
    /// Lender → consumer: the lend was not live (expired, consumed or
    /// unknown): the bytes read may be another request's; fail the read.
    ReadRefused = 5,
    /// Consumer → lender: this consumer will not read (its read failed,
    /// was aborted or hit its deadline, and has stopped): stop waiting.
    GaveUp = 6,
    /// Writer → destination: this writer's push ended without success and
    /// nothing more of it is in flight.
    WriteAbandoned = 7,
    /// Reader → lender: my read of this lend is still in flight; keep it
    /// (the lender extends the lend's lease by its own length).
    Heartbeat = 8,
    /// Destination → a possible writer, once a push destination's lease ran
    /// out (or it was aborted): "will anything of yours still land in this
    /// request's blocks?" A writer with puts still in flight says nothing
    /// (its [`NoteKind::WriteDone`] or [`NoteKind::WriteAbandoned`] follows
    /// them); any other answers [`NoteKind::WriteQuiet`] and will not post
    /// for that request any more.
    WriteQuery = 9,
    /// Writer → destination: nothing of mine for this request is in flight,
    /// and I will post nothing more for it.
    WriteQuiet = 10,
    /// Lender → consumer: no lend of that incarnation is known here yet
    /// (the read's question overtook the lend on its way to the lender's
    /// poller): ask again. The consumer does, until its grace period ends.
    ReadPending = 11,
    /// Lender → consumer: no lend here of the incarnation named lent the
    /// blocks the read read (they are another lend's or free, or the
    /// incarnation is not one this engine lent or will lend): fail the
    /// read (`Cause::NotLent`).
    ReadNotLent = 12,
    /// Destination → writer: this receive does not take the write's word
    /// (the blocks it wrote are not the receive's, or the receive's blocks
    /// may hold another write's bytes): fail the write
    /// (`Cause::NotLent`); the receive fails too.
    WriteNotLent = 13,
}

/// One notification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Notification {
    /// What it says.
    pub kind: NoteKind,
    /// The request it is about (the same id on both sides).
    pub id: RequestId,
    /// The lend or push destination it is about.
    pub incarnation: Incarnation,
    /// The read's or write's own token ([`Incarnation::NONE`] where the
    /// note is not part of one attempt's traffic).
    pub nonce: Incarnation,
    /// The sender engine's instance id, to route an ack back.
    pub sender: u64,
    /// A read done's blocks ([`BlocksRead::NONE`] for every other kind).
    pub blocks: BlocksRead,
}

/// Why a notification payload was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum NotificationError {
    /// Wrong size: a notification is [`LEN`] bytes, a message 1 to
    /// [`MAX_PER_MESSAGE`] of them.
    #[error("{0} bytes: a notification is {LEN} bytes, a message 1 to {MAX_PER_MESSAGE} of them")]
    Length(usize),
    /// Not a kvpoll notification.
    #[error("notification has a bad magic")]
    BadMagic,
    /// Another version.
    #[error("notification version {0}, expected {VERSION}")]
    Version(u8),
    /// Damaged.
    #[error("notification checksum mismatch")]
    BadChecksum,
    /// An unknown kind byte.
    #[error("notification kind {0} is unknown")]
    Kind(u8),
    /// No incarnation named.
    #[error("notification names no incarnation")]
    NoIncarnation,
}

impl Notification {
    /// The wire bytes.
    pub fn encode(&self) -> [u8; LEN] {
        let mut b = [0u8; LEN];
        b[0..2].copy_from_slice(&MAGIC);
        b[2] = VERSION;
        b[3] = self.kind as u8;
        b[4..12].copy_from_slice(&self.id.0.to_le_bytes());
        b[12..20].copy_from_slice(&self.incarnation.0.to_le_bytes());
        b[20..28].copy_from_slice(&self.nonce.0.to_le_bytes());
        b[28..36].copy_from_slice(&self.sender.to_le_bytes());
        b[36..40].copy_from_slice(&self.blocks.count.to_le_bytes());
        b[40..48].copy_from_slice(&self.blocks.digest.to_le_bytes());
        let sum = fnv1a64(&b[..SUM]) as u32;
        b[SUM..LEN].copy_from_slice(&sum.to_le_bytes());
        b
    }

    /// Checks and decodes received bytes.
    pub fn decode(b: &[u8]) -> Result<Self, NotificationError> {
        if b.len() != LEN {
            return Err(NotificationError::Length(b.len()));
        }
        if b[0..2] != MAGIC {
            return Err(NotificationError::BadMagic);
        }
        let word = |r: std::ops::Range<usize>| {
            let mut w = [0u8; 8];
            w[..r.len()].copy_from_slice(&b[r]);
            u64::from_le_bytes(w)
        };
        if word(SUM..LEN) as u32 != fnv1a64(&b[..SUM]) as u32 {
            return Err(NotificationError::BadChecksum);
        }
        if b[2] != VERSION {
            return Err(NotificationError::Version(b[2]));
        }
        let kind = match b[3] {
            1 => NoteKind::ReadDone,
            2 => NoteKind::WriteDone,
            3 => NoteKind::Ack,
            4 => NoteKind::ReadConfirmed,
            5 => NoteKind::ReadRefused,
            6 => NoteKind::GaveUp,
            7 => NoteKind::WriteAbandoned,
            8 => NoteKind::Heartbeat,
            9 => NoteKind::WriteQuery,
            10 => NoteKind::WriteQuiet,
            11 => NoteKind::ReadPending,
            12 => NoteKind::ReadNotLent,
            13 => NoteKind::WriteNotLent,
            k => return Err(NotificationError::Kind(k)),
        };
        let incarnation = Incarnation(word(12..20));
        if incarnation.is_none() {
            return Err(NotificationError::NoIncarnation);
        }
        Ok(Self {
            kind,
            id: RequestId(word(4..12)),
            incarnation,
            nonce: Incarnation(word(20..28)),
            sender: word(28..36),
            blocks: BlocksRead {
                count: word(36..40) as u32,
                digest: word(40..48),
            },
        })
    }
}

/// Bytes an engine with a key ([`crate::auth`]) appends to each
/// notification message: a counter of its own for the receiver (a u64
/// that starts at one) and a tag (keyed BLAKE3) of the receiver's
/// instance, the counter and the notifications.
///
/// ```text
/// 0        n × 52  the notifications
/// n × 52   8       counter, little endian
/// +8       32      tag
/// ```
pub const TRAILER: usize = 8 + TAG_LEN;

/// Senders whose counters a receiver remembers; past that, the one heard
/// from least recently is forgotten.
pub const MAX_SENDERS: usize = 4096;

/// Why a message of a keyed engine's was dropped before its notes were
/// read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// No valid tag under this engine's key for this engine: sent without
    /// the key, with another, for another receiver, or altered.
    Unauthenticated,
    /// A valid tag on a counter already received from its sender (or older
    /// than the window of [`crate::auth`]'s replay check): a copy of a
    /// message received before.
    Replayed,
}

/// What a keyed engine keeps to tag its messages and check its peers':
/// a counter per receiver, and per sender the counters it accepted.
#[derive(Debug)]
pub struct Sealer {
    key: AuthKey,
    /// Counter of the last message sent, by receiver instance.
    sent: HashMap<u64, u64>,
    /// Counters accepted, and when last (in messages opened), by sender
    /// instance.
    received: HashMap<u64, (Window, u64)>,
    opened: u64,
}

impl Sealer {
    /// A sealer for `key`, with no counter yet.
    pub fn new(key: AuthKey) -> Self {
        Sealer {
            key,
            sent: HashMap::new(),
            received: HashMap::new(),
            opened: 0,
        }
    }

    /// The trailer of a message of `notes` to the engine of instance
    /// `to`: its next counter for it, and the tag.
    pub fn seal(&mut self, to: u64, notes: &[u8]) -> [u8; TRAILER] {
        let counter = self.sent.entry(to).or_insert(0);
        *counter += 1;
        let c = counter.to_le_bytes();
        let tag = self
            .key
            .tag(Purpose::Notifications, &[&to.to_le_bytes(), &c, notes]);
        let mut t = [0u8; TRAILER];
        t[..8].copy_from_slice(&c);
        t[8..].copy_from_slice(&tag);
        t
    }

    /// The notifications of `message`, received by the engine of instance
    /// `me`, if its tag checks out and its counter is new from its sender
    /// (the sender the first notification names; the counter is then
    /// remembered). The notifications are still to be checked one by one.
    pub fn open<'a>(&mut self, me: u64, message: &'a [u8]) -> Result<&'a [u8], Refused> {
        let Some(body_len) = message.len().checked_sub(TRAILER) else {
            return Err(Refused::Unauthenticated);
        };
        let (notes, trailer) = message.split_at(body_len);
        let (c, tag) = trailer.split_at(8);
        if !self
            .key
            .verify(Purpose::Notifications, &[&me.to_le_bytes(), c, notes], tag)
        {
            return Err(Refused::Unauthenticated);
        }
        // Tagged by a holder of the key: its notes are well formed (a
        // damaged one is refused on its own later).
        let Some(sender) = notes.get(28..36) else {
            return Ok(notes);
        };
        let sender = u64::from_le_bytes(sender.try_into().expect("8 bytes"));
        let counter = u64::from_le_bytes(c.try_into().expect("8 bytes"));
        self.opened += 1;
        if !self.received.contains_key(&sender) && self.received.len() >= MAX_SENDERS {
            let oldest = self.received.iter().min_by_key(|(_, (_, at))| *at);
            if let Some((&s, _)) = oldest {
                self.received.remove(&s);
            }
        }
        let (window, at) = self.received.entry(sender).or_default();
        *at = self.opened;
        if window.accept(counter) {
            Ok(notes)
        } else {
            Err(Refused::Replayed)
        }
    }
}

/// The notifications of one received message, each still to be checked with
/// [`Notification::decode`]; refused whole if its length is not 1 to
/// [`MAX_PER_MESSAGE`] notifications.
pub fn split(message: &[u8]) -> Result<std::slice::ChunksExact<'_, u8>, NotificationError> {
    let n = message.len() / LEN;
    if message.len() % LEN != 0 || n == 0 || n > MAX_PER_MESSAGE {
        return Err(NotificationError::Length(message.len()));
    }
    Ok(message.chunks_exact(LEN))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sealer(secret: &[u8]) -> Sealer {
        Sealer::new(AuthKey::from_secret(secret).unwrap())
    }

    #[test]
    fn a_sealed_message_opens_once_for_its_receiver_under_its_key() {
        let (mut a, mut b) = (sealer(b"0123456789abcdef"), sealer(b"0123456789abcdef"));
        let notes = [note().encode(), note().encode()].concat();
        let first = [&notes[..], &a.seal(9, &notes)].concat();
        let second = [&notes[..], &a.seal(9, &notes)].concat();
        assert_eq!(b.open(8, &first), Err(Refused::Unauthenticated), "for 9");
        assert_eq!(b.open(9, &second), Ok(&notes[..]), "out of order");
        assert_eq!(b.open(9, &first), Ok(&notes[..]));
        assert_eq!(b.open(9, &first), Err(Refused::Replayed));
        assert_eq!(b.open(9, &second), Err(Refused::Replayed));
        let mut other = sealer(b"0123456789abcdeF");
        let forged = [&notes[..], &other.seal(9, &notes)].concat();
        assert_eq!(b.open(9, &forged), Err(Refused::Unauthenticated));
        assert_eq!(b.open(9, &notes), Err(Refused::Unauthenticated), "untagged");
        let mut altered = [&notes[..], &a.seal(9, &notes)].concat();
        altered[4] ^= 1;
        assert_eq!(b.open(9, &altered), Err(Refused::Unauthenticated));
        assert_eq!(b.open(9, &[0u8; 3]), Err(Refused::Unauthenticated));
    }

    #[test]
    fn each_receiver_has_its_own_counter() {
        let mut a = sealer(b"0123456789abcdef");
        let n = note().encode();
        assert_eq!(a.seal(1, &n)[..8], 1u64.to_le_bytes());
        assert_eq!(a.seal(2, &n)[..8], 1u64.to_le_bytes());
        assert_eq!(a.seal(1, &n)[..8], 2u64.to_le_bytes());
    }

    fn note() -> Notification {
        Notification {
            kind: NoteKind::Ack,
            id: RequestId(0xdead_beef),
            incarnation: Incarnation(0x1234_5678_9abc),
            nonce: Incarnation(77),
            sender: 42,
            blocks: BlocksRead {
                count: 3,
                digest: 0xfeed,
            },
        }
    }

    #[test]
    fn notification_round_trips() {
        assert_eq!(Notification::decode(&note().encode()), Ok(note()));
    }

    #[test]
    fn damaged_truncated_or_foreign_payloads_are_refused() {
        let b = note().encode();
        for i in 0..LEN {
            let mut c = b;
            c[i] ^= 1;
            assert!(Notification::decode(&c).is_err(), "flip at {i} accepted");
        }
        assert_eq!(
            Notification::decode(&b[..LEN - 1]),
            Err(NotificationError::Length(LEN - 1))
        );
        assert_eq!(
            Notification::decode(&[0u8; LEN]),
            Err(NotificationError::BadMagic)
        );
    }

    #[test]
    fn a_run_of_the_lent_blocks_is_within_the_lend_and_nothing_else() {
        let lent = [5u32, 1, 9, 3];
        let ids = lent.iter().map(|&b| BlockId(b));
        let of = |set: &[u32]| {
            let mut v = set.to_vec();
            v.sort_unstable();
            v.dedup();
            BlocksRead::of(v.into_iter().map(BlockId))
        };
        let full = of(&lent);
        for run in [
            &[5u32, 1, 9, 3][..],
            &[9, 3],
            &[3],
            &[5],
            &[1, 9],
            &[3, 9, 1],
        ] {
            assert!(of(run).within(ids.clone(), full), "{run:?}");
        }
        for not in [&[5u32, 9][..], &[2], &[1, 3], &[5, 1, 9, 3, 7], &[]] {
            assert!(!of(not).within(ids.clone(), full), "{not:?}");
        }
    }

    #[test]
    fn a_message_splits_into_whole_notifications_or_is_refused() {
        let b = note().encode();
        let three = [b, b, b].concat();
        let parts: Vec<_> = split(&three).expect("three notes").collect();
        assert_eq!(parts.len(), 3);
        assert!(parts.iter().all(|p| Notification::decode(p) == Ok(note())));
        let most = b.repeat(MAX_PER_MESSAGE);
        assert_eq!(split(&most).map(|c| c.count()), Ok(MAX_PER_MESSAGE));
        for bad in [
            0,
            1,
            LEN - 1,
            LEN + 1,
            3 * LEN - 1,
            (MAX_PER_MESSAGE + 1) * LEN,
        ] {
            let m = vec![0u8; bad];
            assert_eq!(
                split(&m).map(|c| c.count()),
                Err(NotificationError::Length(bad)),
                "{bad} bytes"
            );
        }
    }
}
