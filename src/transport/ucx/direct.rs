//! Direct reads: a reader on the same host as its lender reads the
//! lender's host memory with `process_vm_readv(2)` itself, from its
//! poller, one system call for the blocks of the reads posted to that
//! lender, up to a few MiB a progress (so that a read ends, and is
//! reported, before the next one is copied) — the copy-limit path for
//! memory the serving engine allocated.
//!
//! Why: UCX 1.13 gives `cma` no lane beside peer error handling, so a get
//! from memory UCX did not allocate is emulated through the lender's
//! progress (two copies, both processes busy); UCX 1.20 and later give it
//! a lane with rendezvous off, but copy one operation per endpoint per
//! progress call (docs/design.md §4). The UCX endpoint stays what it was:
//! notifications, lend words, puts and the peer's failure detection still
//! go through it.
//!
//! When: the lender announces, in its metadata, its host (boot id), pid
//! namespace, pid, the regions it lets be read so (host memory it did not
//! get from UCX's shared-memory allocator: UCX reads those with a plain
//! copy from a mapped segment already) and a probe word: a random value
//! at an address of its own. A reader uses direct reads on a connection
//! only if both transport lists may use `cma` (a list of `tcp` alone
//! means tcp), neither side has device memory registered, the host and
//! namespace are its own, and a first read of the probe word from that
//! pid returns the value (the kernel lets it: same user, ptrace rules).
//!
//! The same offer, with or without regions, lets a peer on this host
//! check that the process lives: every engine whose transport list may
//! use shared memory or `cma` announces it, and reads its peers' probe
//! words once a second (a connection whose word does not read back
//! fails, as below). A write waiting behind the full queue of a
//! destination that died learns of it so (docs/design.md §4).
//!
//! Every read also reads the probe word, after the data, in the same
//! system call: the kernel resolves the pid once a call, so a matching
//! word means every byte of that call came from the lender, not from a
//! process that took its pid after it died. A read that finds no such
//! process, moves fewer bytes or finds another word found its lender gone
//! (the transport fails the connection, as UCX does when `cma` finds its
//! peer dead); one that fails for itself completes with `IO_ERROR`.

use std::os::unix::fs::MetadataExt;

use crate::transport::peer::{DirectReads, Host};

/// Operations one system call carries at most with the probe word
/// (`IOV_MAX` is 1024 on Linux).
const OPS_PER_CALL: usize = 1023;

/// This process's host and pid namespace, or `None` where `/proc` does
/// not tell them (no direct reads then).
pub fn this_host() -> Option<Host> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let pid_ns = std::fs::metadata("/proc/self/ns/pid").ok()?.ino();
    Some(Host {
        boot: parse_boot_id(&boot)?,
        pid_ns,
        pid: std::process::id(),
    })
}

/// A random word (`getrandom(2)`; where it fails, the time and pid mixed:
/// the probe only has to differ from what another process holds there).
pub(crate) fn random_word() -> u64 {
    let mut w = 0u64;
    // SAFETY: writes at most 8 bytes into `w`.
    let n = unsafe { libc::getrandom((&mut w as *mut u64).cast(), 8, 0) };
    if n != 8 {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        w = crate::wire::fnv1a64(&(t ^ u64::from(std::process::id()) << 32).to_le_bytes());
    }
    w | 1
}

/// The 16 bytes of a boot id as `/proc` prints it (a UUID).
fn parse_boot_id(text: &str) -> Option<[u8; 16]> {
    let hex: Vec<u8> = text.trim().bytes().filter(|&b| b != b'-').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, pair) in hex.chunks(2).enumerate() {
        let s = std::str::from_utf8(pair).ok()?;
        out[i] = u8::from_str_radix(s, 16).ok()?;
    }
    Some(out)
}

/// This engine's side: the probe word a reader checks, at an address that
/// stays put while the transport lives.
pub struct Local {
    pub host: Host,
    probe: Box<u64>,
}

impl Local {
    /// `None` where `/proc` does not tell the host.
    pub fn new() -> Option<Self> {
        Some(Local {
            host: this_host()?,
            probe: Box::new(random_word()),
        })
    }

    /// What this engine announces for `regions` (ids readable directly).
    pub fn announce(&self, regions: Vec<u32>) -> DirectReads {
        DirectReads {
            host: self.host,
            probe_addr: &*self.probe as *const u64 as u64,
            probe: *self.probe,
            regions,
        }
    }
}

