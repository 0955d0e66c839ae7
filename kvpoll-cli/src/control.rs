//! The control protocol between `kvpoll serve` (a prefill rank) and its
//! clients (`kvpoll connect`, the demo's decode ranks and coordinator).
//!
//! Every message travels in a frame, shaped like the data plane's
//! [`kvpoll::wire`] frames: a magic, a version, a bounded length and a
//! checksum, so that bytes from something that is not a kvpoll peer, or
//! damaged bytes, are refused with a typed error before anything is acted on.
//!
//! ```text
//! offset  size  field
//! 0       4     magic "KVPC"
//! 4       1     version
//! 5       1     flags: bit 0, the frame is tagged (others zero)
//! 6       2     reserved, zero
//! 8       4     payload length, little endian, at most MAX_PAYLOAD
//! 12      n     payload: a message tag, then its fields (little endian)
//!               tagged frames only (AUTH bytes):
//! 12+n    16    the sender's nonce for this connection
//! 28+n    8     the sender's frame number on it (0, 1, 2, …)
//! 36+n    32    tag: keyed BLAKE3 (kvpoll::auth, control frames) of the
//!               receiver's nonce as the sender knew it (zeros before it
//!               heard from the receiver: only a frame numbered 0 may say
//!               so), bytes 0..12+n, the sender's nonce and number
//! end     8     FNV-1a 64 of every byte before it, little endian
//! ```
//!
//! With a key (`--auth-key-file`, `KVPOLL_AUTH_KEY`) both sides tag every
//! frame ([`Session`]) and refuse a frame that is untagged, tagged with
//! another key, numbered out of turn, or bound to another connection's
//! nonce: a client without the key is refused at its HELLO, and a frame
//! recorded on one connection is refused on any other and on its own
//! again. Without a key nothing is tagged, and a tagged frame is refused.
//!
//! The length is checked as soon as the header is in: an over-long frame is
//! refused before a byte of its payload is read, so a peer cannot make the
//! reader buffer more than [`MAX_PAYLOAD`] bytes.
//!
//! A connection starts with a handshake: the client sends [`Msg::Hello`]
//! with the layout it expects; the server answers with its own `Hello` and
//! its engine metadata ([`Msg::Meta`]), or with [`Msg::Refused`] and closes.
//! Without a key the port trusts whoever can reach it: bind it to a
//! private address. Nothing is encrypted either way.

use std::io::{self, Read, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use kvpoll::auth::{AuthKey, Purpose, TAG_LEN};

use thiserror::Error;

const MAGIC: [u8; 4] = *b"KVPC";
/// Bytes before the payload.
pub const HEADER: usize = 12;
/// Bytes after the payload (the checksum).
pub const TRAILER: usize = 8;
/// The protocol version this build speaks.
pub const VERSION: u8 = 5;
/// Bytes a tagged frame carries between its payload and its checksum.
pub const AUTH: usize = 16 + 8 + TAG_LEN;
const TAGGED: u8 = 1;
/// Largest payload a control frame may carry: engine metadata of the
/// largest layout the tool accepts fits with room to spare.
pub const MAX_PAYLOAD: usize = 256 * 1024;
/// Most blocks one message may name.
pub const MAX_BLOCKS: usize = 4096;
/// Longest text (a refusal's reason) a message may carry.
pub const MAX_TEXT: usize = 1024;

/// The block layout both sides of a connection must agree on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Bytes per block.
    pub block_size: u64,
    /// KV layers (registered regions).
    pub layers: u32,
    /// Blocks per layer.
    pub blocks: u32,
}

impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} layers x {} blocks x {} bytes",
            self.layers, self.blocks, self.block_size
        )
    }
}

