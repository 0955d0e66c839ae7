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

/// `kvpoll bench compare` of the small loopback group, its rounds at a
/// hundredth of their size.
fn small_loopback_compare() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvpoll"));
    cmd.args(["bench", "compare", "--only", "small_loopback"])
        .args(["--scale", "0.01"]);
    cmd
}

#[test]
fn bench_compare_prints_its_groups_as_json_and_says_the_peers_were_not_measured() {
    let out = small_loopback_compare()
        .args(["--rounds", "2", "--peers-python", "none", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let json = String::from_utf8(out.stdout).unwrap();
    assert!(
        json.contains("\"group\":\"small_loopback_caller_pull\""),
        "{json}"
    );
    // Two rounds each, their spread beside the median; the serving
    // loop's caller beside the blocking one.
    assert!(json.contains("\"per_s_min\":"), "{json}");
    assert!(json.contains("\"rounds_per_s\":["), "{json}");
    assert!(
        json.contains("\"system\":\"kvpoll, serving loop\""),
        "{json}"
    );
    assert!(json.contains("\"system\":\"tcp stream\""), "{json}");
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

/// `bench compare` of the small tcp group whose second kvpoll system's
/// UCX options name no transport: that system fails, and the group.
fn compare_a_group_that_does_not_run(json: bool) -> std::process::Output {
    let mut cmd = small_loopback_compare();
    cmd.args(["--rounds", "1", "--peers-python", "none"])
        .args(["--alt-ucx", "TLS=no_such_transport"]);
    if json {
        cmd.arg("--json");
    }
    cmd.output().unwrap()
}

#[test]
fn bench_compare_prints_the_rows_of_a_group_that_did_not_run_as_failed_and_exits_1() {
    let out = compare_a_group_that_does_not_run(false);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    // The group's rows: failed; a row of a group left out by --only: not
    // run.
    let row = |figure: &str| row_of(&text, figure);
    for figure in [
        "16 KiB reads, tcp over loopback: vs Mooncake",
        "16 KiB reads, tcp over loopback: keyed vs no key",
    ] {
        assert!(row(figure).ends_with(" FAILED"), "{text}");
    }
    assert!(
        row("CPU s/GB, kvpoll, 64 MiB read, tcp over loopback").ends_with(" n/a"),
        "{text}"
    );
    assert!(
        text.contains("loopback_small_vs_mooncake")
            && text.contains("small_loopback_caller_pull: kvpoll, other UCX options FAILED: "),
        "{text}"
    );
    assert!(text.contains("2 rows FAILED"), "{text}");
    assert!(
        text.contains("1 group FAILED: small_loopback_caller_pull"),
        "{text}"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("loopback_small_vs_mooncake"), "{err}");
}

#[test]
fn bench_compare_json_names_the_rows_of_a_group_that_did_not_run_and_exits_1() {
    let out = compare_a_group_that_does_not_run(true);
    let json = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let row = json
        .split("\"loopback_small_vs_mooncake\":")
        .nth(1)
        .unwrap_or_else(|| panic!("no row: {json}"));
    let row = &row[..row.find('}').unwrap()];
    assert!(
        row.contains("\"failed\":\"small_loopback_caller_pull: kvpoll, other UCX options FAILED: "),
        "{row}"
    );
    // And the keyed-vs-not row of the same group.
    assert!(json.contains("\"failed_rows\":2"), "{json}");
    assert!(
        json.contains("\"failed_groups\":[\"small_loopback_caller_pull\"]"),
        "{json}"
    );
}

/// `bench compare` of the small tcp group with `python` as the peer
/// systems' Python: NIXL and Mooncake are started through it.
fn compare_with_peers_python(python: &std::path::Path) -> std::process::Output {
    small_loopback_compare()
        .args(["--rounds", "1", "--peers-python"])
        .arg(python)
        .output()
        .unwrap()
}

/// The row of the table whose figure starts with `figure`.
fn row_of(text: &str, figure: &str) -> String {
    text.lines()
        .find(|l| l.starts_with(figure))
        .unwrap_or_else(|| panic!("no row {figure:?}: {text}"))
        .to_owned()
}

#[test]
fn bench_compare_with_a_peer_python_that_cannot_start_them_fails_the_group_and_exits_1() {
    // A Python that is given but never says READY: the peers were asked
    // for and did not run, which is a failed group, not an absent peer.
    let out = compare_with_peers_python(std::path::Path::new("/bin/false"));
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        row_of(&text, "16 KiB reads, tcp over loopback: vs Mooncake").ends_with(" FAILED"),
        "{text}"
    );
    assert!(!text.contains("all targets met"), "{text}");
    assert!(text.contains("group FAILED"), "{text}");
}

#[test]
fn bench_compare_with_a_peer_that_dies_mid_round_fails_the_group_and_exits_1() {
    // A peer driver that starts, then ends in the middle of its first
    // round, as a lending peer that exits on a full ring did.
    let dir = tempfile::tempdir().unwrap();
    let python = dir.path().join("python");
    std::fs::write(&python, "#!/bin/sh\necho READY\nread cmd\nexit 3\n").unwrap();
    let mut perm = std::fs::metadata(&python).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
    std::fs::set_permissions(&python, perm).unwrap();
    let out = compare_with_peers_python(&python);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        row_of(&text, "16 KiB reads, tcp over loopback: vs Mooncake").ends_with(" FAILED"),
        "{text}"
    );
    // The group's table names the system that failed, and how.
    let mooncake = row_of(&text, "    Mooncake ");
    assert!(
        mooncake.contains("FAILED") && mooncake.contains("ended mid-round"),
        "{text}"
    );
    assert!(!text.contains("all targets met"), "{text}");
}

/// `bench rails` over two veth pairs (root only: elsewhere it must say it
/// cannot make them and exit 1): every row has both rail counts' figures,
/// and Mooncake's where its Python is found; without one, unless told to
/// leave Mooncake out, the run fails saying how to get it.
#[test]
fn bench_rails_measures_one_rail_and_two_the_streams_and_mooncake_or_says_why_it_cannot() {
    let bench = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_kvpoll"))
            .args([
                "bench",
                "rails",
                "--rounds",
                "1",
                "--seconds",
                "0.5",
                "--json",
            ])
            .args(extra)
            .output()
            .unwrap()
    };
    // Where `bench rails` looks for Mooncake's Python by default.
    let exe = std::path::Path::new(env!("CARGO_BIN_EXE_kvpoll"));
    let venv = exe
        .parent()
        .and_then(|d| d.parent())
        .map(|t| t.join("bench-peers/venv/bin/python"));
    let python =
        std::env::var_os("KVPOLL_BENCH_PYTHON").is_some() || venv.is_some_and(|v| v.is_file());
    let out = bench(if python {
        &[]
    } else {
        &["--peers-python", "none"]
    });
    // SAFETY: no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        assert!(!out.status.success(), "{out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("needs root"), "{err}");
        return;
    }
    if !python {
        let without = bench(&[]);
        let err = String::from_utf8_lossy(&without.stderr);
        assert_eq!(without.status.code(), Some(1), "{err}");
        assert!(err.contains("make bench-peers"), "{err}");
    }
    assert!(out.status.success(), "{out:?}");
    let json = String::from_utf8(out.stdout).unwrap();
    for shape in ["64 MiB read", "8 MiB request", "tcp streams, one per pair"] {
        let row = json
            .split(&format!("\"shape\":\"{shape}\""))
            .nth(1)
            .unwrap_or_else(|| panic!("no {shape} row: {json}"));
        let mooncake = python && shape != "tcp streams, one per pair";
        let fields: &[&str] = if mooncake {
            &[
                "one_rail_gbps",
                "two_rails_gbps",
                "ratio",
                "mooncake_gbps",
                "two_rails_vs_mooncake",
            ]
        } else {
            &["one_rail_gbps", "two_rails_gbps", "ratio"]
        };
        let row = row.split("\"shape\"").next().unwrap();
        assert_eq!(row.contains("mooncake"), mooncake, "{shape}: {json}");
        for field in fields {
            let at = row.find(&format!("\"{field}\":")).unwrap() + field.len() + 3;
            let end = row[at..].find([',', '}']).unwrap();
            let v: f64 = row[at..at + end].parse().unwrap();
            assert!(v > 0.0, "{shape} {field}: {json}");
        }
    }
}
