//! Block contents that can be checked: every 8-byte word is a function of a
//! seed, a block number and the word's offset, so a reader can tell a
//! correct block from a stale, torn or foreign one. The demo and the tests
//! use it. Word-wise so that filling and checking cost little next to the
//! transfer they verify.

#[inline]
fn word(seed: u64, block: u64, index: u64) -> u64 {
    let x = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(block.wrapping_mul(0xBF58_476D_1CE4_E5B9))
        .wrapping_add(index.wrapping_mul(0x94D0_49BB_1331_11EB));
    let x = (x ^ (x >> 31)).wrapping_mul(0xD6E8_FEB8_6659_FD93);
    x ^ (x >> 32)
}

/// The byte at `offset` of block `block` for `seed`.
#[inline]
pub fn byte(seed: u64, block: u64, offset: u64) -> u8 {
    word(seed, block, offset / 8).to_le_bytes()[(offset % 8) as usize]
}

/// Fills `buf` with block `block` of `seed`.
pub fn fill(seed: u64, block: u64, buf: &mut [u8]) {
    let mut chunks = buf.chunks_exact_mut(8);
    let mut i = 0;
    for c in &mut chunks {
        c.copy_from_slice(&word(seed, block, i).to_le_bytes());
        i += 1;
    }
    let rest = chunks.into_remainder();
    let w = word(seed, block, i).to_le_bytes();
    rest.copy_from_slice(&w[..rest.len()]);
}

/// Whether `buf` holds exactly block `block` of `seed`.
pub fn check(seed: u64, block: u64, buf: &[u8]) -> bool {
    let mut chunks = buf.chunks_exact(8);
    let mut i = 0;
    for c in &mut chunks {
        if c != word(seed, block, i).to_le_bytes() {
            return false;
        }
        i += 1;
    }
    let rest = chunks.remainder();
    rest == &word(seed, block, i).to_le_bytes()[..rest.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_of_different_seeds_or_numbers_differ() {
        let mut a = vec![0u8; 4096];
        fill(1, 2, &mut a);
        assert!(check(1, 2, &a));
        assert!(!check(1, 3, &a));
        assert!(!check(2, 2, &a));
        a[4095] ^= 1;
        assert!(!check(1, 2, &a));
    }

    #[test]
    fn byte_agrees_with_fill_also_for_odd_lengths() {
        let mut a = vec![0u8; 21];
        fill(5, 6, &mut a);
        for (o, &b) in a.iter().enumerate() {
            assert_eq!(b, byte(5, 6, o as u64));
        }
        assert!(check(5, 6, &a));
        a[20] ^= 0x80;
        assert!(!check(5, 6, &a));
    }
}