/// One control message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Msg {
    /// Both directions, first on a connection: "I speak kvpoll control
    /// version [`VERSION`] with this layout".
    Hello(Layout),
    /// Engine metadata (both directions, right after the handshake).
    Meta(Vec<u8>),
    /// Decode → prefill: fill `n` blocks for request `req` and lend them.
    Prepare {
        /// The request.
        req: u64,
        /// Blocks wanted.
        n: u32,
    },
    /// Prefill → decode: the blocks to read.
    Ready {
        /// The request.
        req: u64,
        /// What was left of the lend's lease when this was sent, in ms: the
        /// reader counts it down and does not read once it may have run out.
        lease_ms: u32,
        /// The lend's incarnation (what `Engine::lend` returned): the read
        /// names it.
        lend: u64,
        /// The lent blocks.
        blocks: Vec<u32>,
    },
    /// Prefill → decode: no free blocks now; the request is not served.
    Busy {
        /// The request.
        req: u64,
    },
    /// Decode → prefill: write request `req` into these (lent) blocks.
    Push {
        /// The request.
        req: u64,
        /// The receive's incarnation: the write names it.
        lend: u64,
        /// The destination blocks.
        blocks: Vec<u32>,
    },
    /// Prefill → decode: the push was done (acknowledged) or not.
    Pushed {
        /// The request.
        req: u64,
        /// Whether it was done.
        done: bool,
    },
    /// Coordinator → prefill: stop progressing for `ms` (fault injection;
    /// refused unless the server was started with `--testing`).
    Stall {
        /// How long, in milliseconds.
        ms: u64,
    },
    /// Coordinator → prefill: report block accounting.
    Stats,
    /// Prefill → coordinator: blocks in the pool, free, and poller time.
    StatsReply {
        /// Blocks in the pool.
        total: u64,
        /// Blocks free.
        free: u64,
        /// The poller's busy time since the rank started, ns.
        busy: u64,
        /// The poller's idle time since the rank started, ns.
        idle: u64,
        /// Handles that failed with a transfer error, since the rank
        /// started (injected faults among them).
        transfer_errors: u64,
        /// Handle releases that failed, since the rank started.
        release_failures: u64,
        /// Control clients this rank refused (and closed), since it
        /// started: at the handshake, for a bad frame, or when full.
        refused_clients: u64,
        /// Of those, clients refused for their key: none, another, or a
        /// frame recorded on another connection.
        unauthenticated_clients: u64,
    },
    /// Either direction: the last message (or the connection) was refused,
    /// and why.
    Refused(String),
}

/// Why bytes were refused as a control frame or message.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum FrameError {
    /// The bytes do not start with the control magic.
    #[error("not a kvpoll control frame (bad magic)")]
    BadMagic,
    /// A version this build does not speak.
    #[error("control protocol version {got}, this build speaks version {VERSION}")]
    WrongVersion {
        /// The version byte found.
        got: u8,
    },
    /// The length is over [`MAX_PAYLOAD`] (refused before reading it).
    #[error("control frame of {len} bytes exceeds the {MAX_PAYLOAD}-byte limit")]
    TooLong {
        /// The length claimed.
        len: usize,
    },
    /// Fewer bytes than the frame needs.
    #[error("control frame truncated: {got} bytes, need {need}")]
    Truncated {
        /// Bytes given.
        got: usize,
        /// Bytes needed.
        need: usize,
    },
    /// More bytes than the length says.
    #[error("control frame has {0} trailing bytes")]
    TrailingBytes(usize),
    /// The frame is not authenticated for this connection (what it says
    /// is for an operator: a missing key, another key, a replay).
    #[error("control frame refused: {0}")]
    Unauthenticated(&'static str),
    /// The checksum does not match: damaged bytes.
    #[error("control frame checksum mismatch")]
    BadChecksum,
    /// A well-framed payload that is no message.
    #[error("control message: {0}")]
    Message(&'static str),
}

/// Why reading a frame from a stream failed.
#[derive(Debug, Error)]
pub enum ReadError {
    /// The peer closed the connection between frames.
    #[error("connection closed by peer")]
    Closed,
    /// The peer closed the connection inside a frame.
    #[error("connection closed inside a frame ({got} of {need} bytes)")]
    ClosedInFrame {
        /// Bytes of the frame read.
        got: usize,
        /// Bytes it needs.
        need: usize,
    },
    /// The peer reset the connection (it closed with our bytes unread).
    #[error("connection closed by peer (reset)")]
    Reset,
    /// Nothing arrived for the idle limit.
    #[error("no message for {0:?} (idle timeout)")]
    Idle(Duration),
    /// A frame started but did not complete in time.
    #[error("frame not complete after {0:?} (read timeout)")]
    Slow(Duration),
    /// Bad bytes.
    #[error("{0}")]
    Frame(#[from] FrameError),
    /// The socket failed.
    #[error("{0}")]
    Io(#[from] io::Error),
}

struct Out(Vec<u8>);

impl Out {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, b: &[u8]) {
        self.u32(b.len() as u32);
        self.0.extend_from_slice(b);
    }
    fn blocks(&mut self, b: &[u32]) {
        self.u32(b.len() as u32);
        for &x in b {
            self.u32(x);
        }
    }
}

struct In<'a>(&'a [u8]);

impl<'a> In<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], FrameError> {
        if self.0.len() < n {
            return Err(FrameError::Message("truncated"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, FrameError> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, FrameError> {
        let mut w = [0u8; 4];
        w.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(w))
    }
    fn u64(&mut self) -> Result<u64, FrameError> {
        let mut w = [0u8; 8];
        w.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(w))
    }
    fn bytes(&mut self, max: usize) -> Result<&'a [u8], FrameError> {
        let n = self.u32()? as usize;
        if n > max {
            return Err(FrameError::Message("byte string over its limit"));
        }
        self.take(n)
    }
    fn blocks(&mut self) -> Result<Vec<u32>, FrameError> {
        let n = self.u32()? as usize;
        if n > MAX_BLOCKS {
            return Err(FrameError::Message("more blocks than MAX_BLOCKS"));
        }
        // Checked against what is left before allocating.
        if self.0.len() < n * 4 {
            return Err(FrameError::Message("truncated"));
        }
        (0..n).map(|_| self.u32()).collect()
    }
}

