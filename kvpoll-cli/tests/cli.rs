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
        (&["transfer", "--rounds", "0"][..], "--rounds"),
        (&["demo", "--bogus"][..], "--bogus"),
        (&["launch"][..], "launch"),
        (&[][..], "Usage: kvpoll <COMMAND>"),
        (&["transfer", "--blocks"][..], "--blocks"),
        (&["demo", "--policy", "reckless"][..], "--policy"),
        (&["demo", "--ranks", "fibers"][..], "--ranks"),
        (&["connect", "--mode", "pull"][..], "--to"),
        (&["completions", "tcsh"][..], "tcsh"),
    ] {
        let out = kvpoll(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

#[test]
fn options_that_do_not_fit_together_exit_2_naming_both() {
    let out = kvpoll(&["demo", "--blocks", "8", "--window", "16"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("--blocks 8") && err.contains("--window 16"),
        "{err}"
    );
    assert!(err.contains("Usage: kvpoll demo"), "{err}");
}

#[test]
fn help_lists_every_command() {
    let out = kvpoll(&["--help"]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    for cmd in COMMANDS {
        assert!(text.contains(&format!("  {cmd} ")), "{cmd}: {text}");
    }
}

#[test]
fn demo_help_shows_every_option_with_its_default() {
    let out = kvpoll(&["demo", "--help"]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    for (option, default) in [
        ("--ranks", "processes"),
        ("--policy", "safe"),
        ("--requests", "3000"),
        ("--handle-error-every", "200"),
        ("--release-failure-every", "50"),
        ("--setup-failure-every", "197"),
        ("--lease-ms", "2000"),
        ("--soak", "0"),
        ("--sample-secs", "5"),
        ("--stall-every-ms", "2500"),
        ("--stall-ms", "400"),
        ("--tls", "posix,sysv,cma"),
        ("--raw-requests", "300"),
        ("--blocks", "512"),
        ("--block-size", "16384"),
        ("--layers", "2"),
        ("--blocks-per-handle", "4"),
        ("--window", "16"),
    ] {
        // The option's own paragraph runs up to the next option.
        let at = text
            .find(&format!("{option} <"))
            .unwrap_or_else(|| panic!("{option} missing: {text}"));
        let end = text[at + 2..]
            .find("\n      --")
            .map_or(text.len(), |e| at + 2 + e);
        assert!(
            text[at..end].contains(&format!("[default: {default}]")),
            "{option}: {}",
            &text[at..end]
        );
    }
    for flag in [
        "--no-faults",
        "--no-kill",
        "--no-fence",
        "--pause-ms",
        "--soak-csv",
        "--json",
    ] {
        assert!(text.contains(flag), "{flag}: {text}");
    }
}

/// Every command `kvpoll` has.
const COMMANDS: [&str; 9] = [
    "demo",
    "serve",
    "connect",
    "transfer",
    "bench",
    "topo",
    "completions",
    "ucx-peer",
    "engine-peer",
];

#[test]
fn no_option_states_its_default_twice() {
    let bench = ["all", "ledger", "engine", "e2e", "compare", "trace"];
    let commands = COMMANDS
        .iter()
        .map(|&c| vec![c])
        .chain(bench.iter().map(|&b| vec!["bench", b]));
    for cmd in commands {
        let mut args = cmd.clone();
        args.push("--help");
        let out = kvpoll(&args);
        assert!(out.status.success(), "{cmd:?}: {out:?}");
        let text = String::from_utf8(out.stdout).unwrap();
        // Each option's paragraph runs from its flags' line (indented
        // 2 to 6 spaces) up to the next option's.
        let mut paras: Vec<String> = Vec::new();
        for line in text.lines() {
            let indent = line.len() - line.trim_start().len();
            if (2..=6).contains(&indent) && line.trim_start().starts_with('-') {
                paras.push(String::new());
            }
            if let Some(p) = paras.last_mut() {
                p.push_str(line);
                p.push('\n');
            }
        }
        assert!(paras.len() >= 2, "{cmd:?}: no options found in {text}");
        for para in &paras {
            assert!(
                para.matches("[default:").count() <= 1,
                "{cmd:?}: a default stated twice in {para}"
            );
        }
    }
}

#[test]
fn every_command_has_help_that_exits_0() {
    for cmd in COMMANDS {
        let out = kvpoll(&[cmd, "--help"]);
        assert!(out.status.success(), "{cmd}: {out:?}");
        assert!(
            String::from_utf8(out.stdout)
                .unwrap()
                .contains(&format!("Usage: kvpoll {cmd}")),
            "{cmd}"
        );
    }
}

#[test]
fn completions_print_a_script_for_each_shell() {
    for (shell, marker) in [
        ("bash", "complete -F _kvpoll"),
        ("zsh", "#compdef kvpoll"),
        ("fish", "complete -c kvpoll"),
    ] {
        let out = kvpoll(&["completions", shell]);
        assert!(out.status.success(), "{shell}: {out:?}");
        let script = String::from_utf8(out.stdout).unwrap();
        assert!(script.contains(marker), "{shell}: {script}");
        assert!(script.contains("transfer"), "{shell}");
    }
}

#[test]
fn pools_that_cannot_be_registered_are_refused_at_once_with_exit_2() {
    for (args, needle) in [
        (&["serve", "--layers", "1000000"][..], "--layers"),
        (&["serve", "--layers", "1025"][..], "--layers"),
        (&["demo", "--layers", "5000"][..], "--layers"),
        (
            &["serve", "--blocks", "4000000", "--block-size", "1048576"][..],
            "memory available",
        ),
        (
            &["demo", "--blocks", "4000000", "--block-size", "1048576"][..],
            "memory available",
        ),
        (
            &[
                "connect",
                "--to",
                "127.0.0.1:1,127.0.0.1:1",
                "--blocks",
                "4000000",
                "--block-size",
                "1048576",
            ][..],
            "memory available",
        ),
    ] {
        let out = kvpoll(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        // Refused before serving: nothing was printed as listening.
        assert!(out.stdout.is_empty(), "{args:?}: {out:?}");
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

/// The environment a running `kvpoll ucx-peer` ended up with (after the
/// binary re-executed itself with its UCX defaults).
fn peer_environment(tx_seg: Option<&str>) -> String {
    use std::io::{BufRead, BufReader};
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvpoll"));
    cmd.args(["ucx-peer", "--tls", "tcp", "--blocks", "1"])
        .env_remove("UCX_TCP_TX_SEG_SIZE")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped());
    if let Some(v) = tx_seg {
        cmd.env("UCX_TCP_TX_SEG_SIZE", v);
    }
    let mut child = cmd.spawn().expect("spawn ucx-peer");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("READY "), "{line}");
    let env = std::fs::read(format!("/proc/{}/environ", child.id())).unwrap();
    drop(child.stdin.take());
    child.wait().unwrap();
    String::from_utf8_lossy(&env).replace('\0', "\n")
}

#[test]
fn kvpoll_sends_64_kib_tcp_segments_unless_the_environment_says_otherwise() {
    assert!(peer_environment(None)
        .lines()
        .any(|l| l == "UCX_TCP_TX_SEG_SIZE=64K"));
    assert!(peer_environment(Some("16K"))
        .lines()
        .any(|l| l == "UCX_TCP_TX_SEG_SIZE=16K"));
}
