//! Notification messages as the poller receives them: 1 to 64
//! notifications back to back, each checked on its own.
#![no_main]

use kvpoll::notification::{split, Notification};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(parts) = split(data) {
        for part in parts {
            if let Ok(n) = Notification::decode(part) {
                assert_eq!(&n.encode()[..], part);
            }
        }
    }
});
