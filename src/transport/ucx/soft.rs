//! Reads a lender answers with its own messages: how a get travels over
//! tcp where UCX's emulation of it can abort the lender.
//!
//! Over tcp UCX has no remote memory access and emulates a get: the
//! reader sends a request, and the lender's worker answers it from inside
//! UCX (`ucp_get_req_handler`) with a reply that has no error handling.
//! On 1.13 and on 1.22 alike, a reply that fails because the reader died
//! meanwhile is a fatal error: the lender aborts (docs/design.md §4).
//! Where an endpoint's gets would take that path, kvpoll asks instead:
//!
//! - the reader sends a [`Request`] (which region, where, how many bytes,
//!   and the [`Slot`] the answer lands in) as an active message that may be
//!   answered;
//! - the lender checks it against its own regions and, where the request
//!   names a lend the lender's core knows, against that lend's blocks
//!   (the core decides: `TransportEvent::ReadAsked`), and answers with the
//!   bytes, in pieces of at most [`PIECE`] bytes, each an active message
//!   with a [`Piece`] header — sends of its own, which fail like any other
//!   send when the reader is gone;
//! - the reader copies each piece into the slot's destination while the
//!   slot is that read's, and completes the read when every byte arrived.
//!
//! A slot ends exactly once: with its last byte, an answer that says the
//! lender refused, a request that could not be sent, a failure of its
//! endpoint, or the close of its endpoint. A piece for a slot that ended
//! (a late answer, a slot taken again by another read) finds another
//! sequence number and is dropped: nothing lands in memory the read no
//! longer owns. The lender bumps its lend word before it reuses a block,
//! as for one-sided reads, so the reader's confirmation decides whether
//! what it copied was the lend's.

/// The active-message id of read requests (reader → lender).
pub const REQUEST_AM_ID: u16 = 0x6b78;
/// The active-message id of answers' pieces (lender → reader).
pub const PIECE_AM_ID: u16 = 0x6b79;

/// The most bytes one answer's message carries: with its header, one
/// 64 KiB tcp send segment (`kvpoll` sets `UCX_TCP_TX_SEG_SIZE=64K`;
/// with UCX's 8 KiB default it goes in several). UCX sends it in buffer
/// copies of its segments (never zero-copy: see the endpoint's
/// `send_am_with_data`) and hands it to the reader's handler whole.
pub(crate) const PIECE: usize = 64 * 1024 - 256;

/// Sequence numbers of a slot wrap within 30 bits (a request's send token
/// carries one).
pub(crate) const SEQ_MASK: u32 = (1 << 30) - 1;

/// A read request: `len` bytes at `offset` of the lender's region
/// `region`, into the reader's slot `slot` of sequence `seq`, read under
/// lend `lend` (0: memory no lend guards).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Request {
    pub slot: u32,
    pub seq: u32,
    pub region: u32,
    pub offset: u64,
    pub len: u64,
    pub lend: u64,
}

impl Request {
    pub const LEN: usize = 40;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[0..4].copy_from_slice(&self.slot.to_le_bytes());
        b[4..8].copy_from_slice(&self.seq.to_le_bytes());
        b[8..12].copy_from_slice(&self.region.to_le_bytes());
        b[16..24].copy_from_slice(&self.offset.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b[32..40].copy_from_slice(&self.lend.to_le_bytes());
        b
    }

    /// `None` for anything but a request's exact length (outside bytes).
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() != Self::LEN {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap_or([0; 4]));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
        Some(Request {
            slot: u32_at(0),
            seq: u32_at(4),
            region: u32_at(8),
            offset: u64_at(16),
            len: u64_at(24),
            lend: u64_at(32),
        })
    }
}

/// The header of an answer's piece: the bytes that follow land at `offset`
/// of slot `slot`'s destination; `status` non-zero: the lender refused
/// the read (no bytes follow).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Piece {
    pub slot: u32,
    pub seq: u32,
    pub offset: u64,
    pub status: i8,
}

