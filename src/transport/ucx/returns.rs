//! Return paths: the endpoints a worker answers its askers on.
//!
//! A message that wants an answer (a read's `ReadDone`, a push
//! destination's question to its writers, a soft read's request) comes
//! with UCX's reply endpoint, which UCX made for the sender's connection
//! and owns. UCX destroys such an endpoint inside the progress that finds
//! its peer failed (`ucp_ep_set_failed` in `src/ucp/core/ucp_ep.c`:
//! "destroy endpoint which is not exposed to a user due to peer
//! failure"), and that can be the progress that brought the message. An
//! answer decided after it would be sent on freed memory: a lender died so
//! (SIGSEGV in `ucp_am_send_nbx`) when its reader was killed.
//!
//! So before its first message that wants an answer, every connection
//! announces a return path — the sender's return key, the connection's
//! serial and the sender's worker address — and every message that wants
//! an answer carries the key in its header. The receiver answers on an
//! endpoint of its own to that address, opened when the announcement is
//! taken and closed only by it: its failure is reported to it like any
//! endpoint's (and closes it; the next answer opens another), so no answer
//! outlives the endpoint it goes on. A newer connection of the same
//! sender (a fresh endpoint after a deadline or a failure) announces
//! again with a newer serial, and the path's endpoint is closed for a new
//! one: UCX pairs the receiver's n-th endpoint to the sender with the
//! sender's n-th connection (its wire-up matches the two), so each
//! announcement gets its own endpoint, opened while its connection is
//! the one announcing ([`Returns::open_announced`]). Where the endpoint cannot
//! be opened (over tcp: the sender is dead, its port refuses), no answer
//! goes out: UCX's reply endpoint is no fallback then, since the sender's
//! death is what may have freed it (two lenders died so, SIGSEGV in
//! `ucp_am_send_nbx`, at one kill of a reader while they were stopped).
//! Only a sender that announced no path (its announcement could not be
//! sent) is answered on UCX's reply endpoint.
//!
//! What a peer announces is outside input: the address is checked as a
//! metadata's is ([`WorkerAddress::from_bytes`]), keys are its own to
//! choose, and the table is bounded ([`MAX_RETURNS`]). A peer that
//! announces another's key under its own address is answered in that
//! one's stead until the other connects: no worse than a lying rkey
//! (`docs/design.md` §4).

use std::collections::HashMap;

use super::{Endpoint, Worker, WorkerAddress};

/// The active-message id of return-path announcements: an 8-byte key
/// (little-endian, never 0), the connection's 4-byte serial
/// (little-endian), then the sender's framed worker address.
pub(crate) const RETURN_AM_ID: u16 = 0x6b7a;

/// Return paths kept at most. Past it, a new key takes the place of a
/// path without an open endpoint, else of the others in turn.
pub(crate) const MAX_RETURNS: usize = 4096;

/// The peer half of return endpoints' ids ([`super::EndpointFailure`]):
/// no [`crate::transport::Ep`]'s peer reaches it, nor is it the probe's
/// (`u64::MAX`, on another worker).
const RETURN_PEER: u64 = 0x8000_0000;

/// Whether endpoint id `id` is a return endpoint's.
pub(crate) fn is_return_id(id: u64) -> bool {
    id >> 32 == RETURN_PEER
}

/// The announcement of return key `key` at `address` by the sender's
/// connection `serial`, or `None` if it would not fit one message.
pub(crate) fn announcement(key: u64, serial: u32, address: &WorkerAddress) -> Option<Vec<u8>> {
    let mut b = Vec::with_capacity(12 + address.as_bytes().len());
    b.extend_from_slice(&key.to_le_bytes());
    b.extend_from_slice(&serial.to_le_bytes());
    b.extend_from_slice(address.as_bytes());
    (b.len() <= super::MAX_AM_PAYLOAD && key != 0).then_some(b)
}

struct Path {
    key: u64,
    address: WorkerAddress,
    /// The serial of the sender's connection that announced it last.
    announced: u32,
    ep: Option<Endpoint>,
    /// Bumped at each endpoint opened for this path: a failure report of
    /// an earlier one closes nothing of the next.
    opened: u16,
}

