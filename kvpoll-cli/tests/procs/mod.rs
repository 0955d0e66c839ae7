//! Shared helpers for the tests that run `kvpoll` processes.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use kvpoll_cli::control::{FrameReader, Layout, Msg, Session};

/// A new connection's side, keyed as the `kvpoll` processes the tests
/// start are: with the secret in `KVPOLL_AUTH_KEY` (which a keyed run of
/// the suites sets), else none.
pub fn session() -> Session {
    let key = kvpoll::auth::AuthKey::from_env().expect("KVPOLL_AUTH_KEY");
    Session::new(key.as_ref())
}

/// A control connection to `addr` that said HELLO with `layout`, and a
/// reader of what comes back (10 s a frame, 30 s of silence at most),
/// keyed as [`session`] says: [`send`] more frames on it.
pub fn hello(addr: &str, layout: Layout) -> (TcpStream, FrameReader<TcpStream>) {
    hello_in(addr, layout, session())
}

/// [`hello`] on a connection whose side is `session` ([`Session::none`]
/// for a server started without a key: [`Serve::start_unkeyed`]).
pub fn hello_in(
    addr: &str,
    layout: Layout,
    session: Session,
) -> (TcpStream, FrameReader<TcpStream>) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let r = FrameReader::new(
        s.try_clone().unwrap(),
        Duration::from_secs(10),
        Some(Duration::from_secs(30)),
    )
    .with_session(session.clone());
    s.write_all(&session.encode(&Msg::Hello(layout)).unwrap())
        .unwrap();
    (s, r)
}

/// Sends `msg` on the connection `r` reads, encoded as its side does.
pub fn send(s: &mut TcpStream, r: &FrameReader<TcpStream>, msg: &Msg) {
    s.write_all(&r.session().encode(msg).unwrap()).unwrap();
}

/// [`hello`], and the server's HELLO and META read: a connection past
/// the handshake.
pub fn client(addr: &str, layout: Layout) -> (TcpStream, FrameReader<TcpStream>) {
    client_in(addr, layout, session())
}

/// [`client`] on a connection whose side is `session`.
pub fn client_in(
    addr: &str,
    layout: Layout,
    session: Session,
) -> (TcpStream, FrameReader<TcpStream>) {
    let (s, mut r) = hello_in(addr, layout, session);
    assert_eq!(r.read_msg().unwrap(), Msg::Hello(layout));
    assert!(matches!(r.read_msg().unwrap(), Msg::Meta(_)));
    (s, r)
}

/// Blocks in the pool and free, as the rank at `addr` answers STATS on a
/// connection past the handshake.
pub fn stats(s: &mut TcpStream, r: &mut FrameReader<TcpStream>) -> (u64, u64) {
    send(s, r, &Msg::Stats);
    match r.read_msg().unwrap() {
        Msg::StatsReply { total, free, .. } => (total, free),
        other => panic!("STATS answered {other:?}"),
    }
}

/// A number field of a JSON line (the first one of that name).
pub fn json_field(json: &str, name: &str) -> u64 {
    let key = format!("\"{name}\":");
    let at = json
        .find(&key)
        .unwrap_or_else(|| panic!("no {name} in {json}"));
    json[at + key.len()..]
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect::<String>()
        .parse()
        .unwrap_or_else(|_| panic!("{name} is not a number in {json}"))
}

/// The address a freshly spawned `kvpoll serve` prints first (`LISTEN
/// addr`); its standard output must be piped.
pub fn listen_addr(child: &mut Child) -> String {
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("serve's stdout is piped"))
        .read_line(&mut line)
        .expect("read serve's first line");
    line.strip_prefix("LISTEN ")
        .unwrap_or_else(|| panic!("serve said {line:?}"))
        .trim()
        .to_owned()
}