impl Msg {
    /// The message's payload (tag and fields), without the frame.
    pub fn payload(&self) -> Vec<u8> {
        let mut o = Out(Vec::new());
        match self {
            Msg::Hello(l) => {
                o.u8(1);
                o.u64(l.block_size);
                o.u32(l.layers);
                o.u32(l.blocks);
            }
            Msg::Meta(m) => {
                o.u8(2);
                o.bytes(m);
            }
            Msg::Prepare { req, n } => {
                o.u8(3);
                o.u64(*req);
                o.u32(*n);
            }
            Msg::Ready {
                req,
                lease_ms,
                lend,
                blocks,
            } => {
                o.u8(4);
                o.u64(*req);
                o.u32(*lease_ms);
                o.u64(*lend);
                o.blocks(blocks);
            }
            Msg::Busy { req } => {
                o.u8(5);
                o.u64(*req);
            }
            Msg::Push { req, lend, blocks } => {
                o.u8(6);
                o.u64(*req);
                o.u64(*lend);
                o.blocks(blocks);
            }
            Msg::Pushed { req, done } => {
                o.u8(7);
                o.u64(*req);
                o.u8(u8::from(*done));
            }
            Msg::Stall { ms } => {
                o.u8(8);
                o.u64(*ms);
            }
            Msg::Stats => o.u8(9),
            Msg::StatsReply {
                total,
                free,
                busy,
                idle,
                transfer_errors,
                release_failures,
                refused_clients,
                unauthenticated_clients,
            } => {
                o.u8(10);
                for v in [
                    total,
                    free,
                    busy,
                    idle,
                    transfer_errors,
                    release_failures,
                    refused_clients,
                    unauthenticated_clients,
                ] {
                    o.u64(*v);
                }
            }
            Msg::Refused(why) => {
                o.u8(11);
                let mut end = why.len().min(MAX_TEXT);
                while !why.is_char_boundary(end) {
                    end -= 1;
                }
                o.bytes(&why.as_bytes()[..end]);
            }
        }
        o.0
    }