/// Why a direct read failed.
#[derive(Debug)]
pub struct ReadError {
    /// The lender is gone as this reader knew it: no such process, its
    /// memory no longer mapped there, the probe word another, or reads of
    /// it refused now. Other failures (out of memory, a bad list) are the
    /// read's own.
    pub lost: bool,
    /// What the call said.
    pub why: std::io::Error,
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (peer lost: {})", self.why, self.lost)
    }
}

impl ReadError {
    fn of_call(why: std::io::Error) -> Self {
        let lost = !matches!(why.raw_os_error(), Some(libc::ENOMEM | libc::EINVAL));
        ReadError { lost, why }
    }

    fn lost(why: String) -> Self {
        ReadError {
            lost: true,
            why: std::io::Error::other(why),
        }
    }
}

/// One block run to read: `len` bytes from the peer's `remote` address
/// into `local`.
#[derive(Debug, Clone, Copy)]
pub struct Op {
    pub local: *mut u8,
    pub remote: u64,
    pub len: usize,
}

/// A connection's direct reads: the lender's pid and probe word, and each
/// of its regions' (base, length) where it may be read so.
pub struct Peer {
    pid: libc::pid_t,
    probe_addr: u64,
    probe: u64,
    /// By region index (the connection's rkey order).
    pub regions: Vec<Option<(u64, u64)>>,
}

impl Peer {
    /// Direct reads of a peer that announced `d` and whose regions are
    /// `spans` (base, length; in its metadata's order, by id `ids`), from
    /// an engine on `ours`: `None` unless it runs on this host, in this
    /// pid namespace, and its probe word reads back.
    pub fn connect(
        ours: &Host,
        d: &DirectReads,
        ids: &[u32],
        spans: &[(u64, u64)],
    ) -> Option<Self> {
        if d.host.boot != ours.boot || d.host.pid_ns != ours.pid_ns {
            return None;
        }
        let pid = libc::pid_t::try_from(d.host.pid).ok().filter(|&p| p > 0)?;
        let regions = ids
            .iter()
            .zip(spans)
            .map(|(id, &span)| d.regions.contains(id).then_some(span))
            .collect();
        let peer = Peer {
            pid,
            probe_addr: d.probe_addr,
            probe: d.probe,
            regions,
        };
        match peer.read(&[], &mut Vec::new(), &mut Vec::new()) {
            Ok(()) => Some(peer),
            Err(e) => {
                tracing::debug!(pid, error = %e, "no direct reads of this peer: its probe word did not read back");
                None
            }
        }
    }

    /// The remote address of `len` bytes at `offset` in region `region`,
    /// if they lie inside it and it may be read directly.
    pub fn remote(&self, region: usize, offset: u64, len: usize) -> Option<u64> {
        let (base, size) = (*self.regions.get(region)?)?;
        let end = offset.checked_add(len as u64)?;
        (end <= size).then(|| base.checked_add(offset)).flatten()
    }

