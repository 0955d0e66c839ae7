//! `kvpoll bench trace` exports the ledger bench's completion trace, and the
//! Python reference replays it (when python3 is here) into a figure.

use std::process::Command;

#[test]
fn bench_trace_writes_the_ledger_schedule_and_the_python_reference_replays_it() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.txt");
    let st = Command::new(env!("CARGO_BIN_EXE_kvpoll"))
        .args(["bench", "trace", "--out"])
        .arg(&trace)
        .status()
        .unwrap();
    assert!(st.success());
    let text = std::fs::read_to_string(&trace).unwrap();
    assert!(
        text.starts_with("kvpoll-trace 1 32768 8 256 1 8\n"),
        "{}",
        &text[..40]
    );
    assert_eq!(text.lines().count(), 9);

    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/benches/reference/vllm_style.py"
    );
    let Ok(out) = Command::new("python3")
        .arg(script)
        .args(["--runs", "1", "--trace"])
        .arg(&trace)
        .output()
    else {
        eprintln!("python3 not here: the reference figure is unavailable");
        return;
    };
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json = String::from_utf8(out.stdout).unwrap();
    assert!(json.contains("\"completions\": 262144"), "{json}");
    assert!(json.contains("\"completions_per_s\": "), "{json}");
}

#[test]
fn bench_trace_without_out_is_a_usage_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvpoll"))
        .args(["bench", "trace"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn bench_compare_prints_its_groups_as_json_and_says_the_peers_were_not_measured() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvpoll"))
        .args(["bench", "compare", "--only", "small_tcp", "--scale", "0.02"])
        .args(["--rounds", "1", "--peers-python", "none", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let json = String::from_utf8(out.stdout).unwrap();
    assert!(
        json.contains("\"group\":\"small_tcp_caller_pull\""),
        "{json}"
    );
    assert!(json.contains("peer systems not measured"), "{json}");
    assert!(json.contains("\"system\":\"kvpoll\""), "{json}");
    // Small reads also run in waves, one request a wave, as NIXL's
    // batched setting does; every byte it checked was right.
    let batched = json
        .split("\"system\":\"kvpoll, batched\"")
        .nth(1)
        .unwrap_or_else(|| panic!("no batched kvpoll: {json}"));
    let field = |name: &str| -> f64 {
        let at = batched.find(&format!("\"{name}\":")).unwrap() + name.len() + 3;
        let end = batched[at..].find([',', '}']).unwrap();
        batched[at..at + end].parse().unwrap()
    };
    assert!(field("per_s") > 0.0, "{batched}");
    assert!(field("checked") > 0.0, "{batched}");
    assert_eq!(field("bad"), 0.0, "{batched}");
}
