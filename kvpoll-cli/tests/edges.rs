//! The edges a network reaches, over real processes: `connect` against a
//! prefill rank that answers wrongly or not at all, `serve`'s lifetime and
//! signals, what goes to which stream, and the ranges of the tool's
//! duration and count flags.
//!
//! Time bounds here are guards against a hang, not measurements.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use kvpoll_cli::control::{FrameReader, Layout, Msg, Session};

mod procs;

/// `serve`'s and `connect`'s default layout.
const LAYOUT: Layout = Layout {
    block_size: 16384,
    layers: 2,
    blocks: 512,
};

fn kvpoll() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvpoll"))
}

use procs::{wait_exit, Serve};

/// Runs `child` to its end within `guard`, collecting both streams.
fn finish(mut child: Child, guard: Duration, what: &str) -> Output {
    let out = child.stdout.take();
    let err = child.stderr.take();
    let o = std::thread::spawn(move || {
        let mut v = Vec::new();
        if let Some(mut out) = out {
            let _ = out.read_to_end(&mut v);
        }
        v
    });
    let e = std::thread::spawn(move || {
        let mut v = Vec::new();
        if let Some(mut err) = err {
            let _ = err.read_to_end(&mut v);
        }
        v
    });
    let status = wait_exit(&mut child, guard, what);
    Output {
        status,
        stdout: o.join().unwrap(),
        stderr: e.join().unwrap(),
    }
}

use procs::json_field as field;

/// A control proxy in front of `upstream` that forwards everything but
/// passes each `READY` from the server through `lie` (`None`: dropped).
fn lying_proxy(upstream: String, lie: fn(Msg) -> Option<Msg>) -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for client in l.incoming().flatten() {
            let server = TcpStream::connect(&upstream).unwrap();
            let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
            // Client to server, frame by frame.
            std::thread::spawn(move || pump(c2, s2, Some));
            std::thread::spawn(move || {
                pump(server, client, move |m| match m {
                    m @ Msg::Ready { .. } => lie(m),
                    m => Some(m),
                })
            });
        }
    });
    addr
}