    /// Parses a payload (what [`Msg::payload`] writes).
    pub fn from_payload(p: &[u8]) -> Result<Msg, FrameError> {
        let mut r = In(p);
        let msg = match r.u8()? {
            1 => Msg::Hello(Layout {
                block_size: r.u64()?,
                layers: r.u32()?,
                blocks: r.u32()?,
            }),
            2 => Msg::Meta(r.bytes(MAX_PAYLOAD)?.to_vec()),
            3 => Msg::Prepare {
                req: r.u64()?,
                n: r.u32()?,
            },
            4 => Msg::Ready {
                req: r.u64()?,
                lease_ms: r.u32()?,
                lend: r.u64()?,
                blocks: r.blocks()?,
            },
            5 => Msg::Busy { req: r.u64()? },
            6 => Msg::Push {
                req: r.u64()?,
                lend: r.u64()?,
                blocks: r.blocks()?,
            },
            7 => Msg::Pushed {
                req: r.u64()?,
                done: match r.u8()? {
                    0 => false,
                    1 => true,
                    _ => return Err(FrameError::Message("PUSHED flag not 0 or 1")),
                },
            },
            8 => Msg::Stall { ms: r.u64()? },
            9 => Msg::Stats,
            10 => Msg::StatsReply {
                total: r.u64()?,
                free: r.u64()?,
                busy: r.u64()?,
                idle: r.u64()?,
                transfer_errors: r.u64()?,
                release_failures: r.u64()?,
                refused_clients: r.u64()?,
                unauthenticated_clients: r.u64()?,
            },
            11 => Msg::Refused(String::from_utf8_lossy(r.bytes(MAX_TEXT)?).into_owned()),
            _ => return Err(FrameError::Message("unknown message tag")),
        };
        if !r.0.is_empty() {
            return Err(FrameError::Message("bytes after the message"));
        }
        Ok(msg)
    }

    /// The message in an untagged frame, ready to send (a connection
    /// without a key; [`Session::encode`] otherwise).
    ///
    /// A payload over [`MAX_PAYLOAD`] (metadata of an oversized layout) is
    /// an error, never a frame the peer would refuse.
    pub fn encode(&self) -> Result<Vec<u8>, FrameError> {
        Session::none().encode(self)
    }

    /// Checks one whole untagged frame and parses its message (a tagged
    /// one is refused: [`Session::decode`] checks those).
    pub fn decode(frame: &[u8]) -> Result<Msg, FrameError> {
        Session::none().decode(frame)
    }
}

/// Checks a frame's header (its first [`HEADER`] bytes) and returns the
/// payload length it announces.
pub fn check_header(h: &[u8]) -> Result<usize, FrameError> {
    header(h).map(|(len, _)| len)
}

/// Checks a frame's header and returns the whole frame's length: header,
/// payload, tag if it is tagged, and checksum.
pub fn frame_len(h: &[u8]) -> Result<usize, FrameError> {
    header(h).map(|(len, tagged)| HEADER + len + if tagged { AUTH } else { 0 } + TRAILER)
}

/// The payload length a header announces, and whether the frame is
/// tagged.
fn header(h: &[u8]) -> Result<(usize, bool), FrameError> {
    if h.len() < HEADER {
        return Err(FrameError::Truncated {
            got: h.len(),
            need: HEADER,
        });
    }
    if h[0..4] != MAGIC {
        return Err(FrameError::BadMagic);
    }
    if h[4] != VERSION {
        return Err(FrameError::WrongVersion { got: h[4] });
    }
    if h[5] & !TAGGED != 0 || h[6..8] != [0, 0] {
        return Err(FrameError::Message("reserved header bytes are not zero"));
    }
    let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]) as usize;
    if len > MAX_PAYLOAD {
        return Err(FrameError::TooLong { len });
    }
    Ok((len, h[5] & TAGGED != 0))
}

fn check_sum(frame: &[u8]) -> Result<(), FrameError> {
    let body = frame.len() - TRAILER;
    let mut sum = [0u8; 8];
    sum.copy_from_slice(&frame[body..]);
    if kvpoll::wire::fnv1a64(&frame[..body]) != u64::from_le_bytes(sum) {
        return Err(FrameError::BadChecksum);
    }
    Ok(())
}

/// One side of one connection: with a key, what tags the frames it sends
/// and checks those it receives (its nonce, the peer's once heard, and
/// both directions' frame numbers); without one, nothing. Clones share
/// the state, so a reader thread and a writer may each hold one.
#[derive(Clone, Default)]
pub struct Session {
    keyed: Option<Arc<Keyed>>,
}

struct Keyed {
    key: AuthKey,
    ours: [u8; 16],
    theirs: OnceLock<[u8; 16]>,
    sent: AtomicU64,
    received: AtomicU64,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.keyed.is_some() {
            "Session(keyed)"
        } else {
            "Session(none)"
        })
    }
}

impl Session {
    /// A connection without a key: frames untagged, tagged ones refused.
    pub fn none() -> Self {
        Session { keyed: None }
    }