impl Piece {
    pub const LEN: usize = 24;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[0..4].copy_from_slice(&self.slot.to_le_bytes());
        b[4..8].copy_from_slice(&self.seq.to_le_bytes());
        b[8..16].copy_from_slice(&self.offset.to_le_bytes());
        b[16] = self.status as u8;
        b
    }

    /// `None` for anything but a piece header's exact length.
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() != Self::LEN {
            return None;
        }
        Some(Piece {
            slot: u32::from_le_bytes(b[0..4].try_into().ok()?),
            seq: u32::from_le_bytes(b[4..8].try_into().ok()?),
            offset: u64::from_le_bytes(b[8..16].try_into().ok()?),
            status: b[16] as i8,
        })
    }
}

/// One read in flight: where its bytes land, how many came, the token it
/// completes with and the endpoint it was asked on.
#[derive(Debug, Clone, Copy)]
struct Slot {
    seq: u32,
    live: bool,
    dest: *mut u8,
    len: usize,
    got: usize,
    token: u64,
    ep: u64,
}

/// What landing a piece did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Landed {
    /// Copied; the read wants more.
    Partly,
    /// The read ended: complete `token` with `status`.
    Ended { token: u64, status: i8 },
    /// Not this read's (an ended slot, another sequence, bytes outside
    /// the destination): nothing was written.
    Dropped,
}

/// The reader's reads in flight, by slot.
#[derive(Debug, Default)]
pub(crate) struct Slots {
    slots: Vec<Slot>,
    free: Vec<u32>,
}

impl Slots {
    /// Takes a slot for a read of `len` bytes into `dest`, completing with
    /// `token`, asked on endpoint `ep`. Returns (slot, seq).
    pub fn open(&mut self, dest: *mut u8, len: usize, token: u64, ep: u64) -> (u32, u32) {
        let i = match self.free.pop() {
            Some(i) => i,
            None => {
                self.slots.push(Slot {
                    seq: 0,
                    live: false,
                    dest: std::ptr::null_mut(),
                    len: 0,
                    got: 0,
                    token: 0,
                    ep: 0,
                });
                (self.slots.len() - 1) as u32
            }
        };
        let s = &mut self.slots[i as usize];
        s.seq = s.seq.wrapping_add(1) & SEQ_MASK;
        s.live = true;
        s.dest = dest;
        s.len = len;
        s.got = 0;
        s.token = token;
        s.ep = ep;
        (i, s.seq)
    }

    fn end(&mut self, i: u32, status: i8) -> Landed {
        let s = &mut self.slots[i as usize];
        s.live = false;
        s.dest = std::ptr::null_mut();
        self.free.push(i);
        Landed::Ended {
            token: s.token,
            status,
        }
    }

    fn live(&self, slot: u32, seq: u32) -> bool {
        self.slots
            .get(slot as usize)
            .is_some_and(|s| s.live && s.seq == seq)
    }

    /// Lands a piece: copies `data` into the slot's destination if the
    /// piece is the slot's current read's and lies inside it.
    ///
    /// # Safety
    /// Every live slot's destination is writable for its length (the
    /// caller's promise at [`Slots::open`], kept until the slot ends).
    pub unsafe fn land(&mut self, piece: Piece, data: &[u8]) -> Landed {
        if !self.live(piece.slot, piece.seq) {
            return Landed::Dropped;
        }
        if piece.status != 0 {
            return self.end(piece.slot, piece.status);
        }
        let s = &mut self.slots[piece.slot as usize];
        let inside = usize::try_from(piece.offset)
            .ok()
            .and_then(|o| o.checked_add(data.len()).map(|end| (o, end)))
            .filter(|&(_, end)| end <= s.len);
        let Some((off, _)) = inside else {
            return Landed::Dropped;
        };
        // SAFETY: off..off+len lies inside the destination (checked), which
        // the caller promises is writable while the slot lives.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), s.dest.add(off), data.len()) };
        s.got += data.len();
        if s.got >= s.len {
            self.end(piece.slot, 0)
        } else {
            Landed::Partly
        }
    }

    /// Ends the read of (slot, seq) with `status` if it is still in flight
    /// (its request could not be sent).
    pub fn fail(&mut self, slot: u32, seq: u32, status: i8) -> Option<(u64, i8)> {
        if !self.live(slot, seq) {
            return None;
        }
        match self.end(slot, status) {
            Landed::Ended { token, status } => Some((token, status)),
            _ => None,
        }
    }

