//! The control port on a network: `connect` against fake servers (garbage,
//! closing, silent, damaged) exits 1 within its give-up bound saying why,
//! and `serve` refuses over-long frames and fault injection it was not
//! started for, and keeps serving.
//!
//! Time bounds here are guards against a hang, not measurements.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvpoll_cli::control::{FrameReader, Layout, Msg, ReadError, HEADER, MAX_PAYLOAD};

mod procs;

/// `connect`'s and `serve`'s default layout.
const LAYOUT: Layout = Layout {
    block_size: 16384,
    layers: 2,
    blocks: 512,
};

/// Generous guard: a run that ends by giving up after `secs` must be done
/// well within this.
fn guard(secs: u64) -> Duration {
    Duration::from_secs(secs + 60)
}

/// A fake server on loopback: `serve_one` handles each connection.
fn fake_server(serve_one: fn(TcpStream)) -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            std::thread::spawn(move || serve_one(s));
        }
    });
    addr
}

/// Runs `connect` against `addr` (both ranks) and returns its exit code
/// and standard error, killing it if it outlives the guard.
fn connect_to(addr: &str, give_up_after: u64) -> (Option<i32>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvpoll"))
        .args(["connect", "--to", &format!("{addr},{addr}")])
        .args(["--requests", "20", "--give-up-after"])
        .arg(give_up_after.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvpoll connect");
    let mut err = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + guard(give_up_after);
    let code = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st.code();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("connect did not give up within {:?}", guard(give_up_after));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    (code, reader.join().unwrap())
}

/// Reads the client's hello (so the fake looks like it listens).
fn read_hello(s: &TcpStream) {
    let mut r = FrameReader::new(s, Duration::from_secs(5), Some(Duration::from_secs(5)));
    let _ = r.read_msg();
}

fn assert_gave_up(code: Option<i32>, err: &str, reason: &str) {
    assert_eq!(code, Some(1), "{err}");
    let last = err.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("kvpoll: ") && last.contains("gave up") && last.contains(reason),
        "last line should give the reason {reason:?}: {err}"
    );
    // Each failed attempt was logged with its typed error.
    assert!(
        err.lines()
            .any(|l| l.contains("WARN") && l.contains("failed") && l.contains(reason)),
        "{err}"
    );
}

#[test]
fn connect_to_a_server_sending_garbage_exits_1_naming_the_bad_magic() {
    let addr = fake_server(|mut s| {
        let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\nnot kvpoll at all");
    });
    let (code, err) = connect_to(&addr, 2);
    assert_gave_up(code, &err, "bad magic");
}

#[test]
fn connect_to_a_server_that_closes_at_once_exits_1_naming_the_close() {
    let addr = fake_server(drop);
    let (code, err) = connect_to(&addr, 2);
    assert_gave_up(code, &err, "closed");
}

#[test]
fn connect_to_a_silent_server_exits_1_naming_the_timeout() {
    let addr = fake_server(|s| {
        std::thread::sleep(Duration::from_secs(120));
        drop(s);
    });
    let (code, err) = connect_to(&addr, 2);
    assert_gave_up(code, &err, "timeout");
}

#[test]
fn connect_to_a_server_with_a_damaged_checksum_exits_1_naming_it() {
    let addr = fake_server(|mut s| {
        read_hello(&s);
        let mut f = Msg::Hello(LAYOUT).encode().unwrap();
        let last = f.len() - 1;
        f[last] ^= 1;
        let _ = s.write_all(&f);
    });
    let (code, err) = connect_to(&addr, 2);
    assert_gave_up(code, &err, "checksum mismatch");
}

#[test]
fn connect_to_a_server_with_truncated_metadata_exits_1_naming_it() {
    let addr = fake_server(|mut s| {
        read_hello(&s);
        let _ = s.write_all(&Msg::Hello(LAYOUT).encode().unwrap());
        let _ = s.write_all(&Msg::Meta(b"KVPL\x03\x01".to_vec()).encode().unwrap());
    });
    let (code, err) = connect_to(&addr, 2);
    assert_gave_up(code, &err, "frame truncated: 6 bytes, need 20");
}

#[test]
fn connect_to_a_server_of_another_layout_exits_1_at_once_naming_both() {
    let addr = fake_server(|mut s| {
        read_hello(&s);
        let theirs = Layout {
            layers: 3,
            ..LAYOUT
        };
        let _ = s.write_all(&Msg::Hello(theirs).encode().unwrap());
    });
    let (code, err) = connect_to(&addr, 30);
    assert_gave_up(code, &err, "layout mismatch");
    assert!(
        err.contains("3 layers") && err.contains("2 layers"),
        "{err}"
    );
}

/// A `kvpoll serve` child and its address.
struct Server {
    child: Child,
    addr: String,
}

