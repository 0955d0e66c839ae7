//! `kvpoll topo` on this machine: the tree, the isolation state and a
//! suggested map that `kvpoll topo --check` accepts; `--check` exit codes
//! and warnings.

use std::io::Write;
use std::process::{Command, Output};

use kvpoll::placement::Topology;

const MARKER: &str = "--- suggested core map";

fn kvpoll(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvpoll"))
        .args(args)
        .output()
        .unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn map_file(contents: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::Builder::new().suffix(".toml").tempfile().unwrap();
    f.write_all(contents.as_bytes()).unwrap();
    f
}

fn check(path: &str) -> (Option<i32>, String, String) {
    let out = kvpoll(&["topo", "--check", path]);
    (out.status.code(), text(&out.stdout), text(&out.stderr))
}

#[test]
fn topo_prints_the_tree_isolation_and_a_map_that_check_accepts() {
    let out = kvpoll(&["topo"]);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}{}", text(&out.stderr));
    assert!(stdout.contains("Core L#0"), "{stdout}");
    assert!(stdout.contains("PU P#"), "{stdout}");
    assert!(
        stdout.contains("/sys/devices/system/cpu/isolated"),
        "{stdout}"
    );
    assert!(stdout.contains("isolcpus="), "{stdout}");

    let (_, suggested) = stdout.split_once(MARKER).expect("a suggested map");
    // The map starts on the line after the marker.
    let (_, map) = suggested.split_once('\n').unwrap();
    assert!(map.contains("[[poller]]"), "{map}");
    let file = map_file(map);
    let (code, stdout, stderr) = check(file.path().to_str().unwrap());
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("valid on this machine"), "{stdout}");
}

#[test]
fn topo_map_prints_only_the_suggested_map() {
    let out = kvpoll(&["topo", "--map"]);
    assert_eq!(out.status.code(), Some(0));
    let stdout = text(&out.stdout);
    assert!(stdout.starts_with("# Core map derived"), "{stdout}");
    assert!(!stdout.contains("PU P#"), "{stdout}");
}

#[test]
fn check_auto_derives_and_accepts_a_map() {
    let (code, stdout, stderr) = check("auto");
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(
        stdout.contains("auto: derived from this machine"),
        "{stdout}"
    );
}

#[test]
fn check_rejects_a_map_naming_a_missing_cpu_with_exit_1() {
    let file = map_file("[engine]\ncores = [0]\n\n[[poller]]\ncore = 4000\nworkers = [\"all\"]\nidle = \"adaptive\"\n");
    let path = file.path().to_str().unwrap();
    let (code, _, stderr) = check(path);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("{path}:5: CPU 4000 does not exist")),
        "{stderr}"
    );
}

#[test]
fn check_rejects_bad_syntax_with_its_line_and_exit_1() {
    let file = map_file("[engine]\ncores = [0\n");
    let (code, _, stderr) = check(file.path().to_str().unwrap());
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains(":2: TOML syntax error"), "{stderr}");
}

#[test]
fn check_warns_about_a_busy_poller_on_a_non_isolated_cpu_and_still_exits_0() {
    let topo = Topology::detect().unwrap();
    let plain: Vec<usize> = topo
        .cpus
        .iter()
        .filter(|c| c.online && c.allowed && !topo.isolation.is_isolated(c.id))
        .map(|c| c.id)
        .collect();
    let [engine, poller, ..] = plain[..] else {
        eprintln!("skipped: this machine has fewer than two non-isolated CPUs");
        return;
    };
    let file = map_file(&format!(
        "[engine]\ncores = [{engine}]\n\n[[poller]]\ncore = {poller}\nworkers = [\"all\"]\nidle = \"busy\"\n"
    ));
    let path = file.path().to_str().unwrap();
    let (code, stdout, stderr) = check(path);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(
        stdout.contains(&format!(
            "{path}:5: warning: busy poller on CPU {poller}, which is not isolated"
        )),
        "{stdout}"
    );
}

#[test]
fn topo_usage_errors_exit_2() {
    assert_eq!(kvpoll(&["topo", "--bogus"]).status.code(), Some(2));
    assert_eq!(kvpoll(&["topo", "--check"]).status.code(), Some(2));
}

#[test]
fn rust_log_shows_the_librarys_events_on_stderr_and_the_default_level_hides_debug() {
    let quiet = Command::new(env!("CARGO_BIN_EXE_kvpoll"))
        .args(["topo", "--map"])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    assert_eq!(quiet.status.code(), Some(0));
    assert!(
        !text(&quiet.stderr).contains("topology detected"),
        "{}",
        text(&quiet.stderr)
    );

    let loud = Command::new(env!("CARGO_BIN_EXE_kvpoll"))
        .args(["topo", "--map"])
        .env("RUST_LOG", "kvpoll=debug")
        .output()
        .unwrap();
    assert_eq!(loud.status.code(), Some(0));
    let stderr = text(&loud.stderr);
    assert!(stderr.contains("topology detected"), "{stderr}");
    // Standard output is still the map alone.
    assert!(
        text(&loud.stdout).starts_with("# Core map derived"),
        "{}",
        text(&loud.stdout)
    );
}
