//! A prefill rank's control port: one thread, non-blocking sockets and
//! `poll(2)`, apart from the thread that drives the engine.
//!
//! Everything that needs no engine is answered here — the handshake, STATS
//! (from the snapshot the engine thread publishes), refusals — so the port
//! keeps answering while the engine thread waits on a stalled poller (an
//! `add_peer` waits for the poller's answer). What needs the engine (META,
//! PREPARE, PUSH, STALL, a closed connection's peer) goes to the engine
//! thread over a bounded channel; its replies come back over a channel and
//! an eventfd that wakes the poll.
//!
//! Bounds: at most [`Limits::max_conns`] connections past their handshake
//! (one more is told so and closed); at most [`PENDING_CAP`] still in it
//! (the oldest is closed for a newcomer, so a flood of silent connections
//! cannot keep a real client out); a handshake must end within
//! [`HANDSHAKE_TIMEOUT`], a started frame within [`link::FRAME_TIMEOUT`], a
//! connection may stay silent for [`IDLE_TIMEOUT`], and one whose peer does
//! not read its replies is closed once [`OUT_CAP`] bytes wait or a write
//! waited [`link::WRITE_TIMEOUT`]. A frame before the handshake may carry
//! at most [`HELLO_MAX`] bytes. One file descriptor per connection; no
//! thread per connection.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvpoll::auth::AuthKey;
use kvpoll_cli::control::{check_header, frame_len, FrameError, Session, HEADER, MAX_PAYLOAD};

use super::link;
use super::proto::{Layout, Msg};

/// Connections still in their handshake, at most.
pub const PENDING_CAP: usize = 64;
/// How long a connection may take to say a matching HELLO.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a connection past its handshake may stay silent.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Replies waiting for a client that does not read them, at most.
pub const OUT_CAP: usize = 1 << 20;
/// The largest payload taken before the handshake (a HELLO is 17 bytes).
pub const HELLO_MAX: usize = 64;
/// Messages waiting for the engine thread, at most; past it a PREPARE is
/// answered BUSY at once.
pub const TO_ENGINE_CAP: usize = 4096;

/// The port's limits.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Connections past their handshake, at most.
    pub max_conns: usize,
}

/// What the port hands the engine thread.
pub enum ToEngine {
    /// A message of connection `tag` that needs the engine.
    Msg(usize, Msg),
    /// Connection `tag` (past its handshake) is gone.
    Closed(usize),
}

/// Block accounting and poller time, as the engine thread last published.
#[derive(Debug, Default, Clone, Copy)]
pub struct Stats {
    pub total: u64,
    pub free: u64,
    pub busy: u64,
    pub idle: u64,
    pub transfer_errors: u64,
    pub release_failures: u64,
}

