//! Core-map TOML files (`kvpoll topo --check`, `Engine` placement).
#![no_main]

use kvpoll::placement::CoreMapFile;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = CoreMapFile::parse(text, "fuzz.toml");
    }
});
