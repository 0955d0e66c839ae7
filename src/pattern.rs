//! Block contents that can be checked: every byte is a function of a seed,
//! a block number and the byte's offset, so a reader can tell a correct
//! block from a stale, torn or foreign one. The demo and the tests use it.

/// The byte at `offset` of block `block` for `seed`.
#[inline]
pub fn byte(seed: u64, block: u64, offset: u64) -> u8 {
    let x = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(block.wrapping_mul(0xBF58_476D_1CE4_E5B9))
        .wrapping_add(offset.wrapping_mul(0x94D0_49BB_1331_11EB));
    (x ^ (x >> 29) ^ (x >> 47)) as u8
}

/// Fills `buf` with block `block` of `seed`.
pub fn fill(seed: u64, block: u64, buf: &mut [u8]) {
    for (o, b) in buf.iter_mut().enumerate() {
        *b = byte(seed, block, o as u64);
    }
}

/// Whether `buf` holds exactly block `block` of `seed`.
pub fn check(seed: u64, block: u64, buf: &[u8]) -> bool {
    buf.iter()
        .enumerate()
        .all(|(o, &b)| b == byte(seed, block, o as u64))
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
}
