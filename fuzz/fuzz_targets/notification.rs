//! Notification messages as the poller receives them: 1 to 33
//! notifications back to back, each checked on its own; and as an engine
//! with a key receives them, trailer first.
#![no_main]

use kvpoll::auth::AuthKey;
use kvpoll::notification::{split, Notification, Sealer};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(parts) = split(data) {
        for part in parts {
            if let Ok(n) = Notification::decode(part) {
                assert_eq!(&n.encode()[..], part);
            }
        }
    }
    let key = AuthKey::from_secret(b"fuzzing's shared secret").expect("key");
    let _ = Sealer::new(key).open(7, data);
});
