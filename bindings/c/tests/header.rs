//! `kvpoll.h` is what cbindgen makes of `src/lib.rs` today. With
//! `KVPOLL_BLESS=1` the test rewrites it instead (`make header`).

use std::path::Path;

#[test]
fn the_checked_in_header_is_what_cbindgen_generates_from_the_source() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    config.header = Some(header_comment(
        config.header.as_deref().unwrap_or(""),
        &std::fs::read_to_string(dir.join("src/lib.rs")).expect("src/lib.rs"),
    ));
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

/// cbindgen.toml's header comment with the crate's module docs (the
/// contract: threads, ownership, errors, units) inside it, so that the
/// header carries what the Rust docs say.
fn header_comment(toml_header: &str, lib_rs: &str) -> String {
    let open = toml_header.trim_end().trim_end_matches("*/").trim_end();
    let mut out = String::from(open);
    out.push_str("\n *");
    for line in lib_rs.lines().take_while(|l| l.starts_with("//!")) {
        let text = line.trim_start_matches("//!").trim_start_matches(' ');
        assert!(
            !text.contains("*/"),
            "a module doc line closes the C comment: {text}"
        );
        out.push_str(if text.is_empty() { "\n *" } else { "\n * " });
        out.push_str(text);
    }
    out.push_str("\n */");
    out
}
