//! Peer metadata as `Engine::add_peer` receives it. What decodes untagged
//! re-encodes to the same bytes; tagged metadata decodes, and its tag is
//! checked, without panic.
#![no_main]

use kvpoll::auth::AuthKey;
use kvpoll::metadata::PeerMetadata;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = PeerMetadata::decode(data);
    let key = AuthKey::from_secret(b"fuzzing's shared secret").expect("key");
    let _ = PeerMetadata::decode_with_key(data, Some(&key));
    if let Ok(m) = PeerMetadata::decode_with_key(data, None) {
        assert_eq!(m.encode(), data);
    }
});
