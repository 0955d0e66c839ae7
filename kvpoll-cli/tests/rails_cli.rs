//! The tool over rails, real processes and real UCX: `serve` and `connect`
//! with `--rail` (two rails, tcp, both bound to the loopback device) move
//! every block over both rails, verified, large reads striped, and
//! `connect --json` says per rail what it carried; a decode of one engine is refused by a prefill rank of several
//! rails with a message saying why, and a decode of several rails reads a
//! prefill rank of one engine.
//!
//! Time bounds here are guards against a hang, not measurements.

use std::io::Read;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

mod procs;

use procs::{json_field as field, wait_exit, Serve};

fn kvpoll() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvpoll"))
}

const RAILS: [&str; 4] = ["--rail", "lo", "--rail", "lo"];

/// `connect` to `a` and `b` with `extra`, to its end.
fn connect(a: &Serve, b: &Serve, extra: &[&str]) -> Output {
    let mut child = kvpoll()
        .args(["connect", "--to", &format!("{},{}", a.addr, b.addr)])
        .arg("--json")
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let o = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let e = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err.read_to_end(&mut v);
        v
    });
    let status = wait_exit(&mut child, Duration::from_secs(120), "connect");
    Output {
        status,
        stdout: o.join().unwrap(),
        stderr: e.join().unwrap(),
    }
}

/// The `"rails":[...]` entries of `connect --json`, each as its text.
fn rails(json: &str) -> Vec<String> {
    let Some(at) = json.find("\"rails\":[") else {
        return Vec::new();
    };
    let list = &json[at + "\"rails\":[".len()..];
    let end = list.find(']').expect("the rails list ends");
    list[..end]
        .split("},{")
        .filter(|s| !s.is_empty())
        .map(|s| format!("{{{}}}", s.trim_matches(|c| c == '{' || c == '}')))
        .collect()
}

/// Both ranks and the decode on two rails, 60 requests: `layout` are the
/// sizes both sides take, `window` the decode's own flags.
fn two_rails_everywhere(layout: &[&str], window: &[&str]) -> (String, Vec<String>) {
    let (a, b) = (
        Serve::start(&[&["--rank", "0"], &RAILS[..], layout].concat()),
        Serve::start(&[&["--rank", "1"], &RAILS[..], layout].concat()),
    );
    let flags = ["--requests", "60", "--give-up-after", "10"];
    let out = connect(&a, &b, &[&RAILS[..], layout, window, &flags[..]].concat());
    let json = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "connect over rails: {json}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(field(&json, "finished"), 60, "{json}");
    assert_eq!(field(&json, "corrupted_blocks"), 0, "{json}");
    assert_eq!(field(&json, "leaked_blocks"), 0, "{json}");
    let rails = rails(&json);
    assert_eq!(rails.len(), 2, "one entry per rail: {json}");
    for (i, r) in rails.iter().enumerate() {
        assert!(r.contains("\"device\":\"lo\""), "rail {i}: {r}");
        assert!(field(r, "bytes") > 0, "rail {i} moved nothing: {r}");
        assert!(field(r, "parts_finished") > 0, "rail {i}: {r}");
        assert_eq!(field(r, "parts_failed"), 0, "rail {i}: {r}");
    }
    (json, rails)
}

#[test]
fn small_requests_over_two_rails_use_both_and_arrive_verified() {
    // Two handles of 8 blocks of 16 KiB: 256 KiB reads, each handle sent
    // whole to one rail (`tests/rails.rs` checks which): a read is a part
    // on one rail or one on each.
    let (json, rails) = two_rails_everywhere(&[], &[]);
    let parts: u64 = rails.iter().map(|r| field(r, "parts_finished")).sum();
    assert!((60..=120).contains(&parts), "{parts} parts: {json}");
}

#[test]
fn large_requests_over_two_rails_are_striped_across_both_and_arrive_verified() {
    // Two handles of 4 blocks of 1 MiB: 8 MiB reads, striped.
    let layout = ["--block-size", "1048576", "--blocks", "32"];
    let window = ["--blocks-per-handle", "4", "--window", "2"];
    let (json, rails) = two_rails_everywhere(&layout, &window);
    // Each read had a part on each rail: 60 parts on each.
    for r in &rails {
        assert_eq!(field(r, "parts_finished"), 60, "{json}");
    }
}