    /// A new connection's side: with `key`, a fresh random nonce.
    pub fn new(key: Option<&AuthKey>) -> Self {
        let keyed = key.map(|key| {
            let mut ours = [0u8; 16];
            ours[..8].copy_from_slice(&kvpoll::Incarnation::draw().0.to_le_bytes());
            ours[8..].copy_from_slice(&kvpoll::Incarnation::draw().0.to_le_bytes());
            Arc::new(Keyed {
                key: key.clone(),
                ours,
                theirs: OnceLock::new(),
                sent: AtomicU64::new(0),
                received: AtomicU64::new(0),
            })
        });
        Session { keyed }
    }

    /// Whether frames are tagged.
    pub fn is_keyed(&self) -> bool {
        self.keyed.is_some()
    }

    /// Whether a tagged frame of the peer's checked out (with a key).
    pub fn heard(&self) -> bool {
        self.keyed
            .as_ref()
            .is_some_and(|k| k.received.load(Ordering::Relaxed) > 0)
    }

    /// `msg` in a frame, tagged (and numbered) if this side has a key.
    pub fn encode(&self, msg: &Msg) -> Result<Vec<u8>, FrameError> {
        let p = msg.payload();
        if p.len() > MAX_PAYLOAD {
            return Err(FrameError::TooLong { len: p.len() });
        }
        let mut f = Vec::with_capacity(HEADER + p.len() + AUTH + TRAILER);
        f.extend_from_slice(&MAGIC);
        let flags = if self.keyed.is_some() { TAGGED } else { 0 };
        f.extend_from_slice(&[VERSION, flags, 0, 0]);
        f.extend_from_slice(&(p.len() as u32).to_le_bytes());
        f.extend_from_slice(&p);
        if let Some(k) = &self.keyed {
            // Relaxed: one writer per direction; the number only orders
            // this side's own frames.
            let seq = k.sent.fetch_add(1, Ordering::Relaxed).to_le_bytes();
            let theirs = k.theirs.get().copied().unwrap_or([0; 16]);
            let tag = k.key.tag(Purpose::Control, &[&theirs, &f, &k.ours, &seq]);
            f.extend_from_slice(&k.ours);
            f.extend_from_slice(&seq);
            f.extend_from_slice(&tag);
        }
        let sum = kvpoll::wire::fnv1a64(&f);
        f.extend_from_slice(&sum.to_le_bytes());
        Ok(f)
    }

    /// Checks one whole frame received on this connection (its tag, its
    /// nonce and number, if this side has a key) and parses its message.
    pub fn decode(&self, frame: &[u8]) -> Result<Msg, FrameError> {
        let need = frame_len(frame)?;
        if frame.len() < need {
            return Err(FrameError::Truncated {
                got: frame.len(),
                need,
            });
        }
        if frame.len() > need {
            return Err(FrameError::TrailingBytes(frame.len() - need));
        }
        check_sum(frame)?;
        let (len, tagged) = header(frame)?;
        let body = &frame[..HEADER + len];
        match (&self.keyed, tagged) {
            (None, false) => {}
            (None, true) => {
                return Err(FrameError::Unauthenticated(
                    "the peer tags its frames and this side has no key (--auth-key-file or KVPOLL_AUTH_KEY)",
                ))
            }
            (Some(k), false) => {
                // A refusal before the peer said anything tagged is shown
                // as it is: a peer without the key (or with another)
                // cannot tag it, and it asks for nothing to be done.
                let refusal = Msg::from_payload(&frame[HEADER..HEADER + len]);
                if let (0, Ok(m @ Msg::Refused(_))) = (k.received.load(Ordering::Relaxed), refusal) {
                    return Ok(m);
                }
                return Err(FrameError::Unauthenticated(
                    "the peer has no key: its frame is not tagged (give it --auth-key-file or KVPOLL_AUTH_KEY)",
                ));
            }
            (Some(k), true) => k.check(body, &frame[HEADER + len..need - TRAILER])?,
        }
        Msg::from_payload(&frame[HEADER..HEADER + len])
    }
}