/// A worker's return paths, by key.
pub(crate) struct Returns {
    /// Paths kept at most ([`MAX_RETURNS`]).
    cap: usize,
    paths: Vec<Path>,
    by_key: HashMap<u64, usize>,
    /// Return endpoints force-closed, kept until their close completed
    /// (by close token).
    closing: Vec<(u64, Endpoint)>,
    /// The path a full table gave up last when none was idle.
    evict: usize,
    /// Keys announced (first, or by a newer connection) since the last
    /// [`Returns::open_announced`], in order: each opens its endpoint
    /// then, not at its first answer.
    announced: Vec<u64>,
}

impl Default for Returns {
    fn default() -> Self {
        Self::with_room(MAX_RETURNS)
    }
}

impl Returns {
    fn with_room(cap: usize) -> Self {
        Returns {
            cap,
            paths: Vec::new(),
            by_key: HashMap::new(),
            closing: Vec::new(),
            evict: 0,
            announced: Vec::new(),
        }
    }

    /// Takes announcement `payload` (outside bytes). A key already known
    /// keeps its first address; announced by a newer connection (a serial
    /// after the last one's, in wrapping order), its endpoint is
    /// force-closed with a token from `token` (the next answer opens
    /// another). `false`: refused (malformed).
    pub fn announce(&mut self, payload: &[u8], token: &mut dyn FnMut() -> u64) -> bool {
        let Some((key, rest)) = payload.split_first_chunk::<8>() else {
            return false;
        };
        let Some((serial, address)) = rest.split_first_chunk::<4>() else {
            return false;
        };
        let (key, serial) = (u64::from_le_bytes(*key), u32::from_le_bytes(*serial));
        if key == 0 {
            return false;
        }
        if let Some(&i) = self.by_key.get(&key) {
            let p = &mut self.paths[i];
            if (serial.wrapping_sub(p.announced) as i32) > 0 {
                p.announced = serial;
                if let Some(ep) = p.ep.take() {
                    let t = token();
                    if ep.force_close(t).is_ok() {
                        self.closing.push((t, ep));
                    }
                }
                self.announced.push(key);
            }
            return true;
        }
        let Ok(address) = WorkerAddress::from_bytes(address) else {
            return false;
        };
        let path = Path {
            key,
            address,
            announced: serial,
            ep: None,
            opened: 0,
        };
        let at = if self.paths.len() < self.cap {
            self.paths.push(path);
            self.paths.len() - 1
        } else {
            // Full: an idle path's place, else the next one's in turn, its
            // endpoint closed (its sender's answers go nowhere until it
            // connects again, past its reads' deadline).
            let i = match self.paths.iter().position(|p| p.ep.is_none()) {
                Some(i) => i,
                None => {
                    self.evict = (self.evict + 1) % self.paths.len();
                    self.evict
                }
            };
            if let Some(ep) = self.paths[i].ep.take() {
                let t = token();
                if ep.force_close(t).is_ok() {
                    self.closing.push((t, ep));
                }
            }
            self.by_key.remove(&self.paths[i].key);
            self.paths[i] = path;
            i
        };
        self.by_key.insert(key, at);
        self.announced.push(key);
        true
    }

