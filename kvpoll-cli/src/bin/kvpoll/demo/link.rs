//! A TCP connection carrying control frames: a reader thread turns incoming
//! frames into events on a channel; writes go straight to the socket. A
//! client opens a link with [`handshake`], which checks that the other end
//! speaks kvpoll with the same layout before anything else is exchanged.

use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::mpsc::Sender;
use std::time::{Duration, Instant};

use kvpoll::auth::AuthKey;
use kvpoll_cli::control::{self, FrameReader, ReadError, Session};

use super::proto::{Layout, Msg};

/// How often a blocked read wakes to check its timeouts.
const TICK: Duration = Duration::from_millis(200);
/// How long a started frame may take to arrive in full.
pub const FRAME_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a write may block (a peer that stopped reading).
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a client waits for the connection and the server's handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(3);

/// What a reader thread reports.
pub enum Incoming {
    Line(usize, Msg),
    /// The link sent bytes that are not a valid frame, timed out, or
    /// failed: why. Nothing more is read from it.
    Bad(usize, String),
    Closed(usize),
}

/// Starts a reader for `stream`, tagging what it reads with `tag`; `idle`
/// bounds how long the link may stay silent. With `wake`, each message
/// sent on also wakes that engine's thread out of `Engine::wait`.
pub fn spawn_reader(
    stream: &TcpStream,
    session: &Session,
    tag: usize,
    tx: Sender<Incoming>,
    idle: Option<Duration>,
    wake: Option<super::side::Waker>,
) -> std::io::Result<()> {
    let reader = stream.try_clone()?;
    reader.set_read_timeout(Some(TICK))?;
    let session = session.clone();
    std::thread::spawn(move || {
        let mut frames = FrameReader::new(reader, FRAME_TIMEOUT, idle).with_session(session);
        loop {
            let ev = match frames.read_msg() {
                Ok(m) => Incoming::Line(tag, m),
                Err(ReadError::Closed) => Incoming::Closed(tag),
                Err(e) => Incoming::Bad(tag, e.to_string()),
            };
            let last = !matches!(ev, Incoming::Line(..));
            if tx.send(ev).is_err() {
                return;
            }
            if let Some(w) = &wake {
                w.wake();
            }
            if last {
                return;
            }
        }
    });
    Ok(())
}

/// Sends one message; a failed write means the link is gone.
pub fn send(stream: &mut TcpStream, session: &Session, msg: &Msg) -> bool {
    control::send_in(stream, session, msg).is_ok()
}

/// Why a client could not open a link to a server.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("cannot resolve {0}")]
    Resolve(String),
    #[error("connect: {0}")]
    Connect(std::io::Error),
    #[error("handshake: {0}")]
    Read(#[from] ReadError),
    #[error("handshake: write failed (connection closed by peer?): {0}")]
    Write(std::io::Error),
    #[error("refused by the server: {0}")]
    Refused(String),
    #[error("layout mismatch: ours is {ours}, the server's is {theirs}")]
    Layout { ours: Layout, theirs: Layout },
    #[error("handshake: unexpected message {0}")]
    Unexpected(&'static str),
}

impl LinkError {
    /// Whether trying again cannot help (the server disagrees with us).
    pub fn is_permanent(&self) -> bool {
        matches!(self, LinkError::Layout { .. } | LinkError::Resolve(_))
    }
}

fn msg_name(m: &Msg) -> &'static str {
    match m {
        Msg::Hello(_) => "HELLO",
        Msg::Meta(_) => "META",
        Msg::Prepare { .. } => "PREPARE",
        Msg::Ready { .. } => "READY",
        Msg::Busy { .. } => "BUSY",
        Msg::Push { .. } => "PUSH",
        Msg::Pushed { .. } => "PUSHED",
        Msg::Stall { .. } => "STALL",
        Msg::Stats => "STATS",
        Msg::StatsReply { .. } => "STATSREPLY",
        Msg::Refused(_) => "REFUSED",
    }
}

/// An open, checked link: the stream and the server's engine metadata.
pub struct Opened {
    pub stream: TcpStream,
    pub meta: Vec<u8>,
    /// The connection's framing: what every later frame on it is sent
    /// and read with.
    pub session: Session,
}

/// Connects to `addr`, says hello with `ours`, and reads the server's hello
/// and metadata, all within [`HANDSHAKE_TIMEOUT`].
pub fn handshake(addr: &str, ours: Layout, key: Option<&AuthKey>) -> Result<Opened, LinkError> {
    let sa: SocketAddr = addr
        .to_socket_addrs()
        .map_err(|_| LinkError::Resolve(addr.to_owned()))?
        .next()
        .ok_or_else(|| LinkError::Resolve(addr.to_owned()))?;
    let t0 = Instant::now();
    let mut stream =
        TcpStream::connect_timeout(&sa, HANDSHAKE_TIMEOUT).map_err(LinkError::Connect)?;
    let _ = stream.set_nodelay(true);
    stream
        .set_write_timeout(Some(WRITE_TIMEOUT))
        .map_err(LinkError::Connect)?;
    stream
        .set_read_timeout(Some(TICK))
        .map_err(LinkError::Connect)?;
    let session = Session::new(key);
    control::send_in(&mut stream, &session, &Msg::Hello(ours)).map_err(LinkError::Write)?;
    let left = HANDSHAKE_TIMEOUT.saturating_sub(t0.elapsed());
    let reader = stream.try_clone().map_err(LinkError::Connect)?;
    let mut frames = FrameReader::new(reader, left, Some(left)).with_session(session.clone());
    match frames.read_msg()? {
        Msg::Hello(theirs) if theirs == ours => {}
        Msg::Hello(theirs) => return Err(LinkError::Layout { ours, theirs }),
        Msg::Refused(why) => return Err(LinkError::Refused(why)),
        other => return Err(LinkError::Unexpected(msg_name(&other))),
    }
    match frames.read_msg()? {
        Msg::Meta(meta) => Ok(Opened {
            stream,
            meta,
            session,
        }),
        Msg::Refused(why) => Err(LinkError::Refused(why)),
        other => Err(LinkError::Unexpected(msg_name(&other))),
    }
}