impl Keyed {
    fn check(&self, body: &[u8], auth: &[u8]) -> Result<(), FrameError> {
        let (nonce, rest) = auth.split_at(16);
        let (seq, tag) = rest.split_at(8);
        let n = u64::from_le_bytes(seq.try_into().expect("8 bytes"));
        // Only a sender's first frame may be sent before it heard our
        // nonce; every later one is bound to this connection.
        let ours = [self.ours];
        let first = [[0u8; 16], self.ours];
        let bound: &[[u8; 16]] = if n == 0 { &first } else { &ours };
        let ok = bound.iter().any(|b| {
            self.key
                .verify(Purpose::Control, &[b, body, nonce, seq], tag)
        });
        if !ok {
            return Err(FrameError::Unauthenticated(
                "its tag does not check out: the peer holds another key, or the frame belongs to another connection",
            ));
        }
        let nonce: [u8; 16] = nonce.try_into().expect("16 bytes");
        if *self.theirs.get_or_init(|| nonce) != nonce {
            return Err(FrameError::Unauthenticated(
                "the frame names another connection's nonce",
            ));
        }
        // Relaxed: one reader per direction.
        if self.received.load(Ordering::Relaxed) != n {
            return Err(FrameError::Unauthenticated(
                "the frame is out of turn: replayed, or frames were lost",
            ));
        }
        self.received.store(n + 1, Ordering::Relaxed);
        Ok(())
    }
}

/// Writes one message, untagged; the error says why the link is
/// unusable.
pub fn send(w: &mut impl Write, msg: &Msg) -> io::Result<()> {
    send_in(w, &Session::none(), msg)
}

/// Writes one message as `session` frames it.
pub fn send_in(w: &mut impl Write, session: &Session, msg: &Msg) -> io::Result<()> {
    let f = session
        .encode(msg)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    w.write_all(&f)
}

/// Reads frames from a stream whose read timeout is set to `tick`
/// ([`std::net::TcpStream::set_read_timeout`]): a frame that started must
/// complete within `frame_timeout` from its first byte, however its bytes
/// trickle in (the bound is checked before every read, so it is kept to
/// within one read: a tick, or the time one read takes to return data);
/// with no frame started, `idle` (if any) bounds the wait.
pub struct FrameReader<R> {
    inner: R,
    buf: Vec<u8>,
    /// How long a started frame may take.
    pub frame_timeout: Duration,
    /// How long to wait for a frame to start (`None`: for ever).
    pub idle: Option<Duration>,
    session: Session,
}

impl<R: Read> FrameReader<R> {
    /// A reader over `inner`.
    pub fn new(inner: R, frame_timeout: Duration, idle: Option<Duration>) -> Self {
        FrameReader {
            inner,
            buf: Vec::new(),
            frame_timeout,
            idle,
            session: Session::none(),
        }
    }