/// The engine thread's end of the port.
pub struct EngineSide {
    pub rx: Receiver<ToEngine>,
    replies: std::sync::mpsc::Sender<(usize, Msg)>,
    /// New engine metadata (the engine was rebuilt): handed to every
    /// handshake from then on.
    renewals: std::sync::mpsc::Sender<Vec<u8>>,
    wake: Arc<OwnedFd>,
    pub stats: Arc<Mutex<Stats>>,
    done: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl EngineSide {
    /// Sends `msg` to connection `tag` (dropped if it is gone).
    pub fn reply(&self, tag: usize, msg: Msg) {
        if self.replies.send((tag, msg)).is_ok() {
            wake(&self.wake);
        }
    }

    /// The engine was rebuilt with metadata `meta`: new connections get
    /// it, and every connection past its handshake is told why and closed,
    /// so that its client connects again and learns it.
    pub fn renew(&self, meta: Vec<u8>) {
        if self.renewals.send(meta).is_ok() {
            wake(&self.wake);
        }
    }

    /// Publishes the figures STATS answers with.
    pub fn publish(&self, s: Stats) {
        *self.stats.lock().unwrap_or_else(|p| p.into_inner()) = s;
    }
}

impl Drop for EngineSide {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Release);
        wake(&self.wake);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn wake(fd: &OwnedFd) {
    let one = 1u64.to_ne_bytes();
    // SAFETY: writing 8 bytes to an eventfd we own.
    unsafe { libc::write(fd.as_raw_fd(), one.as_ptr().cast(), 8) };
}

fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: eventfd returns a new descriptor or -1.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Starts the port's thread on `listener`.
pub fn start(
    listener: TcpListener,
    ours: Layout,
    meta: Vec<u8>,
    auth: Option<AuthKey>,
    testing: bool,
    limits: Limits,
    rank: u32,
) -> io::Result<EngineSide> {
    listener.set_nonblocking(true)?;
    let wake = Arc::new(eventfd()?);
    let (to_engine, rx) = std::sync::mpsc::sync_channel(TO_ENGINE_CAP);
    let (replies, from_engine) = std::sync::mpsc::channel();
    let (renewals, renewed) = std::sync::mpsc::channel();
    let stats = Arc::new(Mutex::new(Stats::default()));
    let done = Arc::new(AtomicBool::new(false));
    let mut door = Door {
        listener,
        ours,
        meta: checked(meta)?,
        auth,
        testing,
        limits,
        rank,
        conns: HashMap::new(),
        next_tag: 0,
        to_engine,
        from_engine,
        renewed,
        wake: wake.clone(),
        stats: stats.clone(),
        spare: std::fs::File::open("/dev/null").ok(),
        refused: 0,
        unauthenticated: 0,
    };
    let flag = done.clone();
    let thread = std::thread::Builder::new()
        .name("kvpoll-control".into())
        .spawn(move || door.run(&flag))?;
    Ok(EngineSide {
        rx,
        replies,
        renewals,
        wake,
        stats,
        done,
        thread: Some(thread),
    })
}

/// Engine metadata that fits a META frame.
fn checked(meta: Vec<u8>) -> io::Result<Vec<u8>> {
    Msg::Meta(meta.clone())
        .encode()
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    Ok(meta)
}

struct Conn {
    stream: TcpStream,
    /// This side of the connection's framing (tagged with a key).
    session: Session,
    /// Past the handshake.
    greeted: bool,
    /// Sent its engine metadata (PREPARE and PUSH need it first).
    meta: bool,
    input: Vec<u8>,
    out: Vec<u8>,
    opened: Instant,
    last_heard: Instant,
    frame_started: Option<Instant>,
    /// Since when a reply waits in `out`.
    out_since: Option<Instant>,
}

struct Door {
    listener: TcpListener,
    ours: Layout,
    /// Our engine's metadata, sent on every handshake.
    meta: Vec<u8>,
    /// The deployment's key: every connection's frames are tagged with it.
    auth: Option<AuthKey>,
    testing: bool,
    limits: Limits,
    rank: u32,
    conns: HashMap<usize, Conn>,
    next_tag: usize,
    to_engine: SyncSender<ToEngine>,
    from_engine: Receiver<(usize, Msg)>,
    renewed: Receiver<Vec<u8>>,
    wake: Arc<OwnedFd>,
    stats: Arc<Mutex<Stats>>,
    /// Given up to accept (and refuse) one connection when out of fds.
    spare: Option<std::fs::File>,
    /// Clients refused (and closed) since the rank started, and of those
    /// the ones refused for their key: what STATS reports.
    refused: u64,
    unauthenticated: u64,
}

impl Door {
    fn run(&mut self, done: &AtomicBool) {
        let mut fds: Vec<libc::pollfd> = Vec::new();
        let mut tags: Vec<usize> = Vec::new();
        let mut last_sweep = Instant::now();
        while !done.load(Ordering::Acquire) {
            fds.clear();
            tags.clear();
            let pfd = |fd, events| libc::pollfd {
                fd,
                events,
                revents: 0,
            };
            fds.push(pfd(self.listener.as_raw_fd(), libc::POLLIN));
            fds.push(pfd(self.wake.as_raw_fd(), libc::POLLIN));
            for (&tag, c) in &self.conns {
                let mut ev = libc::POLLIN;
                if !c.out.is_empty() {
                    ev |= libc::POLLOUT;
                }
                fds.push(pfd(c.stream.as_raw_fd(), ev));
                tags.push(tag);
            }
            // SAFETY: fds is a valid array of fds.len() pollfds.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 100) };
            if n > 0 {
                if fds[1].revents != 0 {
                    let mut b = [0u8; 8];
                    // SAFETY: reading 8 bytes from our eventfd.
                    unsafe { libc::read(self.wake.as_raw_fd(), b.as_mut_ptr().cast(), 8) };
                }
                for (i, &tag) in tags.iter().enumerate() {
                    let re = fds[i + 2].revents;
                    if re & libc::POLLOUT != 0 {
                        self.flush(tag);
                    }
                    if re & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 {
                        self.read(tag);
                    }
                }
                if fds[0].revents != 0 {
                    self.accept();
                }
            }
            while let Ok((tag, msg)) = self.from_engine.try_recv() {
                self.send(tag, &msg);
            }
            while let Ok(meta) = self.renewed.try_recv() {
                self.renew(meta);
            }
            if last_sweep.elapsed() >= Duration::from_millis(50) {
                self.sweep();
                last_sweep = Instant::now();
            }
        }
    }

