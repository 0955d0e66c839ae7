//! `serve` and `connect` with a key (`--auth-key-file`, `KVPOLL_AUTH_KEY`):
//! a client with the same key is served (control frames tagged, engines
//! keyed); a client without a key, or with another, is refused at its
//! HELLO with a reason that names the key, and never gets the server's
//! metadata.
//!
//! Time bounds here are guards against a hang, not measurements.

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use kvpoll::auth::AuthKey;
use kvpoll_cli::control::{check_header, frame_len, FrameReader, Layout, Msg, Session, HEADER};

mod procs;

const LAYOUT: Layout = Layout {
    block_size: 16384,
    layers: 2,
    blocks: 512,
};
const SECRET: &str = "the deployment's shared secret";

fn key_file(dir: &tempfile::TempDir, name: &str, secret: &str) -> String {
    let path = dir.path().join(name);
    std::fs::write(&path, format!("{secret}\n")).unwrap();
    path.display().to_string()
}

/// Prefill ranks 0 and 1, started with `extra` flags.
fn two_serves(extra: &[&str]) -> [procs::Serve; 2] {
    ["0", "1"].map(|rank| {
        let mut args = vec!["--rank", rank];
        args.extend_from_slice(extra);
        procs::Serve::start(&args)
    })
}

/// Runs `connect` against `addrs` with `extra` flags and `env`; its exit
/// code and standard error.
fn connect(addrs: [&str; 2], extra: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvpoll"));
    cmd.args(["connect", "--to", &addrs.join(",")])
        .args(["--requests", "20", "--give-up-after", "3"])
        .args(extra)
        .env_remove("KVPOLL_AUTH_KEY")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("spawn kvpoll connect");
    let mut err = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let st = procs::wait_exit(&mut child, Duration::from_secs(90), "connect");
    (st.code(), reader.join().unwrap())
}

#[test]
fn a_client_with_the_key_is_served_from_a_file_or_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    let file = key_file(&dir, "key", SECRET);
    let [a, b] = two_serves(&["--auth-key-file", &file]);
    let addrs = [a.addr.as_str(), b.addr.as_str()];
    let (code, err) = connect(addrs, &["--auth-key-file", &file], &[]);
    assert_eq!(code, Some(0), "{err}");
    let (code, err) = connect(addrs, &["--mode", "push"], &[("KVPOLL_AUTH_KEY", SECRET)]);
    assert_eq!(code, Some(0), "{err}");
}

#[test]
fn a_client_without_the_key_or_with_another_is_refused_at_hello() {
    let dir = tempfile::tempdir().unwrap();
    let file = key_file(&dir, "key", SECRET);
    let other = key_file(&dir, "other", "another deployment's secret");
    let serve = procs::Serve::start(&["--auth-key-file", &file]);
    let addrs = [serve.addr.as_str(), serve.addr.as_str()];
    let (code, err) = connect(addrs, &[], &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("no key"), "the reason names the key: {err}");
    let (code, err) = connect(addrs, &["--auth-key-file", &other], &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("another key"), "{err}");

    // What an unkeyed client reads: one untagged refusal, no metadata.
    let (_s, mut r) = procs::hello(&serve.addr, LAYOUT);
    match r.read_msg() {
        Ok(Msg::Refused(why)) => assert!(why.contains("no key"), "{why}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(
        r.read_msg().is_err(),
        "the server sent more than its refusal"
    );
    // Each refusal is counted where an operator asks: three clients at
    // least were refused for their key, and no other refusal came.
    let key = AuthKey::from_secret(SECRET.as_bytes()).unwrap();
    match keyed_stats(&serve.addr, &key) {
        Msg::StatsReply {
            refused_clients,
            unauthenticated_clients,
            ..
        } => {
            assert!(unauthenticated_clients >= 3, "{unauthenticated_clients}");
            assert_eq!(refused_clients, unauthenticated_clients);
        }
        other => panic!("expected STATS' reply, got {other:?}"),
    }
}

/// A keyed client's HELLO, then STATS: the reply.
fn keyed_stats(addr: &str, key: &AuthKey) -> Msg {
    let (mut s, mut r) = procs::client_in(addr, LAYOUT, Session::new(Some(key)));
    procs::send(&mut s, &r, &Msg::Stats);
    r.read_msg().unwrap()
}

/// A keyed client's HELLO replayed on a new connection gets the server's
/// HELLO, but a later frame recorded on the first connection is refused.
#[test]
fn a_recorded_frame_is_refused_on_a_new_connection() {
    let dir = tempfile::tempdir().unwrap();
    let file = key_file(&dir, "key", SECRET);
    let serve = procs::Serve::start(&["--auth-key-file", &file]);
    let key = AuthKey::from_secret(SECRET.as_bytes()).unwrap();
    let first = Session::new(Some(&key));
    let mut s = std::net::TcpStream::connect(&serve.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut r = FrameReader::new(
        s.try_clone().unwrap(),
        Duration::from_secs(10),
        Some(Duration::from_secs(30)),
    )
    .with_session(first.clone());
    let hello = first.encode(&Msg::Hello(LAYOUT)).unwrap();
    s.write_all(&hello).unwrap();
    assert_eq!(r.read_msg().unwrap(), Msg::Hello(LAYOUT));
    assert!(matches!(r.read_msg().unwrap(), Msg::Meta(_)));
    let stats = first.encode(&Msg::Stats).unwrap();
    s.write_all(&stats).unwrap();
    assert!(matches!(r.read_msg().unwrap(), Msg::StatsReply { .. }));

    // The same bytes on a new connection: the HELLO is answered, the
    // STATS refused (it is bound to the first connection's server nonce)
    // and the connection closed. The server's frames there are tagged for
    // the first client's nonce; their messages are read as they are.
    let mut s2 = std::net::TcpStream::connect(&serve.addr).unwrap();
    s2.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s2.write_all(&hello).unwrap();
    s2.write_all(&stats).unwrap();
    let mut all = Vec::new();
    let _ = s2.read_to_end(&mut all);
    let mut said = Vec::new();
    let mut at = 0;
    while at < all.len() {
        let len = check_header(&all[at..]).unwrap();
        said.push(Msg::from_payload(&all[at + HEADER..at + HEADER + len]).unwrap());
        at += frame_len(&all[at..]).unwrap();
    }
    assert!(
        matches!(&said[..], [Msg::Hello(_), Msg::Meta(_), Msg::Refused(why)] if why.contains("another connection")),
        "{said:?}"
    );
}