    /// Reads exactly `n` more bytes into the buffer. `started` is when the
    /// frame began (`None`: nothing of it read yet).
    fn fill(&mut self, n: usize, started: &mut Option<Instant>) -> Result<(), ReadError> {
        let waiting = Instant::now();
        let want = self.buf.len() + n;
        let mut chunk = [0u8; 4096];
        while self.buf.len() < want {
            // Checked before every read, after data as after a timeout: a
            // peer trickling bytes faster than the tick never times a read
            // out, and must not keep a frame open past its bound.
            if started.is_some_and(|t| t.elapsed() >= self.frame_timeout) {
                return Err(ReadError::Slow(self.frame_timeout));
            }
            let room = (want - self.buf.len()).min(chunk.len());
            match self.inner.read(&mut chunk[..room]) {
                Ok(0) if started.is_none() => return Err(ReadError::Closed),
                Ok(0) => {
                    return Err(ReadError::ClosedInFrame {
                        got: self.buf.len(),
                        need: want,
                    })
                }
                Ok(k) => {
                    started.get_or_insert_with(Instant::now);
                    self.buf.extend_from_slice(&chunk[..k]);
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    if let (None, Some(idle)) = (*started, self.idle) {
                        if waiting.elapsed() >= idle {
                            return Err(ReadError::Idle(idle));
                        }
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionAborted
                    ) =>
                {
                    return Err(ReadError::Reset)
                }
                Err(e) => return Err(ReadError::Io(e)),
            }
        }
        Ok(())
    }

    /// Checks frames as `session` (this connection's side) does: with a
    /// key, every frame must be tagged for this connection, in turn.
    pub fn with_session(mut self, session: Session) -> Self {
        self.session = session;
        self
    }

    /// This connection's side: what the frames sent on it are encoded
    /// with ([`Session::encode`]).
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// The next message. The header is checked before any of the payload is
    /// read: at most [`HEADER`] + [`MAX_PAYLOAD`] + [`AUTH`] + [`TRAILER`]
    /// bytes are ever buffered.
    pub fn read_msg(&mut self) -> Result<Msg, ReadError> {
        self.buf.clear();
        let mut started = None;
        self.fill(HEADER, &mut started)?;
        let len = frame_len(&self.buf)?;
        self.fill(len - HEADER, &mut started)?;
        Ok(self.session.decode(&self.buf)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> Vec<Msg> {
        vec![
            Msg::Hello(Layout {
                block_size: 16384,
                layers: 2,
                blocks: 512,
            }),
            Msg::Meta(vec![1, 2, 255]),
            Msg::Prepare { req: 9, n: 4 },
            Msg::Ready {
                req: 9,
                lease_ms: 2000,
                lend: 0xfeed_f00d,
                blocks: vec![1, 2, 3],
            },
            Msg::Busy { req: 3 },
            Msg::Push {
                req: 9,
                lend: u64::MAX,
                blocks: vec![7],
            },
            Msg::Pushed { req: 9, done: true },
            Msg::Stall { ms: 500 },
            Msg::Stats,
            Msg::StatsReply {
                total: 8,
                free: 8,
                busy: 1,
                idle: 2,
                transfer_errors: 3,
                release_failures: 4,
                refused_clients: 5,
                unauthenticated_clients: 6,
            },
            Msg::Refused("no".into()),
        ]
    }

    #[test]
    fn every_message_round_trips_through_a_frame_and_a_stream() {
        let mut stream = Vec::new();
        for m in all() {
            let f = m.encode().unwrap();
            assert_eq!(Msg::decode(&f), Ok(m.clone()));
            stream.extend_from_slice(&f);
        }
        let mut r = FrameReader::new(&stream[..], Duration::from_secs(1), None);
        for m in all() {
            assert_eq!(r.read_msg().unwrap(), m);
        }
        assert!(matches!(r.read_msg(), Err(ReadError::Closed)));
    }

    #[test]
    fn every_single_byte_flip_is_refused() {
        let f = Msg::Ready {
            req: 1,
            lease_ms: 2000,
            lend: 77,
            blocks: vec![4, 5],
        }
        .encode()
        .unwrap();
        for i in 0..f.len() {
            let mut g = f.clone();
            g[i] ^= 0x20;
            assert!(Msg::decode(&g).is_err(), "flip at {i} accepted");
        }
    }

    #[test]
    fn an_over_long_header_is_refused_before_its_payload_is_read() {
        let mut h = Msg::Stats.encode().unwrap();
        h[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        h.truncate(HEADER);
        // Nothing follows the header: a reader that tried to buffer the
        // payload would report a truncation instead.
        let mut r = FrameReader::new(&h[..], Duration::from_secs(1), None);
        assert!(matches!(
            r.read_msg(),
            Err(ReadError::Frame(FrameError::TooLong { .. }))
        ));
    }

    #[test]
    fn text_lines_and_garbage_are_refused_as_foreign() {
        assert_eq!(Msg::decode(b"STALL 3600000\n"), Err(FrameError::BadMagic));
        let mut r = FrameReader::new(&b"META 00ff\nSTALL 1\n"[..], Duration::from_secs(1), None);
        assert!(matches!(
            r.read_msg(),
            Err(ReadError::Frame(FrameError::BadMagic))
        ));
    }

    /// A stream that hands over one byte per read, `delay` after the last.
    struct Trickle<'a> {
        bytes: &'a [u8],
        delay: Duration,
    }

    impl Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            std::thread::sleep(self.delay);
            let Some((&b, rest)) = self.bytes.split_first() else {
                return Ok(0);
            };
            buf[0] = b;
            self.bytes = rest;
            Ok(1)
        }
    }

    #[test]
    fn a_frame_trickled_a_byte_at_a_time_is_slow_once_its_frame_timeout_passed() {
        // 125 bytes at 20 ms each: 2.5 s for the whole frame, none of its
        // reads waiting long enough to time out.
        let frame = Msg::Meta(vec![7; 100]).encode().unwrap();
        let frame_timeout = Duration::from_millis(200);
        let trickle = Trickle {
            bytes: &frame,
            delay: Duration::from_millis(20),
        };
        let mut r = FrameReader::new(trickle, frame_timeout, None);
        let t = Instant::now();
        let got = r.read_msg();
        let took = t.elapsed();
        assert!(
            matches!(got, Err(ReadError::Slow(d)) if d == frame_timeout),
            "after {took:?}: {got:?}"
        );
        assert!(
            took < frame_timeout + Duration::from_millis(200),
            "Slow only after {took:?}"
        );
    }

    fn key(secret: &[u8]) -> AuthKey {
        AuthKey::from_secret(secret).unwrap()
    }

    /// A client and a server side of one connection, with `a` and `b`.
    fn pair(a: Option<&AuthKey>, b: Option<&AuthKey>) -> (Session, Session) {
        (Session::new(a), Session::new(b))
    }

    fn refused(r: Result<Msg, FrameError>) -> bool {
        matches!(r, Err(FrameError::Unauthenticated(_)))
    }

    #[test]
    fn keyed_sides_exchange_tagged_frames_in_turn() {
        let k = key(b"0123456789abcdef");
        let (client, server) = pair(Some(&k), Some(&k));
        let hello = Msg::Hello(LAYOUT);
        let f = client.encode(&hello).unwrap();
        assert_eq!(f.len(), HEADER + 17 + AUTH + TRAILER);
        assert_eq!(server.decode(&f), Ok(hello.clone()));
        let mut stream = Vec::new();
        for m in all() {
            stream.extend_from_slice(&server.encode(&m).unwrap());
        }
        let mut r = FrameReader::new(&stream[..], Duration::from_secs(1), None)
            .with_session(client.clone());
        for m in all() {
            assert_eq!(r.read_msg().unwrap(), m);
        }
        let stats = client.encode(&Msg::Stats).unwrap();
        assert_eq!(server.decode(&stats), Ok(Msg::Stats));
        assert!(refused(server.decode(&stats)), "the same frame again");
    }

    #[test]
    fn a_side_without_the_key_or_with_another_is_refused_at_hello() {
        let (k, other) = (key(b"0123456789abcdef"), key(b"0123456789abcdeF"));
        let hello = Msg::Hello(LAYOUT);
        let (plain, server) = pair(None, Some(&k));
        assert!(refused(server.decode(&plain.encode(&hello).unwrap())));
        let (forger, server) = pair(Some(&other), Some(&k));
        assert!(refused(server.decode(&forger.encode(&hello).unwrap())));
        let (keyed, plain) = pair(Some(&k), None);
        assert!(refused(plain.decode(&keyed.encode(&hello).unwrap())));
        assert!(refused(Msg::decode(&keyed.encode(&hello).unwrap())));
    }

    /// A recorded session replayed to a new server side: its HELLO (sent
    /// before the client heard anything) is accepted, nothing after it.
    #[test]
    fn frames_recorded_on_one_connection_are_refused_on_another() {
        let k = key(b"0123456789abcdef");
        let (client, server) = pair(Some(&k), Some(&k));
        let hello = client.encode(&Msg::Hello(LAYOUT)).unwrap();
        server.decode(&hello).unwrap();
        client
            .decode(&server.encode(&Msg::Hello(LAYOUT)).unwrap())
            .unwrap();
        let stall = client.encode(&Msg::Stall { ms: 400 }).unwrap();
        assert_eq!(server.decode(&stall), Ok(Msg::Stall { ms: 400 }));
        let fresh = Session::new(Some(&k));
        assert_eq!(fresh.decode(&hello), Ok(Msg::Hello(LAYOUT)));
        assert!(refused(fresh.decode(&stall)), "bound to the first server");
    }

    const LAYOUT: Layout = Layout {
        block_size: 16384,
        layers: 2,
        blocks: 512,
    };

    #[test]
    fn oversized_block_lists_and_unknown_tags_are_refused() {
        let mut p = vec![4u8];
        p.extend_from_slice(&1u64.to_le_bytes());
        p.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(Msg::from_payload(&p).is_err());
        assert!(Msg::from_payload(&[99]).is_err());
        assert!(Msg::from_payload(&[]).is_err());
        assert!(Msg::from_payload(&[7, 0, 0, 0, 0, 0, 0, 0, 0, 2]).is_err());
    }
}