    /// Opens a return endpoint on `worker` for each announcement taken
    /// since the last call, in order: a path announced again in between
    /// has the endpoint of its earlier announcement force-closed (with a
    /// token from `token`) and opens another. One UCX refuses is opened at
    /// its first answer, as any.
    ///
    /// Opened now, not at the first answer, so that it pairs with the
    /// connection that announced it. UCX pairs a new endpoint to a worker
    /// with that worker's connection of the same serial (`conn_sn`: the
    /// n-th endpoint each side made to the other), taking the endpoint
    /// UCX made here for that connection. Opened at the first answer,
    /// the n-th return endpoint to a sender took the endpoint of the
    /// sender's n-th connection, whichever was announcing: after a
    /// connection that asked nothing (a note) and was closed, every
    /// answer went on the closed one and was lost, and every read of a
    /// soft reader timed out, after each fresh connection alike. Opened
    /// at each announcement, the n-th return endpoint is the n-th
    /// connection's, which announces as it opens.
    pub fn open_announced(&mut self, worker: &Worker, token: &mut dyn FnMut() -> u64) {
        for k in 0..self.announced.len() {
            let key = self.announced[k];
            let Some(&i) = self.by_key.get(&key) else {
                continue;
            };
            if let Some(ep) = self.paths[i].ep.take() {
                let t = token();
                if ep.force_close(t).is_ok() {
                    self.closing.push((t, ep));
                }
            }
            let _ = self.endpoint(worker, key);
        }
        self.announced.clear();
    }

    /// The open endpoint to answer the sender of key `key` on, opened on
    /// `worker` now if it has none. `None`: no path is known for `key`, or
    /// UCX refused to open one.
    pub fn endpoint(&mut self, worker: &Worker, key: u64) -> Option<&Endpoint> {
        let &i = self.by_key.get(&key)?;
        let p = &mut self.paths[i];
        if p.ep.as_ref().is_some_and(|e| e.is_closed()) {
            // Closed only after a failure, whose report moved it away.
            p.ep = None;
        }
        if p.ep.is_none() {
            p.opened = p.opened.wrapping_add(1);
            let id = RETURN_PEER << 32 | u64::from(p.opened) << 16 | i as u64;
            match Endpoint::connect(worker, &p.address, id) {
                Ok(ep) => p.ep = Some(ep),
                Err(e) => {
                    tracing::debug!(error = %e, "no return endpoint: answers go on UCX's reply endpoint");
                    return None;
                }
            }
        }
        p.ep.as_ref()
    }

    /// Endpoint `id` failed: if it is a return endpoint still open, it is
    /// force-closed with `token` (the next answer opens another). Returns
    /// whether `id` was a return endpoint's.
    pub fn failed(&mut self, id: u64, token: u64) -> bool {
        if !is_return_id(id) {
            return false;
        }
        let i = (id & 0xffff) as usize;
        let opened = (id >> 16) as u16;
        if let Some(p) = self.paths.get_mut(i).filter(|p| p.opened == opened) {
            if let Some(ep) = p.ep.take() {
                if ep.force_close(token).is_ok() {
                    self.closing.push((token, ep));
                }
            }
        }
        true
    }

    /// A close completed: whether it was a return endpoint's (now gone).
    pub fn closed(&mut self, token: u64) -> bool {
        match self.closing.iter().position(|(t, _)| *t == token) {
            Some(i) => {
                self.closing.swap_remove(i);
                true
            }
            None => false,
        }
    }

