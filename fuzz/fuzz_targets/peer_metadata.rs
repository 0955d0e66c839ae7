//! Peer metadata as `Engine::add_peer` receives it. What decodes re-encodes
//! to the same bytes.
#![no_main]

use kvpoll::metadata::PeerMetadata;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = PeerMetadata::decode(data) {
        assert_eq!(m.encode(), data);
    }
});