#[test]
fn a_decode_of_one_engine_is_refused_by_prefill_ranks_of_several_rails_saying_why() {
    let (a, b) = (
        Serve::start(&[&["--rank", "0"], &RAILS[..]].concat()),
        Serve::start(&[&["--rank", "1"], &RAILS[..]].concat()),
    );
    let out = connect(&a, &b, &["--requests", "4", "--give-up-after", "2"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--rail"),
        "the refusal does not say what to do: {err}"
    );
}

#[test]
fn a_decode_of_two_rails_reads_prefill_ranks_of_one_engine_through_its_rail_0() {
    let (a, b) = (
        Serve::start(&["--rank", "0"]),
        Serve::start(&["--rank", "1"]),
    );
    let flags = ["--requests", "40", "--give-up-after", "10"];
    let out = connect(&a, &b, &[&RAILS[..], &flags[..]].concat());
    let json = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{json}");
    assert_eq!(field(&json, "finished"), 40, "{json}");
    assert_eq!(field(&json, "corrupted_blocks"), 0, "{json}");
    let rails = rails(&json);
    assert_eq!(rails.len(), 2, "{json}");
    assert_eq!(field(&rails[0], "parts_finished"), 40, "{json}");
    assert_eq!(field(&rails[1], "parts_finished"), 0, "{json}");
}

#[test]
fn rails_with_push_mode_or_past_sixteen_or_a_bad_device_name_exit_2_saying_why() {
    let to = ["connect", "--to", "127.0.0.1:1,127.0.0.1:2"];
    let seventeen: Vec<&str> = [to.as_slice(), &["--rail", "a"].repeat(17)].concat();
    let push = [to.as_slice(), &["--rail", "lo", "--mode", "push"]].concat();
    let cases: [(&[&str], &str); 3] = [
        (&push, "push"),
        (&["serve", "--rail", "lo,eth0"], "network device"),
        (&seventeen, "at most 16"),
    ];
    for (args, says) in cases {
        let out = kvpoll().args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?} does not say {says:?}: {err}");
    }
}

#[test]
fn a_core_map_gives_each_rank_its_rails_pinned_where_the_map_says() {
    let dir = tempfile::tempdir().unwrap();
    let map = dir.path().join("rails.toml");
    std::fs::write(
        &map,
        "[engine]\ncores = [0]\n\n[[poller]]\ncore = 1\nworkers = [\"lo\"]\nidle = \"adaptive\"\n",
    )
    .unwrap();
    let map = map.to_str().unwrap();
    let (a, b) = (
        Serve::start(&["--rank", "0", "--core-map", map]),
        Serve::start(&["--rank", "1", "--core-map", map]),
    );
    let flags = [
        "--requests",
        "30",
        "--give-up-after",
        "10",
        "--core-map",
        map,
    ];
    let out = connect(&a, &b, &flags);
    let json = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{json}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(field(&json, "finished"), 30, "{json}");
    assert_eq!(field(&json, "corrupted_blocks"), 0, "{json}");
    let rails = rails(&json);
    assert_eq!(rails.len(), 1, "one rail a poller of the map: {json}");
    assert!(rails[0].contains("\"device\":\"lo\""), "{json}");
    assert_eq!(
        field(&rails[0], "core"),
        1,
        "pinned where the map says: {json}"
    );
    assert_eq!(field(&rails[0], "parts_finished"), 30, "{json}");
}

#[test]
fn a_core_map_that_cannot_be_read_or_one_given_with_rails_exits_2_saying_why() {
    let cases: [(&[&str], &str); 2] = [
        (
            &["serve", "--core-map", "/nonexistent/rails.toml"],
            "--core-map",
        ),
        (&["serve", "--core-map", "auto", "--rail", "lo"], "--rail"),
    ];
    for (args, says) in cases {
        let out = kvpoll().args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?} does not say {says:?}: {err}");
    }
}
