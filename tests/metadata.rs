//! Peer metadata built from a real UCX worker and region: round trip, and
//! every kind of bad input refused with a typed error.

mod ucx_common;

use kvpoll::metadata::{
    BlockLayout, DirectReads, Host, MetadataError, PeerMetadata, RegionDescriptor,
};
use kvpoll::transport::ucx::MemoryRegion;
use kvpoll::wire::{fnv1a64, FrameError, Kind};
use proptest::prelude::*;

fn real_metadata(regions: &[(u32, u64)]) -> PeerMetadata {
    let (ctx, w) = ucx_common::worker("tcp");
    let regions = regions
        .iter()
        .map(|&(id, blocks)| {
            let region = MemoryRegion::allocate(&ctx, 4096 * 16).unwrap();
            RegionDescriptor {
                id,
                blocks,
                rkey: region.pack_rkey().unwrap(),
            }
        })
        .collect();
    PeerMetadata {
        instance: 0xfeed,
        layout: BlockLayout { block_size: 4096 },
        worker: w.address().unwrap(),
        regions,
        words: None,
        direct: None,
    }
}

/// Re-seals a frame after editing its header, so only the edit is wrong.
fn reseal(mut bytes: Vec<u8>) -> Vec<u8> {
    let n = bytes.len() - 8;
    let sum = fnv1a64(&bytes[..n]);
    bytes[n..].copy_from_slice(&sum.to_le_bytes());
    bytes
}

#[test]
fn metadata_round_trips_with_address_rkeys_and_layout() {
    let m = real_metadata(&[(0, 16), (3, 8)]);
    let decoded = PeerMetadata::decode(&m.encode()).unwrap();
    assert_eq!(decoded, m);
    decoded
        .check_compatible(BlockLayout { block_size: 4096 })
        .unwrap();
}

/// A peer that lists its regions in another order: they pair by id, so
/// layer 0 still moves to or from the peer's layer 0.
#[test]
fn regions_listed_out_of_order_are_taken_in_id_order() {
    let m = real_metadata(&[(1, 16), (0, 8)]);
    let decoded = PeerMetadata::decode(&m.encode()).unwrap();
    let ids: Vec<(u32, u64)> = decoded.regions.iter().map(|r| (r.id, r.blocks)).collect();
    assert_eq!(ids, vec![(0, 8), (1, 16)]);
}

/// Metadata without and with lend words.
fn both_kinds() -> [Vec<u8>; 2] {
    [
        real_metadata(&[(0, 16)]).encode(),
        with_words(64 * 8).encode(),
    ]
}

#[test]
fn truncated_metadata_is_refused_at_every_length() {
    for bytes in both_kinds() {
        for n in 0..bytes.len() {
            assert!(
                PeerMetadata::decode(&bytes[..n]).is_err(),
                "accepted {n} bytes"
            );
        }
    }
}

#[test]
fn any_damaged_byte_is_refused() {
    for bytes in both_kinds() {
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] = b[i].wrapping_add(1);
            assert!(
                PeerMetadata::decode(&b).is_err(),
                "accepted a change at {i}"
            );
        }
    }
}

#[test]
fn other_version_is_refused_as_wrong_version() {
    let mut bytes = real_metadata(&[(0, 16)]).encode();
    bytes[5] = 1;
    assert_eq!(
        PeerMetadata::decode(&reseal(bytes)),
        Err(MetadataError::Frame(FrameError::WrongVersion { got: 1 }))
    );
}

#[test]
fn incompatible_block_size_is_refused() {
    let m = real_metadata(&[(0, 16)]);
    assert_eq!(
        m.check_compatible(BlockLayout { block_size: 8192 }),
        Err(MetadataError::IncompatibleLayout {
            ours: 8192,
            theirs: 4096
        })
    );
}

#[test]
fn duplicate_region_ids_are_refused() {
    let m = real_metadata(&[(5, 1), (5, 1)]);
    assert_eq!(
        PeerMetadata::decode(&m.encode()),
        Err(MetadataError::DuplicateRegion(5))
    );
}

#[test]
fn region_claiming_more_blocks_than_its_rkey_covers_is_refused() {
    // Each test region is 64 KiB: 16 blocks of 4 KiB, not 17.
    let m = real_metadata(&[(0, 17)]);
    assert!(matches!(
        PeerMetadata::decode(&m.encode()),
        Err(MetadataError::BadLayout(_))
    ));
}