    /// Reads every op, then the probe word, `OPS_PER_CALL` ops a call
    /// (`local`, `remote`: scratch lists, reused). `Err`: the call failed
    /// (its `errno`), moved fewer bytes, or the word was another.
    pub fn read(
        &self,
        ops: &[Op],
        local: &mut Vec<libc::iovec>,
        remote: &mut Vec<libc::iovec>,
    ) -> Result<(), ReadError> {
        let mut chunks = ops.chunks(OPS_PER_CALL);
        let mut first = true;
        loop {
            let chunk = match chunks.next() {
                Some(c) => c,
                None if first => &[][..],
                None => return Ok(()),
            };
            first = false;
            local.clear();
            remote.clear();
            let mut want = 8usize;
            for op in chunk {
                local.push(libc::iovec {
                    iov_base: op.local.cast(),
                    iov_len: op.len,
                });
                remote.push(libc::iovec {
                    iov_base: op.remote as *mut libc::c_void,
                    iov_len: op.len,
                });
                want += op.len;
            }
            let mut word = 0u64;
            local.push(libc::iovec {
                iov_base: (&mut word as *mut u64).cast(),
                iov_len: 8,
            });
            remote.push(libc::iovec {
                iov_base: self.probe_addr as *mut libc::c_void,
                iov_len: 8,
            });
            // SAFETY: every local iovec is memory this process owns and
            // may write (registered regions the core keeps for the read,
            // and `word`); the remote ones are only read, by the kernel,
            // which checks them against the peer's mappings.
            let n = unsafe {
                libc::process_vm_readv(
                    self.pid,
                    local.as_ptr(),
                    local.len() as libc::c_ulong,
                    remote.as_ptr(),
                    remote.len() as libc::c_ulong,
                    0,
                )
            };
            if n < 0 {
                return Err(ReadError::of_call(std::io::Error::last_os_error()));
            }
            if n as usize != want {
                // The kernel stops at the first address the peer does not
                // map: its memory went.
                return Err(ReadError::lost(format!("{n} of {want} bytes read")));
            }
            if word != self.probe {
                return Err(ReadError::lost(
                    "the probe word is another: the pid is no longer the lender's".into(),
                ));
            }
            if chunk.len() < OPS_PER_CALL {
                return Ok(());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_boot_id_is_sixteen_bytes_of_a_uuid() {
        let id = parse_boot_id("07dc3140-83ca-406e-b313-8dc695e5eade\n").unwrap();
        assert_eq!(id[0], 0x07);
        assert_eq!(id[15], 0xde);
        for bad in ["", "07dc3140", "zzdc3140-83ca-406e-b313-8dc695e5eade"] {
            assert_eq!(parse_boot_id(bad), None, "{bad:?}");
        }
    }

    /// A peer that is this process: its probe word and a buffer read back
    /// directly, and a wrong word, a dead pid or bytes outside a region
    /// are refused.
    #[test]
    fn reads_check_the_probe_word_and_stay_inside_regions() {
        let local = Local::new().expect("this host");
        let src: Vec<u8> = (0..3 * 4096).map(|i| (i % 251) as u8).collect();
        let base = src.as_ptr() as u64;
        let d = local.announce(vec![7]);
        let spans = [(0, 0), (base, src.len() as u64)];
        let peer = Peer::connect(&local.host, &d, &[3, 7], &spans).expect("probe reads back");
        assert_eq!(peer.regions[0], None, "region 3 was not announced");
        assert_eq!(peer.remote(1, 4096, 8192), Some(base + 4096));
        assert_eq!(peer.remote(1, 4097, 8192), None, "past the region's end");
        assert_eq!(peer.remote(1, u64::MAX, 1), None, "wraps");
        assert_eq!(peer.remote(0, 0, 1), None, "not announced");

        let mut dst = vec![0u8; 2 * 4096];
        let ops = [
            Op {
                local: dst.as_mut_ptr(),
                remote: base + 4096,
                len: 4096,
            },
            Op {
                local: dst.as_mut_ptr().wrapping_add(4096),
                remote: base,
                len: 4096,
            },
        ];
        let (mut l, mut r) = (Vec::new(), Vec::new());
        peer.read(&ops, &mut l, &mut r).unwrap();
        assert_eq!(&dst[..4096], &src[4096..8192]);
        assert_eq!(&dst[4096..], &src[..4096]);

        // More ops than one call carries.
        let mut many = vec![0u8; 2500];
        let ops: Vec<Op> = (0..2500)
            .map(|i| Op {
                local: many.as_mut_ptr().wrapping_add(i),
                remote: base + i as u64,
                len: 1,
            })
            .collect();
        peer.read(&ops, &mut l, &mut r).unwrap();
        assert_eq!(&many[..], &src[..2500]);

        let mut other = local.announce(vec![7]);
        other.probe ^= 1;
        assert!(Peer::connect(&local.host, &other, &[3, 7], &spans).is_none());
        let mut elsewhere = local.announce(vec![7]);
        elsewhere.host.boot[0] ^= 1;
        assert!(Peer::connect(&local.host, &elsewhere, &[3, 7], &spans).is_none());
        let mut gone = local.announce(vec![7]);
        gone.host.pid = u32::MAX;
        assert!(Peer::connect(&local.host, &gone, &[3, 7], &spans).is_none());
        // An address the peer does not map fails the read, with no bytes
        // kept as read.
        let bad = [Op {
            local: dst.as_mut_ptr(),
            remote: 8,
            len: 4096,
        }];
        assert!(peer.read(&bad, &mut l, &mut r).is_err_and(|e| e.lost));
    }
}