impl Server {
    fn start(extra: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvpoll"))
            .args(["serve", "--listen", "127.0.0.1:0", "--until-stdin-closes"])
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn kvpoll serve");
        let addr = procs::listen_addr(&mut child);
        Server { child, addr }
    }

    /// A connection past the handshake, and a reader of its replies.
    fn client(&self) -> (TcpStream, FrameReader<TcpStream>) {
        let mut s = TcpStream::connect(&self.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let mut r = FrameReader::new(
            s.try_clone().unwrap(),
            Duration::from_secs(10),
            Some(Duration::from_secs(30)),
        );
        s.write_all(&Msg::Hello(LAYOUT).encode().unwrap()).unwrap();
        assert_eq!(r.read_msg().unwrap(), Msg::Hello(LAYOUT));
        assert!(matches!(r.read_msg().unwrap(), Msg::Meta(_)));
        (s, r)
    }

    /// Peak resident memory (VmHWM), in bytes.
    fn peak_rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
        line.split_whitespace()
            .nth(1)
            .unwrap()
            .parse::<u64>()
            .unwrap()
            * 1024
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn stall_sent_to_a_server_not_started_for_testing_is_refused_and_it_keeps_serving() {
    let server = Server::start(&[]);
    let (mut s, mut r) = server.client();
    s.write_all(&Msg::Stall { ms: 3_600_000 }.encode().unwrap())
        .unwrap();
    match r.read_msg().unwrap() {
        Msg::Refused(why) => assert!(why.contains("--testing"), "{why}"),
        other => panic!("STALL was not refused: {other:?}"),
    }
    // The same connection and a new one are both still served.
    s.write_all(&Msg::Stats.encode().unwrap()).unwrap();
    assert!(matches!(r.read_msg().unwrap(), Msg::StatsReply { .. }));
    let (mut s2, mut r2) = server.client();
    s2.write_all(&Msg::Stats.encode().unwrap()).unwrap();
    assert!(matches!(r2.read_msg().unwrap(), Msg::StatsReply { .. }));
}

#[test]
fn stall_sent_to_a_server_started_for_testing_is_taken() {
    let server = Server::start(&["--testing"]);
    let (mut s, mut r) = server.client();
    s.write_all(&Msg::Stall { ms: 10 }.encode().unwrap())
        .unwrap();
    s.write_all(&Msg::Stats.encode().unwrap()).unwrap();
    // No refusal comes before the stats reply.
    assert!(matches!(r.read_msg().unwrap(), Msg::StatsReply { .. }));
}

#[test]
fn an_over_long_control_frame_is_refused_after_its_header_without_growing_memory() {
    let server = Server::start(&[]);
    let (mut s, mut r) = server.client();
    // A header announcing 1 GiB, and nothing of the payload yet: the refusal
    // comes from the header alone.
    let claimed: u64 = 1 << 30;
    let mut header = Msg::Stats.encode().unwrap();
    header.truncate(HEADER);
    header[8..12].copy_from_slice(&(claimed as u32).to_le_bytes());
    s.write_all(&header).unwrap();
    match r.read_msg().unwrap() {
        Msg::Refused(why) => assert!(why.contains(&MAX_PAYLOAD.to_string()), "{why}"),
        other => panic!("an over-long frame was not refused: {other:?}"),
    }
    assert!(matches!(
        r.read_msg(),
        Err(ReadError::Closed | ReadError::Io(_))
    ));
    // Streaming the announced payload goes nowhere: the connection is shut,
    // so the writes fail long before 256 MiB have gone.
    let chunk = vec![b'A'; 1 << 20];
    let mut sent: u64 = 0;
    while sent < 256 << 20 {
        if s.write_all(&chunk).is_err() {
            break;
        }
        sent += chunk.len() as u64;
    }
    assert!(
        sent < 256 << 20,
        "the server took {sent} bytes after refusing"
    );
    let peak = server.peak_rss();
    assert!(
        peak < claimed / 4,
        "serve's peak RSS {peak} bytes is not well below the {claimed} bytes announced"
    );
    // And it still serves others.
    let (mut s2, mut r2) = server.client();
    s2.write_all(&Msg::Stats.encode().unwrap()).unwrap();
    assert!(matches!(r2.read_msg().unwrap(), Msg::StatsReply { .. }));
}

#[test]
fn a_text_line_without_newline_is_refused_as_foreign_without_being_buffered() {
    let server = Server::start(&[]);
    let mut s = TcpStream::connect(&server.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut r = FrameReader::new(
        s.try_clone().unwrap(),
        Duration::from_secs(10),
        Some(Duration::from_secs(30)),
    );
    s.write_all(b"STALL 3600000 and no newline ").unwrap();
    match r.read_msg().unwrap() {
        Msg::Refused(why) => assert!(why.contains("bad magic"), "{why}"),
        other => panic!("a text line was not refused: {other:?}"),
    }
}
