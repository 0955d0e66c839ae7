//! `kvpoll.h` is what cbindgen makes of `src/lib.rs` today. With
//! `KVPOLL_BLESS=1` the test rewrites it instead (`make header`).

use std::path::Path;

#[test]
fn the_checked_in_header_is_what_cbindgen_generates_from_the_source() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(dir.join("src/lib.rs"))
        .generate()
        .expect("cbindgen");
    let mut fresh = Vec::new();
    bindings.write(&mut fresh);
    let path = dir.join("kvpoll.h");
    if std::env::var_os("KVPOLL_BLESS").is_some() {
        std::fs::write(&path, &fresh).expect("writing kvpoll.h");
        return;
    }
    let checked_in = std::fs::read(&path).unwrap_or_default();
    assert!(
        checked_in == fresh,
        "bindings/c/kvpoll.h is stale: run `make header` and commit it"
    );
}
