//! Which UCX the tool runs on: `kvpoll --version` names the version the
//! loaded UCX reports and the one built against, and with the system's UCX
//! forced in (`LD_LIBRARY_PATH` outranks the build's rpath) an engine
//! starts exactly when that UCX is no older than the one built against,
//! and otherwise refuses with a message that says why.

use std::process::{Command, Output};

fn kvpoll(args: &[&str], library_path: Option<&str>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvpoll"));
    cmd.args(args);
    if let Some(dir) = library_path {
        cmd.env("LD_LIBRARY_PATH", dir);
    }
    cmd.output().expect("run kvpoll")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn major_minor(v: &str) -> (u32, u32) {
    let mut p = v.trim().split('.').map(|x| x.parse().unwrap_or(0));
    (p.next().unwrap_or(0), p.next().unwrap_or(0))
}

/// The version and library directory of the system's UCX (pkg-config).
fn system_ucx() -> (String, String) {
    let q = |what: &[&str]| {
        let o = Command::new("pkg-config")
            .args(what)
            .arg("ucx")
            .output()
            .expect("pkg-config");
        assert!(o.status.success(), "pkg-config {what:?} ucx: {o:?}");
        String::from_utf8_lossy(&o.stdout).trim().to_owned()
    };
    (q(&["--modversion"]), q(&["--variable=libdir"]))
}

#[test]
fn version_names_the_ucx_loaded_and_the_one_built_against() {
    let o = kvpoll(&["--version"], None);
    assert!(o.status.success(), "{o:?}");
    let line = text(&o);
    let built = ucx_sys::BUILT_VERSION;
    // As built and linked (rpath or system path): the same release.
    assert!(
        line.contains(&format!("UCX {built} (built against {built}, ")),
        "{line}"
    );
    assert!(line.contains(ucx_sys::BUILT_SOURCE), "{line}");
    assert!(!line.contains("INCOMPATIBLE"), "{line}");
}

#[test]
fn an_engine_starts_on_the_system_ucx_only_when_it_is_no_older_than_the_one_built_against() {
    let (system, libdir) = system_ucx();
    let built = ucx_sys::BUILT_VERSION;
    let (s, b) = (major_minor(&system), major_minor(built));
    let compatible = s.0 == b.0 && s.1 >= b.1;

    let version = text(&kvpoll(&["--version"], Some(&libdir)));
    assert!(
        version.contains(&format!("UCX {system} (built against {built}")),
        "{version}"
    );
    assert_eq!(version.contains("INCOMPATIBLE"), !compatible, "{version}");

    let run = kvpoll(
        &["transfer", "--tls", "tcp", "--blocks", "4", "--rounds", "2"],
        Some(&libdir),
    );
    let said = text(&run);
    if compatible {
        assert!(run.status.success(), "{said}");
    } else {
        assert_eq!(run.status.code(), Some(1), "{said}");
        assert!(
            said.contains(&format!(
                "UCX {system} is loaded but kvpoll was built against UCX {built}"
            )),
            "{said}"
        );
    }
}
