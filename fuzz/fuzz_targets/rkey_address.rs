//! Packed remote keys and worker addresses (framed), and the raw wire
//! frame decoder under them, as they arrive inside peer metadata.
#![no_main]

use kvpoll::transport::ucx::{PackedRkey, WorkerAddress};
use kvpoll::wire::{self, Kind};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = PackedRkey::from_bytes(data);
    let _ = WorkerAddress::from_bytes(data);
    for kind in [
        Kind::WorkerAddress,
        Kind::RemoteKey,
        Kind::PeerMetadata,
        Kind::Notification,
    ] {
        if let Ok(p) = wire::decode(data, kind) {
            assert_eq!(wire::encode(kind, p), data);
        }
    }
});
