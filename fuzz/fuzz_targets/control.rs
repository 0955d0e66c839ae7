//! The control protocol: whole frames, and a stream of frames read the way
//! `serve` reads them. A frame that decodes re-encodes to the same bytes.
#![no_main]

use std::time::Duration;

use kvpoll_cli::control::{FrameReader, Msg};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = Msg::decode(data) {
        assert_eq!(m.encode().as_deref(), Ok(data));
    }
    let mut r = FrameReader::new(data, Duration::from_secs(1), None);
    while r.read_msg().is_ok() {}
});
