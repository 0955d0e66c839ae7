//! The library tests' own copy of the tool's block pattern
//! (`kvpoll-cli/src/pattern.rs`): every 8-byte word is a function of a seed,
//! a block number and the word's index, so a reader can tell a correct
//! block from a stale, torn or foreign one. Only in-process tests use it
//! (both ends fill and check with this copy), so it need not stay
//! byte-identical to the tool's.
#![allow(dead_code)]

fn word(seed: u64, block: u64, index: u64) -> u64 {
    let x = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(block.wrapping_mul(0xBF58_476D_1CE4_E5B9))
        .wrapping_add(index.wrapping_mul(0x94D0_49BB_1331_11EB));
    let x = (x ^ (x >> 31)).wrapping_mul(0xD6E8_FEB8_6659_FD93);
    x ^ (x >> 32)
}

/// Fills `buf` with block `block` of `seed`.
pub fn fill(seed: u64, block: u64, buf: &mut [u8]) {
    for (i, b) in buf.iter_mut().enumerate() {
        let i = i as u64;
        *b = word(seed, block, i / 8).to_le_bytes()[(i % 8) as usize];
    }
}

/// Whether `buf` holds exactly block `block` of `seed`.
pub fn check(seed: u64, block: u64, buf: &[u8]) -> bool {
    buf.iter().enumerate().all(|(i, &b)| {
        let i = i as u64;
        b == word(seed, block, i / 8).to_le_bytes()[(i % 8) as usize]
    })
}