fn pump(from: TcpStream, mut to: TcpStream, pass: impl Fn(Msg) -> Option<Msg>) {
    let mut frames = FrameReader::new(from, Duration::from_secs(600), None);
    while let Ok(m) = frames.read_msg() {
        if let Some(m) = pass(m) {
            if to.write_all(&m.encode().unwrap()).is_err() {
                return;
            }
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Both);
}

/// `connect` (pull, 20 requests, JSON) to a real rank and a proxied one;
/// all three without a key whatever the environment says (the proxy
/// speaks the unkeyed wire).
fn connect_through(lie: fn(Msg) -> Option<Msg>, extra: &[&str]) -> (Output, Serve, Serve) {
    let (a, b) = (
        Serve::start_unkeyed(&["--rank", "0"]),
        Serve::start_unkeyed(&["--rank", "1"]),
    );
    let proxy = lying_proxy(b.addr.clone(), lie);
    let child = kvpoll()
        .env_remove("KVPOLL_AUTH_KEY")
        .args(["connect", "--to", &format!("{},{proxy}", a.addr)])
        .args(["--requests", "20", "--json"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = finish(child, Duration::from_secs(60), "connect");
    (out, a, b)
}

fn one_block_short(m: Msg) -> Option<Msg> {
    match m {
        Msg::Ready {
            req,
            lease_ms,
            lend,
            mut blocks,
        } => {
            blocks.pop();
            Some(Msg::Ready {
                req,
                lease_ms,
                lend,
                blocks,
            })
        }
        m => Some(m),
    }
}

fn no_blocks(m: Msg) -> Option<Msg> {
    match m {
        Msg::Ready {
            req,
            lease_ms,
            lend,
            ..
        } => Some(Msg::Ready {
            req,
            lease_ms,
            lend,
            blocks: Vec::new(),
        }),
        m => Some(m),
    }
}

/// Checks that every request failed for `reason`, nothing leaked, and
/// `connect` said why and exited 1.
fn assert_all_failed(out: &Output, reason: &str) {
    let json = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{json}\n{err}");
    assert_eq!(field(&json, "failed"), 20, "{json}");
    assert_eq!(field(&json, "finished"), 0, "{json}");
    assert_eq!(field(&json, "leaked_blocks"), 0, "{json}");
    assert!(json.contains(reason), "the reason {reason:?}: {json}");
    assert!(
        err.contains(reason),
        "the reason {reason:?} on stderr: {err}"
    );
}

/// Blocks free on a rank (its STATS, asked on a connection whose side
/// `session` makes), once they all came back or 10 s passed.
fn free_blocks(addr: &str, session: fn() -> Session) -> (u64, u64) {
    let t = Instant::now();
    loop {
        let (mut s, mut r) = procs::client_in(addr, LAYOUT, session());
        let (total, free) = procs::stats(&mut s, &mut r);
        if free == total || t.elapsed() > Duration::from_secs(10) {
            return (free, total);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_ready_naming_too_few_blocks_fails_its_request_at_once_and_connect_exits_1() {
    let (out, a, b) = connect_through(one_block_short, &[]);
    assert_all_failed(&out, "READY with 3 blocks");
    // The honest rank's lends were given back at once, not at their lease.
    let (free, total) = free_blocks(&a.addr, Session::none);
    assert_eq!(free, total);
    drop(b);
}

#[test]
fn a_ready_naming_no_blocks_fails_its_request_at_once() {
    let (out, _a, _b) = connect_through(no_blocks, &[]);
    assert_all_failed(&out, "READY with 0 blocks");
}

#[test]
fn a_prepare_that_gets_no_answer_fails_within_the_answer_timeout() {
    let (out, _a, _b) = connect_through(|_| None, &["--answer-timeout-ms", "500"]);
    assert_all_failed(&out, "no answer");
}

#[test]
fn allow_failures_relaxes_the_exit_status_but_not_the_accounting() {
    let (out, _a, _b) = connect_through(no_blocks, &["--allow-failures"]);
    let json = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{json}");
    assert_eq!(field(&json, "failed"), 20, "{json}");
}

#[test]
fn connect_json_is_alone_on_stdout_even_with_ucx_logging_on() {
    let (a, b) = (
        Serve::start(&["--rank", "0"]),
        Serve::start(&["--rank", "1"]),
    );
    let child = kvpoll()
        .args(["connect", "--to", &format!("{},{}", a.addr, b.addr)])
        .args(["--requests", "20", "--json"])
        .env("UCX_LOG_LEVEL", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = finish(child, Duration::from_secs(60), "connect");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 1, "stdout holds more than the JSON: {text}");
    assert!(
        lines[0].starts_with('{') && lines[0].ends_with('}'),
        "{text}"
    );
    // UCX did log, to standard error.
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("UCX"),
        "no UCX log line on stderr"
    );
}

#[test]
fn serve_with_stdin_at_end_of_file_serves_until_a_signal() {
    let mut child = kvpoll()
        .args(["serve", "--listen", "127.0.0.1:0"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let addr = procs::listen_addr(&mut child);
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        child.try_wait().unwrap().is_none(),
        "serve exited with its standard input at end of file"
    );
    let (free, total) = free_blocks(&addr, procs::session);
    assert_eq!(free, total);
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let st = wait_exit(&mut child, Duration::from_secs(20), "serve after SIGTERM");
    assert_eq!(st.code(), Some(0), "{st}");
}

#[test]
fn sighup_sigint_and_sigterm_each_end_serve_cleanly() {
    for sig in [libc::SIGHUP, libc::SIGINT, libc::SIGTERM] {
        let mut child = kvpoll()
            .args(["serve", "--listen", "127.0.0.1:0"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let _addr = procs::listen_addr(&mut child);
        // SAFETY: signalling our own child.
        unsafe { libc::kill(child.id() as libc::pid_t, sig) };
        let out = finish(child, Duration::from_secs(20), "serve after a signal");
        assert_eq!(out.status.code(), Some(0), "signal {sig}: {out:?}");
    }
}

#[test]
fn serve_whose_metrics_port_is_taken_says_no_listen_and_exits_1() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().to_string();
    let out = kvpoll()
        .args(["serve", "--listen", "127.0.0.1:0", "--metrics", &port])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("LISTEN"),
        "LISTEN printed for a server that did not serve: {out:?}"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("--metrics"));
}

#[test]
fn sigterm_ends_connect_at_once_with_its_summary() {
    let (a, b) = (
        Serve::start(&["--rank", "0"]),
        Serve::start(&["--rank", "1"]),
    );
    let child = kvpoll()
        .args(["connect", "--to", &format!("{},{}", a.addr, b.addr)])
        .args(["--requests", "100000000", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let out = finish(child, Duration::from_secs(20), "connect after SIGTERM");
    let json = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(128 + libc::SIGTERM), "{out:?}");
    assert_eq!(field(&json, "corrupted_blocks"), 0, "{json}");
    assert_eq!(field(&json, "leaked_blocks"), 0, "{json}");
}

/// The process ids of `pid`'s children.
fn children(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
    {
        let Ok(task) = task else { continue };
        let path = task.path().join("children");
        for c in std::fs::read_to_string(path)
            .unwrap_or_default()
            .split_whitespace()
        {
            out.extend(c.parse::<u32>().ok());
        }
    }
    out
}

#[test]
fn sigterm_ends_the_demo_and_its_prefill_processes() {
    let child = kvpoll()
        .args([
            "demo",
            "--requests",
            "100000000",
            "--no-faults",
            "--raw-requests",
            "0",
        ])
        .args(["--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let t = Instant::now();
    let ranks = loop {
        let c = children(pid);
        if c.len() >= 4 || t.elapsed() > Duration::from_secs(30) {
            break c;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(ranks.len(), 4, "the demo's prefill processes");
    std::thread::sleep(Duration::from_millis(1500));
    // SAFETY: signalling our own child.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
    let out = finish(child, Duration::from_secs(30), "demo after SIGTERM");
    assert_eq!(out.status.code(), Some(128 + libc::SIGTERM), "{out:?}");
    for r in ranks {
        assert!(
            !std::path::Path::new(&format!("/proc/{r}")).exists()
                || std::fs::read_to_string(format!("/proc/{r}/stat"))
                    .is_ok_and(|s| s.contains(") Z")),
            "prefill process {r} outlived the demo"
        );
    }
}

#[test]
fn out_of_range_durations_and_counts_are_refused_with_exit_2() {
    for (args, needle) in [
        (&["demo", "--pause-ms", "99999999999"][..], "--pause-ms"),
        (&["demo", "--stall-ms", "99999999"][..], "--stall-ms"),
        (&["demo", "--stall-every-ms", "0"][..], "--stall-every-ms"),
        (&["demo", "--soak", "99999999999"][..], "--soak"),
        (&["demo", "--sample-secs", "99999999"][..], "--sample-secs"),
        (&["demo", "--requests", "99999999999999"][..], "--requests"),
        (&["demo", "--window", "100000"][..], "--window"),
        (
            &["demo", "--raw-requests", "99999999"][..],
            "--raw-requests",
        ),
        (
            &["connect", "--to", "a,b", "--answer-timeout-ms", "1"][..],
            "--answer-timeout-ms",
        ),
        (
            &["serve", "--max-connections", "0"][..],
            "--max-connections",
        ),
        (&["transfer", "--rounds", "99999999999"][..], "--rounds"),
    ] {
        let out = kvpoll().args(args).stdin(Stdio::null()).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

/// Runs `kvpoll topo --check path` with its address space capped at 1 GiB
/// (a reader that does not stop cannot take the machine with it).
fn topo_check(path: &str) -> Output {
    use std::os::unix::process::CommandExt;
    let mut cmd = kvpoll();
    cmd.args(["topo", "--check", path]);
    // SAFETY: setrlimit is async-signal-safe; it runs in the child before exec.
    unsafe {
        cmd.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: 1 << 30,
                rlim_max: 1 << 30,
            };
            libc::setrlimit(libc::RLIMIT_AS, &lim);
            Ok(())
        });
    }
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    finish(child, Duration::from_secs(60), "topo --check")
}

#[test]
fn a_core_map_over_the_size_cap_is_refused_without_reading_it_all() {
    let out = topo_check("/dev/zero");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("larger than"), "{err}");
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("big.toml");
    let line = "# a comment that makes the map large\n".repeat(250_000);
    std::fs::write(&big, line).unwrap();
    let out = topo_check(big.to_str().unwrap());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("larger than"), "{err}");
}

/// A prefill rank's engine thread takes the control messages and gives
/// back the blocks of the writes that ended. Pushes that keep arriving
/// while it fills the blocks of the last one must not keep it from giving
/// blocks back: a destination that refills its window as each push lands
/// (as `connect` does) never finds the rank's pool short. Here the
/// destination is an engine in this process that checks nothing, so it
/// refills at once and the rank always has a push waiting.
#[test]
fn pushes_that_keep_arriving_do_not_keep_serve_from_giving_blocks_back() {
    use kvpoll::{BlockId, ContextOptions, Engine, Outcomes, RequestId};
    const WINDOW: u64 = 16;
    const PUSHES: u64 = 400;
    // 1 MiB to fill a push: the rank's engine thread is the slow side.
    let layout = Layout {
        block_size: 65536,
        layers: 2,
        blocks: 256,
    };
    let per_push = 8u32;
    let serve = Serve::start(&[
        "--rank",
        "0",
        "--tls",
        "tcp",
        "--block-size",
        "65536",
        "--layers",
        "2",
        "--blocks",
        "256",
    ]);
    let mut dest = Engine::builder()
        .block_size(layout.block_size)
        .ucx(ContextOptions::with_transports("tcp"))
        .build()
        .unwrap();
    for _ in 0..layout.layers {
        dest.register(u64::from(layout.blocks)).unwrap();
    }
    let (mut s, mut r) = procs::hello(&serve.addr, layout);
    assert_eq!(r.read_msg().unwrap(), Msg::Hello(layout));
    let Msg::Meta(meta) = r.read_msg().unwrap() else {
        panic!("serve sent no META");
    };
    let writer = dest.add_peer(&meta).unwrap();
    let ours = dest.local_metadata().unwrap();
    procs::send(&mut s, &r, &Msg::Meta(ours));
    let session = r.session().clone();
    // The rank's answers, as they come.
    let (tx, answers) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        while let Ok(m) = r.read_msg() {
            if tx.send(m).is_err() {
                return;
            }
        }
    });
    let (mut issued, mut finished, mut failed) = (0u64, 0u64, 0u64);
    let mut refused = Vec::new();
    let mut out = Outcomes::default();
    let t = Instant::now();
    while finished + failed < PUSHES {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "{finished} finished, {failed} failed, {issued} pushed in 120 s"
        );
        // Each request takes its own blocks: a window's requests never share
        // one.
        while issued < PUSHES && issued - finished - failed < WINDOW {
            let first =
                (issued % (u64::from(layout.blocks) / u64::from(per_push))) as u32 * per_push;
            let blocks: Vec<BlockId> = (first..first + per_push).map(BlockId).collect();
            let lend = dest
                .receive_from(
                    RequestId(issued),
                    &blocks,
                    &[writer],
                    Duration::from_secs(30),
                )
                .unwrap();
            let push = Msg::Push {
                req: issued,
                lend: lend.0,
                blocks: blocks.iter().map(|b| b.0).collect(),
            };
            s.write_all(&session.encode(&push).unwrap()).unwrap();
            issued += 1;
        }
        while let Ok(m) = answers.try_recv() {
            if let Msg::Pushed { req, done: false } = m {
                refused.push(req);
                let _ = dest.abort(RequestId(req));
            }
        }
        out.clear();
        dest.wait(&mut out, Duration::from_millis(1));
        finished += out.finished_recving.len() as u64;
        failed += out.failed_recving.len() as u64;
    }
    assert!(
        refused.is_empty() && failed == 0,
        "{} of {PUSHES} pushes not done (the first: request {:?}), {failed} failed",
        refused.len(),
        refused.first()
    );
    dest.shutdown();
}