proptest! {
    #[test]
    fn random_bytes_never_panic_and_are_refused(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        prop_assert!(PeerMetadata::decode(&bytes).is_err());
    }
}

proptest! {
    #[test]
    fn random_notification_payloads_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
        let _ = kvpoll::notification::Notification::decode(&bytes);
    }

    #[test]
    fn a_damaged_notification_is_refused(i in 0usize..kvpoll::notification::LEN, flip in 1u8..=255) {
        use kvpoll::notification::{NoteKind, Notification};
        let mut b = Notification {
            kind: NoteKind::Ack,
            id: kvpoll::ledger::RequestId(5),
            incarnation: kvpoll::Incarnation(0xabc),
            nonce: kvpoll::Incarnation(2),
            sender: 9,
            blocks: Default::default(),
        }
        .encode();
        b[i] ^= flip;
        prop_assert!(Notification::decode(&b).is_err());
    }
}

fn with_words(bytes: usize) -> PeerMetadata {
    let (ctx, _w) = ucx_common::worker("tcp");
    let words = MemoryRegion::allocate(&ctx, bytes).unwrap();
    PeerMetadata {
        words: Some(words.pack_rkey().unwrap()),
        ..real_metadata(&[(0, 16)])
    }
}

#[test]
fn metadata_round_trips_with_lend_words() {
    let m = with_words(64 * 8);
    assert_eq!(PeerMetadata::decode(&m.encode()), Ok(m));
}

#[test]
fn lend_words_that_are_not_a_power_of_two_of_words_are_refused() {
    for bytes in [24, 12, 7] {
        assert_eq!(
            PeerMetadata::decode(&with_words(bytes).encode()),
            Err(MetadataError::BadLendWords(bytes as u64)),
            "{bytes} bytes"
        );
    }
}

fn with_direct(ids: Vec<u32>) -> PeerMetadata {
    PeerMetadata {
        direct: Some(DirectReads {
            host: Host {
                boot: *b"0123456789abcdef",
                pid_ns: 4026531836,
                pid: 4242,
            },
            probe_addr: 0x7f00_0000_1000,
            probe: 0x1234_5678_9abc_def1,
            regions: ids,
        }),
        ..real_metadata(&[(0, 16), (5, 16)])
    }
}

#[test]
fn metadata_round_trips_with_a_direct_read_offer() {
    let m = with_direct(vec![5, 0]);
    assert_eq!(PeerMetadata::decode(&m.encode()), Ok(m));
}

#[test]
fn a_direct_read_offer_naming_a_region_not_announced_or_twice_is_refused() {
    for ids in [vec![7], vec![0, 0]] {
        let bytes = with_direct(ids.clone()).encode();
        assert!(
            matches!(
                PeerMetadata::decode(&bytes),
                Err(MetadataError::BadDirectReads(_))
            ),
            "{ids:?}"
        );
    }
}

#[test]
fn a_direct_read_offer_cut_short_or_of_an_unknown_flag_is_refused() {
    let full = with_direct(vec![0]).encode();
    let payload = kvpoll::wire::decode(&full, Kind::PeerMetadata)
        .unwrap()
        .to_vec();
    // Every cut inside the offer and the tag flag after it: the offer's
    // flag byte is 52 bytes before the end (flag, 16 + 8 + 4 + 8 + 8, a
    // count of 2 and one id of 4, then the tag flag).
    let offer = payload.len() - 52;
    for cut in offer..payload.len() {
        let bytes = kvpoll::wire::encode(Kind::PeerMetadata, &payload[..cut]);
        assert!(
            matches!(
                PeerMetadata::decode(&bytes),
                Err(MetadataError::Truncated(_))
            ),
            "cut at {cut}: {:?}",
            PeerMetadata::decode(&bytes)
        );
    }
    let mut none = kvpoll::wire::decode(&real_metadata(&[(0, 16)]).encode(), Kind::PeerMetadata)
        .unwrap()
        .to_vec();
    // The offer's flag, before the tag flag.
    let flag = none.len() - 2;
    none[flag] = 2;
    let bytes = kvpoll::wire::encode(Kind::PeerMetadata, &none);
    assert!(matches!(
        PeerMetadata::decode(&bytes),
        Err(MetadataError::BadDirectReads(_))
    ));
}
