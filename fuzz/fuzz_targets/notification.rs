//! Consumer notifications as the poller receives them.
#![no_main]

use kvpoll::notification::Notification;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(n) = Notification::decode(data) {
        assert_eq!(&n.encode()[..], data);
    }
});