/// Stops process `pid` (SIGSTOP) and waits until /proc says every thread of
/// it has: `kill()` returns before, and an operation posted next could
/// still be served.
pub fn stop(pid: u32) {
    // SAFETY: signalling a child process of the test.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGSTOP) }, 0);
    let stat = format!("/proc/{pid}/stat");
    let t = Instant::now();
    while !std::fs::read_to_string(&stat)
        .ok()
        .and_then(|s| {
            s.rsplit(')')
                .next()
                .map(|r| r.trim_start().starts_with('T'))
        })
        .unwrap_or(false)
    {
        assert!(t.elapsed() < Duration::from_secs(30), "{pid} did not stop");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Lets a stopped process `pid` go on (SIGCONT).
pub fn cont(pid: u32) {
    // SAFETY: signalling a child process of the test.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGCONT) }, 0);
}

/// A `kvpoll serve` child on a free loopback port, started with
/// `--until-stdin-closes` and `extra`; dropping it closes its standard
/// input and waits for it to end (20 s, then it is killed).
pub struct Serve {
    pub child: Child,
    pub addr: String,
}

impl Serve {
    /// `kvpoll serve` with `extra` flags, keyed as the environment says
    /// (`KVPOLL_AUTH_KEY`, which a keyed run of the suites sets).
    pub fn start(extra: &[&str]) -> Serve {
        Self::spawn(extra, false)
    }

    /// [`Serve::start`] without a key whatever the environment says: for
    /// a test that plays a control peer itself and speaks the unkeyed wire
    /// ([`hello`], [`client`], [`stats`]; the keyed wire's edges are
    /// `auth.rs`'s).
    pub fn start_unkeyed(extra: &[&str]) -> Serve {
        Self::spawn(extra, true)
    }

    fn spawn(extra: &[&str], unkeyed: bool) -> Serve {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvpoll"));
        if unkeyed {
            cmd.env_remove("KVPOLL_AUTH_KEY");
        }
        let mut child = cmd
            .args(["serve", "--listen", "127.0.0.1:0", "--until-stdin-closes"])
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn kvpoll serve");
        let addr = listen_addr(&mut child);
        Serve { child, addr }
    }
}

impl Drop for Serve {
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

/// SIGKILLs process `pid` (a `kvpoll` child) inside a shared-memory
/// active-message send: stopped by gdb on the instruction after the one
/// that takes a slot of the receiver's FIFO (the `cmpxchg` on its head in
/// `uct_mm_ep_am_short`, `_short_iov` and `_bcopy`), before the send
/// marks the slot written — where a SIGKILL at a random time lands now
/// and then on a loaded machine. Sends whose callers include the
/// engine's probe (`hearing`, `Probe`) are passed over: their receiver is
/// the process itself.
pub fn kill_inside_send(pid: u32) -> Result<(), String> {
    let pid = pid.to_string();
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).map_err(|e| e.to_string())?;
    let uct = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.contains("libuct.so"))
        .ok_or("the process has no libuct.so mapped")?
        .to_owned();
    // Bounded: a process that sent nothing for a minute fails the test.
    let gdb = |args: &[String]| {
        Command::new("timeout")
            .args([
                "60",
                "gdb",
                "-batch",
                "-nx",
                "-ex",
                "set debuginfod enabled off",
            ])
            .args(args)
            .output()
            .map_err(|e| format!("gdb: {e}"))
    };
    let mut breaks = Vec::new();
    for f in [
        "uct_mm_ep_am_short",
        "uct_mm_ep_am_short_iov",
        "uct_mm_ep_am_bcopy",
    ] {
        let out = gdb(&["-ex".into(), format!("disassemble {f}"), uct.clone()])?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let lines: Vec<&str> = text.lines().collect();
        let at = lines
            .iter()
            .position(|l| l.contains("cmpxchg"))
            .and_then(|i| lines.get(i + 1))
            .and_then(|l| l.split('<').nth(1)?.split('>').next())
            .ok_or(format!("no cmpxchg in {f} of {uct}:\n{text}"))?
            .to_owned();
        // Not a send of the process's own deafness probe (to itself):
        // killed there, it deafens nobody but itself. gdb matches each
        // caller's full name from its start (`re.match`), hence `.*`.
        breaks.extend([
            "-ex".to_owned(),
            format!("break *({f}{at}) if !$_any_caller_matches(\".*(hearing|Probe)\", 40)"),
        ]);
    }
    // C: stopped in Rust code, gdb would read the names as Rust ones and
    // find none.
    let mut args = ["-p", &pid, "-ex", "set language c"]
        .map(str::to_owned)
        .to_vec();
    args.extend(breaks);
    args.extend(["-ex", "continue", "-ex", "kill"].map(str::to_owned));
    let out = gdb(&args)?;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !said.contains("hit Breakpoint") {
        return Err(format!("gdb never stopped {pid} in a send:\n{said}"));
    }
    Ok(())
}

/// Whether a debugger (gdb) is attached to process `pid` (`TracerPid` in
/// its /proc status).
pub fn traced(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("TracerPid:"))
            .is_some_and(|v| v.trim() != "0")
    })
}

/// Whether gdb runs here (Debian package `gdb`, a test-only package).
pub fn have_gdb() -> bool {
    Command::new("gdb")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// How `child` exited, waited for as long as `limit` (`None`: it still
/// runs; it is left running).
pub fn wait_within(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let t = Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return Some(st);
        }
        if t.elapsed() >= limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// How `child` exited, waited for as long as `guard`; kills it and panics
/// (naming `what`) if it still runs then.
pub fn wait_exit(child: &mut Child, guard: Duration, what: &str) -> ExitStatus {
    wait_within(child, guard).unwrap_or_else(|| {
        let _ = child.kill();
        let _ = child.wait();
        panic!("{what}: still running after {guard:?}");
    })
}
