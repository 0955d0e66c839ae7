//! The control protocol: whole frames, and a stream of frames read the way
//! `serve` reads them, without a key and with one. An untagged frame that
//! decodes re-encodes to the same bytes.
#![no_main]

use std::time::Duration;

use kvpoll::auth::AuthKey;
use kvpoll_cli::control::{FrameReader, Msg, Session};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = Msg::decode(data) {
        assert_eq!(m.encode().as_deref(), Ok(data));
    }
    let mut r = FrameReader::new(data, Duration::from_secs(1), None);
    while r.read_msg().is_ok() {}
    let key = AuthKey::from_secret(b"fuzzing's shared secret").expect("key");
    let mut r = FrameReader::new(data, Duration::from_secs(1), None)
        .with_session(Session::new(Some(&key)));
    while r.read_msg().is_ok() {}
});