    /// Paths known.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.paths.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn return_ids_are_told_from_every_connection_id_and_the_probes() {
        let ep = crate::transport::Ep {
            peer: crate::ledger::PeerId(7),
            generation: u32::MAX,
        };
        assert!(!is_return_id(ep.to_u64()));
        assert!(!is_return_id(u64::MAX));
        assert!(is_return_id(RETURN_PEER << 32 | 3 << 16 | 5));
    }

    /// Close tokens for tests: counted from 1.
    fn tokens() -> impl FnMut() -> u64 {
        let mut n = 0;
        move || {
            n += 1;
            n
        }
    }

    #[test]
    fn announcements_that_are_not_a_key_a_serial_and_a_worker_address_are_refused() {
        let mut r = Returns::default();
        let mut t = tokens();
        assert!(!r.announce(&[], &mut t));
        assert!(!r.announce(&[1, 2, 3], &mut t));
        // A key, then no serial, no address, or bytes that are not one.
        assert!(!r.announce(&7u64.to_le_bytes(), &mut t));
        let mut junk = 7u64.to_le_bytes().to_vec();
        junk.extend_from_slice(&1u32.to_le_bytes());
        assert!(!r.announce(&junk, &mut t));
        junk.extend_from_slice(&[0xab; 64]);
        assert!(!r.announce(&junk, &mut t));
        // Key 0 names nobody.
        let mut zero = 0u64.to_le_bytes().to_vec();
        zero.extend_from_slice(&[0xab; 64]);
        assert!(!r.announce(&zero, &mut t));
        assert_eq!(r.len(), 0);
        // Not a return endpoint's id: nothing to close.
        assert!(!r.failed(5, 1));
        assert!(!r.closed(1));
    }

    fn tcp_workers() -> (Worker, Worker) {
        let options = super::super::ContextOptions {
            transports: Some("tcp".into()),
            ..Default::default()
        };
        let context = super::super::Context::new(&options).expect("context");
        (
            Worker::new(&context).expect("worker"),
            Worker::new(&context).expect("worker"),
        )
    }

    #[test]
    fn a_key_keeps_its_first_address_and_a_full_table_takes_new_keys_in_place_of_idle_paths_first()
    {
        let (worker, other) = tcp_workers();
        let address = worker.address().expect("address");
        let mut r = Returns::with_room(4);
        let mut t = tokens();
        let said = announcement(9, 1, &address).expect("fits");
        assert!(r.announce(&said, &mut t));
        // Again, and under the same key with another address: one path, the
        // first address's.
        assert!(r.announce(&said, &mut t));
        let elsewhere = announcement(9, 2, &other.address().unwrap()).unwrap();
        assert!(r.announce(&elsewhere, &mut t));
        assert_eq!(r.len(), 1);
        assert_eq!(r.paths[0].address, address);
        // Full: a new key takes an idle path's place...
        for k in 10..13 {
            assert!(r.announce(&announcement(k, 1, &address).unwrap(), &mut t));
        }
        assert_eq!(r.len(), 4);
        assert!(r.announce(&announcement(1, 1, &address).unwrap(), &mut t));
        assert_eq!(r.len(), 4);
        // ...and with every path's endpoint open, one of theirs, closed.
        for k in 1..13 {
            if r.by_key.contains_key(&k) {
                assert!(r.endpoint(&worker, k).is_some());
            }
        }
        let late = announcement(5_000_000, 1, &address).unwrap();
        assert!(r.announce(&late, &mut t));
        assert_eq!(r.len(), 4);
        assert_eq!(r.closing.len(), 1);
        assert_eq!(r.by_key.len(), 4);
        assert!(r.endpoint(&worker, 5_000_000).is_some());
    }

    #[test]
    fn a_newer_connection_of_a_sender_closes_its_return_endpoint_and_an_older_one_does_not() {
        let (worker, other) = tcp_workers();
        let address = other.address().expect("address");
        let mut r = Returns::default();
        let mut t = tokens();
        assert!(r.announce(&announcement(9, 5, &address).unwrap(), &mut t));
        assert!(r.endpoint(&worker, 9).is_some());
        // A late announcement of an earlier connection, or the same one
        // again: the endpoint stays.
        for serial in [4, 5, 5u32.wrapping_sub(1 << 31)] {
            assert!(r.announce(&announcement(9, serial, &address).unwrap(), &mut t));
            assert!(r.paths[0].ep.is_some(), "serial {serial}");
        }
        assert!(r.closing.is_empty());
        // A newer one: closed (its close awaited under a fresh token), and
        // the next answer opens another.
        assert!(r.announce(&announcement(9, 6, &address).unwrap(), &mut t));
        assert!(r.paths[0].ep.is_none());
        assert_eq!(r.closing.len(), 1);
        let closing = r.closing[0].0;
        assert!(r.endpoint(&worker, 9).is_some());
        assert!(r.closed(closing));
        assert!(r.closing.is_empty());
        // Serials wrap: after u32::MAX, 0 is newer.
        assert!(r.announce(&announcement(10, u32::MAX, &address).unwrap(), &mut t));
        assert!(r.endpoint(&worker, 10).is_some());
        assert!(r.announce(&announcement(10, 0, &address).unwrap(), &mut t));
        assert!(r.paths[1].ep.is_none());
        assert_eq!(r.paths[1].announced, 0);
    }
}
