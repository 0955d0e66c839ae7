//! This process's mappings, from `/proc/self/maps`: the check that a
//! peer's region, where UCX mapped the peer's shared-memory segment into
//! this process, lies inside that segment.
//!
//! Why: UCX's shared-memory transports compute the address of a remote
//! byte from the key alone (`ucp_rkey_ptr`, and their gets and puts, copy
//! at base + offset without a bound), and the region's length comes from
//! the peer's metadata. A peer that claims a region longer than the
//! segment it packed would make a read or a write here run past the
//! segment: a fault in this process, or bytes of another mapping. So when
//! a connection unpacks a key UCX maps, kvpoll checks once that the whole
//! claimed range lies in mappings of one object, readable and writable,
//! that follow each other without a gap, and refuses the peer otherwise.

use std::io;

/// One line of `/proc/self/maps`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Mapping {
    start: usize,
    end: usize,
    /// Readable and writable (UCX maps its segments so).
    rw: bool,
    /// Offset in the mapped object.
    offset: u64,
    /// Device and inode of the mapped object (`0`, `0` for anonymous
    /// memory).
    dev: (u32, u32),
    inode: u64,
}

/// This process's mappings at one moment, in address order.
#[derive(Debug, Default)]
pub(crate) struct Maps(Vec<Mapping>);

impl Maps {
    /// Reads `/proc/self/maps`.
    pub(crate) fn read() -> io::Result<Self> {
        Ok(Self::parse(&std::fs::read_to_string("/proc/self/maps")?))
    }

    /// The mappings `text` lists (in the format of `/proc/PID/maps`);
    /// lines it cannot read are left out, so a range they hold is not
    /// covered.
    fn parse(text: &str) -> Self {
        let mut v: Vec<Mapping> = text.lines().filter_map(parse_line).collect();
        v.sort_by_key(|m| m.start);
        Maps(v)
    }

    /// Whether the `len` bytes at `at` lie in readable and writable
    /// mappings of one object, each starting where the one before ends and
    /// (for a file or segment) going on at the next offset. Anonymous
    /// memory must lie in one mapping: two anonymous mappings side by side
    /// are not known to be one allocation. `len` 0 is covered nowhere.
    pub(crate) fn covers(&self, at: usize, len: usize) -> bool {
        let Some(end) = at.checked_add(len).filter(|_| len > 0) else {
            return false;
        };
        // The mapping holding `at`: the last one starting at or before it.
        let i = self.0.partition_point(|m| m.start <= at);
        let Some(first) = i.checked_sub(1).map(|i| self.0[i]) else {
            return false;
        };
        if at >= first.end || !first.rw {
            return false;
        }
        let mut last = first;
        for m in &self.0[i..] {
            if last.end >= end {
                break;
            }
            let follows = m.start == last.end
                && m.rw
                && first.inode != 0
                && (m.dev, m.inode) == (first.dev, first.inode)
                && Some(m.offset) == last.offset.checked_add((last.end - last.start) as u64);
            if !follows {
                return false;
            }
            last = *m;
        }
        last.end >= end
    }
}

/// `start-end perms offset major:minor inode [path]`, numbers in hex but
/// the inode.
fn parse_line(line: &str) -> Option<Mapping> {
    let mut f = line.split_ascii_whitespace();
    let (start, end) = f.next()?.split_once('-')?;
    let perms = f.next()?.as_bytes();
    let offset = u64::from_str_radix(f.next()?, 16).ok()?;
    let (major, minor) = f.next()?.split_once(':')?;
    let inode = f.next()?.parse().ok()?;
    let m = Mapping {
        start: usize::from_str_radix(start, 16).ok()?,
        end: usize::from_str_radix(end, 16).ok()?,
        rw: perms.len() >= 2 && perms[0] == b'r' && perms[1] == b'w',
        offset,
        dev: (
            u32::from_str_radix(major, 16).ok()?,
            u32::from_str_radix(minor, 16).ok()?,
        ),
        inode,
    };
    (m.start < m.end).then_some(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "\
1000-3000 rw-s 00000000 00:01 77                         /dev/shm/seg (deleted)
3000-5000 rw-s 00002000 00:01 77                         /dev/shm/seg (deleted)
5000-6000 rw-s 00000000 00:01 78                         /dev/shm/other (deleted)
7000-8000 rw-p 00000000 00:00 0
8000-9000 rw-p 00000000 00:00 0
9000-a000 r--s 00000000 00:01 79                         /SYSV00000000 (deleted)
b000-c000 rw-s 00000000 00:01 80                         /dev/shm/a
c000-d000 rw-s 00004000 00:01 80                         /dev/shm/a
not a line
";

    #[test]
    fn a_range_inside_one_mapping_or_a_run_of_one_object_is_covered() {
        let m = Maps::parse(TEXT);
        assert!(m.covers(0x1000, 0x2000));
        assert!(m.covers(0x1800, 0x10), "inside");
        assert!(
            m.covers(0x1000, 0x4000),
            "two mappings of one segment, in order"
        );
        assert!(m.covers(0x7000, 0x1000), "one anonymous mapping");
    }

    #[test]
    fn a_range_past_its_object_into_a_gap_another_object_or_other_memory_is_not() {
        let m = Maps::parse(TEXT);
        assert!(!m.covers(0x1000, 0x5000), "into another segment");
        assert!(!m.covers(0x5000, 0x1800), "into a gap");
        assert!(!m.covers(0x7000, 0x2000), "two anonymous mappings");
        assert!(!m.covers(0x9000, 0x10), "not writable");
        assert!(!m.covers(0xb000, 0x2000), "the same file at another offset");
        assert!(!m.covers(0x500, 0x10), "before every mapping");
        assert!(!m.covers(0x1000, 0), "nothing");
        assert!(!m.covers(usize::MAX - 4, 0x10), "wraps");
        assert!(!m.covers(0x1000, 1 << 40), "a claimed terabyte");
    }

    #[test]
    fn this_process_maps_a_buffer_it_allocated_and_not_a_terabyte_past_it() {
        let v = vec![7u8; 1 << 20];
        let m = Maps::read().unwrap();
        assert!(m.covers(v.as_ptr() as usize, v.len()));
        assert!(!m.covers(v.as_ptr() as usize, 1 << 46));
    }
}