    /// Ends every read asked on endpoint `ep` with `status`, handing each
    /// token to `ended`.
    pub fn fail_endpoint(&mut self, ep: u64, status: i8, mut ended: impl FnMut(u64, i8)) {
        for i in 0..self.slots.len() {
            if self.slots[i].live && self.slots[i].ep == ep {
                if let Landed::Ended { token, status } = self.end(i as u32, status) {
                    ended(token, status);
                }
            }
        }
    }

    /// Reads in flight.
    #[cfg(test)]
    pub fn in_flight(&self) -> usize {
        self.slots.iter().filter(|s| s.live).count()
    }
}

/// Where a lender's answer to `req` comes from in its regions: `None` if
/// the request names no region or bytes outside it.
pub(crate) fn source(req: &Request, regions: &[(usize, usize)]) -> Option<(usize, usize)> {
    let (base, len) = *regions.get(req.region as usize)?;
    let off = usize::try_from(req.offset).ok()?;
    let n = usize::try_from(req.len).ok()?;
    let end = off.checked_add(n)?;
    (n > 0 && end <= len).then(|| (base + off, n))
}

/// Whether UCX's description of an endpoint ([`super::Endpoint::describe`]) has
/// no lane for remote memory access (no `get[..]` line) and carries its
/// messages over tcp: its gets would be emulated with messages over tcp.
pub(crate) fn gets_ride_tcp_messages(info: &str) -> bool {
    let mut tcp = false;
    for line in info.lines() {
        let l = line.trim_start_matches('#').trim_start();
        if l.starts_with("get[") {
            return false;
        }
        if l.starts_with("lane[") && l.contains(":tcp/") {
            tcp = true;
        }
    }
    tcp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_pieces_survive_their_encoding_and_other_lengths_are_refused() {
        let r = Request {
            slot: 7,
            seq: 9,
            region: 2,
            offset: 1 << 40,
            len: 65536,
            lend: 0x5eed,
        };
        assert_eq!(Request::decode(&r.encode()), Some(r));
        assert_eq!(Request::decode(&r.encode()[..39]), None);
        let p = Piece {
            slot: 3,
            seq: u32::MAX,
            offset: 12345,
            status: -16,
        };
        assert_eq!(Piece::decode(&p.encode()), Some(p));
        assert_eq!(Piece::decode(&[0u8; 25]), None);
    }

    fn piece(slot: u32, seq: u32, offset: u64) -> Piece {
        Piece {
            slot,
            seq,
            offset,
            status: 0,
        }
    }

    #[test]
    fn a_read_ends_once_with_its_last_byte_and_its_bytes_land_where_their_offsets_say() {
        let mut dest = vec![0u8; 10];
        let mut s = Slots::default();
        let (slot, seq) = s.open(dest.as_mut_ptr(), 10, 42, 1);
        // SAFETY: dest outlives every land below.
        unsafe {
            assert_eq!(s.land(piece(slot, seq, 6), &[7, 8, 9, 10]), Landed::Partly);
            assert_eq!(
                s.land(piece(slot, seq, 0), &[1, 2, 3, 4, 5, 6]),
                Landed::Ended {
                    token: 42,
                    status: 0
                }
            );
            // The same piece again: the slot ended.
            assert_eq!(s.land(piece(slot, seq, 0), &[9; 6]), Landed::Dropped);
        }
        assert_eq!(dest, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
        assert_eq!(s.in_flight(), 0);
    }

    #[test]
    fn a_late_piece_for_a_slot_taken_again_and_bytes_outside_the_destination_are_dropped() {
        let mut first = vec![0u8; 8];
        let mut second = vec![0u8; 8];
        let mut s = Slots::default();
        let (slot, old) = s.open(first.as_mut_ptr(), 8, 1, 1);
        let mut ended = Vec::new();
        s.fail_endpoint(1, -25, |t, st| ended.push((t, st)));
        assert_eq!(ended, [(1, -25)]);
        let (again, new) = s.open(second.as_mut_ptr(), 8, 2, 2);
        assert_eq!(again, slot);
        assert_ne!(old, new);
        // SAFETY: both buffers outlive the lands.
        unsafe {
            assert_eq!(s.land(piece(slot, old, 0), &[5; 8]), Landed::Dropped);
            assert_eq!(s.land(piece(slot, new, 4), &[5; 5]), Landed::Dropped);
            assert_eq!(s.land(piece(slot, new, u64::MAX), &[5; 1]), Landed::Dropped);
            assert_eq!(s.land(piece(99, new, 0), &[5; 1]), Landed::Dropped);
        }
        assert_eq!(first, [0; 8]);
        assert_eq!(second, [0; 8]);
        assert_eq!(s.in_flight(), 1);
    }

    #[test]
    fn a_refusal_a_failed_request_and_an_endpoint_failure_each_end_only_their_reads() {
        let mut d = vec![0u8; 4];
        let mut s = Slots::default();
        let a = s.open(d.as_mut_ptr(), 4, 10, 1);
        let b = s.open(d.as_mut_ptr(), 4, 11, 1);
        s.open(d.as_mut_ptr(), 4, 12, 2);
        let refused = Piece {
            status: -3,
            ..piece(a.0, a.1, 0)
        };
        // SAFETY: d outlives the lands.
        unsafe {
            assert_eq!(
                s.land(refused, &[]),
                Landed::Ended {
                    token: 10,
                    status: -3
                }
            );
        }
        assert_eq!(s.fail(b.0, b.1, -6), Some((11, -6)));
        assert_eq!(s.fail(b.0, b.1, -6), None);
        let mut ended = Vec::new();
        s.fail_endpoint(1, -16, |t, st| ended.push((t, st)));
        assert!(ended.is_empty());
        s.fail_endpoint(2, -16, |t, st| ended.push((t, st)));
        assert_eq!(ended, [(12, -16)]);
        assert_eq!(s.in_flight(), 0);
    }

    #[test]
    fn a_lender_serves_only_bytes_inside_the_region_a_request_names() {
        let regions = [(0x1000, 4096), (0x10_0000, 65536)];
        let req = |region, offset, len| Request {
            slot: 0,
            seq: 0,
            region,
            offset,
            len,
            lend: 0,
        };
        assert_eq!(
            source(&req(1, 4096, 8192), &regions),
            Some((0x10_1000, 8192))
        );
        assert_eq!(source(&req(0, 0, 4096), &regions), Some((0x1000, 4096)));
        assert_eq!(source(&req(0, 1, 4096), &regions), None);
        assert_eq!(source(&req(2, 0, 1), &regions), None);
        assert_eq!(source(&req(0, u64::MAX, 2), &regions), None);
        assert_eq!(source(&req(0, 0, 0), &regions), None);
    }

    #[test]
    fn gets_are_soft_where_ucx_carries_an_endpoints_messages_over_tcp_and_has_no_get_lane() {
        // ucp_ep_print_info of UCX 1.13.1 with UCX_TLS=tcp, then with
        // shared memory.
        let tcp = "#\n# UCP endpoint \n#\n#               peer: <no debug data>\n\
            #                 lane[0]:  1:tcp/lo.0 md[0]                -> md[0]/tcp/sysdev[255] am am_bw#0 keepalive wireup\n\
            #\n#                 am_send: 0..<egr/short>..8185..<egr/zcopy>..20553..<rndv>..(inf)\n\
            #\n#                  rma_bw: mds rndv_rkey_size 9\n#\n";
        let shm = "#                 lane[0]:  0:sysv/memory.0 md[0]           -> md[0]/sysv/sysdev[255] am am_bw#0 keepalive\n\
            #                 lane[1]:  1:posix/memory.0 md[1]          -> md[1]/posix/sysdev[255]\n\
            #                  get[0]: 0..<bcopy>..(inf)\n";
        assert!(gets_ride_tcp_messages(tcp));
        assert!(!gets_ride_tcp_messages(shm));
        assert!(!gets_ride_tcp_messages(""));
    }
}
