//! The `kvpoll` tool's front door: the demo moves and verifies real blocks,
//! and bad arguments get a usage error, not a panic.

use std::process::Command;

fn kvpoll(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kvpoll"))
        .args(args)
        .output()
        .expect("run kvpoll")
}

fn json_number(json: &str, key: &str) -> f64 {
    let at = json
        .find(&format!("\"{key}\":"))
        .unwrap_or_else(|| panic!("{key} missing in {json}"));
    let rest = &json[at + key.len() + 3..];
    let end = rest.find([',', '}']).unwrap();
    rest[..end].parse().unwrap()
}

#[test]
fn transfer_moves_every_block_over_shared_memory_and_verifies_it() {
    let out = kvpoll(&["transfer", "--blocks", "256", "--rounds", "3", "--json"]);
    assert!(out.status.success(), "{out:?}");
    let json = String::from_utf8(out.stdout).unwrap();
    // Two timed rounds (the warm-up is excluded) of 256 x 16 KiB.
    assert_eq!(json_number(&json, "bytes"), (2 * 256 * 16384) as f64);
    assert_eq!(json_number(&json, "corrupted_blocks"), 0.0);
    assert_eq!(json_number(&json, "failed_ops"), 0.0);
    assert!(json_number(&json, "gb_per_s") > 0.0);
}

#[test]
fn transfer_text_output_names_bytes_moved_and_rate() {
    let out = kvpoll(&[
        "transfer", "--tls", "tcp", "--blocks", "64", "--rounds", "2",
    ]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    let last = text.lines().last().unwrap();
    assert!(last.starts_with("moved "), "{text}");
    assert!(
        last.contains("GB/s") && last.contains("0 corrupted blocks"),
        "{text}"
    );
}

#[test]
fn bad_arguments_exit_2_with_a_message_naming_them() {
    for (args, needle) in [
        (&["transfer", "--rounds", "x"][..], "--rounds"),
        (&["demo", "--bogus"][..], "--bogus"),
        (&["launch"][..], "launch"),
        (&[][..], "no command"),
        (&["transfer", "--blocks"][..], "needs a value"),
        (&["demo", "--policy", "reckless"][..], "--policy"),
        (&["demo", "--ranks", "fibers"][..], "--ranks"),
    ] {
        let out = kvpoll(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}