    fn accept(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => self.admit(stream),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) => {
                    // Out of descriptors: free the spare one to take the
                    // newcomer and tell it so, rather than leave it (and
                    // every connection behind it) in the backlog.
                    tracing::warn!(rank = self.rank, "control port: out of file descriptors");
                    self.spare = None;
                    if let Ok((mut s, _)) = self.listener.accept() {
                        let _ = s.set_nonblocking(true);
                        let _ = link::send(
                            &mut s,
                            &Session::none(),
                            &Msg::Refused("server out of file descriptors".into()),
                        );
                    }
                    self.spare = std::fs::File::open("/dev/null").ok();
                    return;
                }
                Err(e) => {
                    tracing::warn!(rank = self.rank, "control port: accept: {e}");
                    return;
                }
            }
        }
    }

    fn admit(&mut self, stream: TcpStream) {
        if stream.set_nonblocking(true).is_err() {
            return;
        }
        let _ = stream.set_nodelay(true);
        let pending = self.conns.values().filter(|c| !c.greeted).count();
        if pending >= PENDING_CAP {
            // The oldest silent newcomer makes room: a real client's HELLO
            // follows its connect at once, a flood's never does.
            if let Some((&old, _)) = self
                .conns
                .iter()
                .filter(|(_, c)| !c.greeted)
                .min_by_key(|(_, c)| c.opened)
            {
                self.close(old, None);
            }
        }
        let now = Instant::now();
        self.next_tag += 1;
        self.conns.insert(
            self.next_tag,
            Conn {
                stream,
                session: Session::new(self.auth.as_ref()),
                greeted: false,
                meta: false,
                input: Vec::new(),
                out: Vec::new(),
                opened: now,
                last_heard: now,
                frame_started: None,
                out_since: None,
            },
        );
    }

    /// Reads what connection `tag` sent and handles each whole frame.
    fn read(&mut self, tag: usize) {
        let mut chunk = [0u8; 16384];
        loop {
            let Some(c) = self.conns.get_mut(&tag) else {
                return;
            };
            let limit = if c.greeted { MAX_PAYLOAD } else { HELLO_MAX };
            // Never more than the frame being read needs.
            let want = match c.input.len() {
                n if n < HEADER => HEADER - n,
                n => match frame_len(&c.input[..HEADER]) {
                    Ok(len) => len - n,
                    Err(_) => 0,
                },
            };
            let room = want.clamp(1, chunk.len());
            let got = match c.stream.read(&mut chunk[..room]) {
                Ok(0) => return self.close(tag, None),
                Ok(k) => k,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => return self.close(tag, None),
            };
            let now = Instant::now();
            c.last_heard = now;
            c.frame_started.get_or_insert(now);
            c.input.extend_from_slice(&chunk[..got]);
            if c.input.len() < HEADER {
                continue;
            }
            let len = match check_header(&c.input[..HEADER]) {
                Ok(len) if len <= limit => len,
                Ok(len) => {
                    let why = format!(
                        "a {len}-byte frame before the handshake (HELLO is at most {HELLO_MAX})"
                    );
                    return self.refuse(tag, why);
                }
                Err(e) => return self.refuse(tag, e.to_string()),
            };
            if c.input.len() < frame_len(&c.input[..HEADER]).unwrap_or(HEADER + len) {
                continue;
            }
            let frame = std::mem::take(&mut c.input);
            c.frame_started = None;
            match c.session.decode(&frame) {
                Ok(m) => self.handle(tag, m),
                Err(e) => {
                    if matches!(e, FrameError::Unauthenticated(_)) {
                        self.unauthenticated += 1;
                    }
                    return self.refuse(tag, e.to_string());
                }
            }
        }
    }

    fn handle(&mut self, tag: usize, m: Msg) {
        let greeted = self.conns.values().filter(|c| c.greeted).count();
        let Some((is_greeted, has_meta)) = self.conns.get(&tag).map(|c| (c.greeted, c.meta)) else {
            return;
        };
        if !is_greeted {
            return match m {
                Msg::Hello(theirs) if theirs == self.ours => {
                    if greeted >= self.limits.max_conns {
                        let why = format!(
                            "server full: {} connections (--max-connections)",
                            self.limits.max_conns
                        );
                        return self.refuse(tag, why);
                    }
                    if let Some(c) = self.conns.get_mut(&tag) {
                        c.greeted = true;
                    }
                    self.send(tag, &Msg::Hello(self.ours));
                    self.send(tag, &Msg::Meta(self.meta.clone()));
                }
                Msg::Hello(theirs) => {
                    // Our hello lets the client name the mismatch.
                    self.send(tag, &Msg::Hello(self.ours));
                    let why = format!("layout mismatch: ours is {}, yours is {theirs}", self.ours);
                    self.refuse(tag, why);
                }
                _ => self.refuse(tag, "the handshake (HELLO) must come first".into()),
            };
        }
        match m {
            Msg::Stats => {
                let s = *self.stats.lock().unwrap_or_else(|p| p.into_inner());
                self.send(
                    tag,
                    &Msg::StatsReply {
                        total: s.total,
                        free: s.free,
                        busy: s.busy,
                        idle: s.idle,
                        transfer_errors: s.transfer_errors,
                        release_failures: s.release_failures,
                        refused_clients: self.refused,
                        unauthenticated_clients: self.unauthenticated,
                    },
                );
            }
            Msg::Stall { .. } if !self.testing => {
                tracing::warn!(
                    rank = self.rank,
                    conn = tag,
                    "STALL refused (not --testing)"
                );
                self.send(
                    tag,
                    &Msg::Refused(
                        "STALL refused: this server was not started with --testing".into(),
                    ),
                );
            }
            Msg::Prepare { req, n: 0 } => self.send(
                tag,
                &Msg::Refused(format!("PREPARE of request {req:#x} for 0 blocks")),
            ),
            Msg::Prepare { req, .. } | Msg::Push { req, .. } if !has_meta => self.send(
                tag,
                &Msg::Refused(format!(
                    "request {req:#x} refused: send this engine's metadata (META) first"
                )),
            ),
            m @ (Msg::Meta(_) | Msg::Prepare { .. } | Msg::Push { .. } | Msg::Stall { .. }) => {
                if matches!(m, Msg::Meta(_)) {
                    if let Some(c) = self.conns.get_mut(&tag) {
                        c.meta = true;
                    }
                }
                match self.to_engine.try_send(ToEngine::Msg(tag, m)) {
                    Ok(()) => {}
                    Err(TrySendError::Full(ToEngine::Msg(_, m))) => {
                        let busy = match m {
                            Msg::Prepare { req, .. } => Msg::Busy { req },
                            Msg::Push { req, .. } => Msg::Pushed { req, done: false },
                            _ => Msg::Refused("server busy: try again".into()),
                        };
                        self.send(tag, &busy);
                    }
                    Err(_) => {}
                }
            }
            // Messages a prefill rank does not take are ignored.
            Msg::Hello(_)
            | Msg::Ready { .. }
            | Msg::Busy { .. }
            | Msg::Pushed { .. }
            | Msg::StatsReply { .. }
            | Msg::Refused(_) => {}
        }
    }

    /// Queues `msg` for connection `tag` and writes what the socket takes.
    fn send(&mut self, tag: usize, msg: &Msg) {
        let Some(c) = self.conns.get(&tag) else {
            return;
        };
        if let Ok(f) = c.session.encode(msg) {
            self.queue(tag, &f);
        }
    }

    fn queue(&mut self, tag: usize, bytes: &[u8]) {
        let Some(c) = self.conns.get_mut(&tag) else {
            return;
        };
        if c.out.len() + bytes.len() > OUT_CAP {
            tracing::warn!(
                rank = self.rank,
                conn = tag,
                "control link closed: it reads no replies"
            );
            return self.close(tag, None);
        }
        c.out.extend_from_slice(bytes);
        c.out_since.get_or_insert_with(Instant::now);
        self.flush(tag);
    }

    fn flush(&mut self, tag: usize) {
        let Some(c) = self.conns.get_mut(&tag) else {
            return;
        };
        while !c.out.is_empty() {
            match c.stream.write(&c.out) {
                Ok(0) => return self.close(tag, None),
                Ok(k) => {
                    c.out.drain(..k);
                    c.out_since = Some(Instant::now());
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return self.close(tag, None),
            }
        }
        c.out_since = None;
    }

    /// Tells connection `tag` why it is refused, then closes it.
    fn refuse(&mut self, tag: usize, why: String) {
        if self.conns.contains_key(&tag) {
            self.refused += 1;
        }
        tracing::warn!(rank = self.rank, conn = tag, "control link refused: {why}");
        self.close(tag, Some(why));
    }

    /// Closes connection `tag`, after a last word if there is one (written
    /// as far as the socket takes it at once).
    fn close(&mut self, tag: usize, why: Option<String>) {
        if let Some(why) = why {
            if let Some(c) = self.conns.get_mut(&tag) {
                // Tagged once the client proved it holds the key; before
                // that, plain, so a client without it can read why.
                let session = if c.session.heard() {
                    c.session.clone()
                } else {
                    Session::none()
                };
                if let Ok(f) = session.encode(&Msg::Refused(why)) {
                    c.out.extend_from_slice(&f);
                }
                let _ = c.stream.write(&c.out);
            }
        }
        if let Some(c) = self.conns.remove(&tag) {
            let _ = c.stream.shutdown(std::net::Shutdown::Both);
            if c.greeted {
                // The engine thread forgets its peer. Blocking here is
                // bounded: the engine thread drains this channel.
                let _ = self.to_engine.send(ToEngine::Closed(tag));
            }
        }
    }

    /// New engine metadata: handshakes from now on carry it, and every
    /// connection past its handshake (whose client holds the old one) is
    /// told and closed.
    fn renew(&mut self, meta: Vec<u8>) {
        match checked(meta) {
            Ok(m) => self.meta = m,
            Err(e) => {
                tracing::warn!(rank = self.rank, "new engine metadata not sent: {e}");
                return;
            }
        }
        let greeted: Vec<usize> = self
            .conns
            .iter()
            .filter(|(_, c)| c.greeted)
            .map(|(&tag, _)| tag)
            .collect();
        for tag in greeted {
            let why = "the engine was rebuilt (its UCX worker stopped hearing): \
                       connect again for its new metadata";
            self.close(tag, Some(why.into()));
        }
    }

    /// Closes connections past their handshake, frame, idle or write bound.
    fn sweep(&mut self) {
        let now = Instant::now();
        let late: Vec<(usize, String)> = self
            .conns
            .iter()
            .filter_map(|(&tag, c)| {
                let why = if !c.greeted && now - c.opened >= HANDSHAKE_TIMEOUT {
                    format!("no handshake within {HANDSHAKE_TIMEOUT:?}")
                } else if c
                    .frame_started
                    .is_some_and(|t| now - t >= link::FRAME_TIMEOUT)
                {
                    format!(
                        "frame not complete after {:?} (read timeout)",
                        link::FRAME_TIMEOUT
                    )
                } else if now - c.last_heard >= IDLE_TIMEOUT {
                    format!("no message for {IDLE_TIMEOUT:?} (idle timeout)")
                } else if c.out_since.is_some_and(|t| now - t >= link::WRITE_TIMEOUT) {
                    format!("a reply waited {:?} to be read", link::WRITE_TIMEOUT)
                } else {
                    return None;
                };
                Some((tag, why))
            })
            .collect();
        for (tag, why) in late {
            self.refuse(tag, why);
        }
    }
}
