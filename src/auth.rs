//! Authenticated peers (opt-in): a key shared by the engines of one
//! deployment, with which each tags what it tells the others, so that an
//! engine refuses what a process without the key sends it.
//!
//! Without a key (the default) nothing is tagged and nothing is checked:
//! the wire is what it was. With one ([`crate::EngineBuilder::auth_key`]):
//!
//! - this engine's metadata carries a tag, and [`crate::Engine::add_peer`]
//!   refuses metadata without one, or with one made with another key
//!   ([`crate::PeerError::Unauthenticated`], counted in
//!   [`crate::PollerStats::unauthenticated_peers`]); an engine without a
//!   key refuses a keyed peer's metadata the same way, so that a key set
//!   on one side only is found at the first `add_peer`, not by reads that
//!   never confirm;
//! - every notification message carries the receiver's instance, a
//!   counter of its own for that receiver, and a tag over both and the
//!   notes; the receiver drops, and counts, a message whose tag does not
//!   check out ([`crate::PollerStats::unauthenticated_notifications`]) and
//!   one whose counter it has seen ([`crate::PollerStats::replayed_notifications`]).
//!
//! Tags are keyed BLAKE3 (32 bytes), compared in constant time, each under
//! a key of its own derived from the shared secret for its use (metadata,
//! notifications, the `kvpoll` tool's control frames), so a tag made for
//! one use is never valid for another. The key authenticates; it does not
//! encrypt, and it does not guard the one-sided reads and writes
//! themselves: docs/design.md §4 says what it guarantees against whom.

use std::path::Path;

use thiserror::Error;
use zeroize::Zeroize;

/// The environment variable the `kvpoll` tool, the Python binding and the
/// vLLM connector read the shared secret from when no key file is named:
/// the secret itself, as text.
pub const ENV: &str = "KVPOLL_AUTH_KEY";

/// Fewest bytes a secret may have.
pub const MIN_SECRET: usize = 16;

/// Bytes of a tag.
pub const TAG_LEN: usize = 32;

/// A tag: keyed BLAKE3 of what it covers.
pub type Tag = [u8; TAG_LEN];

/// What a tag is for: each use has a key of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// An engine's metadata.
    Metadata = 0,
    /// A notification message.
    Notifications = 1,
    /// A frame of the `kvpoll` tool's control protocol.
    Control = 2,
}

const CONTEXTS: [&str; 3] = [
    "kvpoll 1 peer metadata tag",
    "kvpoll 1 notification message tag",
    "kvpoll 1 control frame tag",
];

/// The key engines of one deployment share. Built from a secret of at
/// least [`MIN_SECRET`] bytes (a file of random bytes, say `head -c 32
/// /dev/urandom | base64`); what is kept are keys derived from it, one per
/// [`Purpose`], wiped when the last clone is dropped. `Debug` never shows
/// them.
#[derive(Clone)]
pub struct AuthKey {
    keys: [[u8; 32]; 3],
}

/// Why a secret could not be made a key.
#[derive(Debug, Error)]
pub enum AuthKeyError {
    /// Fewer bytes than [`MIN_SECRET`].
    #[error("an authentication secret of {0} bytes: at least {MIN_SECRET} are needed")]
    TooShort(usize),
    /// The key file could not be read.
    #[error("reading the authentication key file {path}: {error}")]
    File {
        /// The file named.
        path: String,
        /// Why it could not be read.
        error: std::io::Error,
    },
}

impl AuthKey {
    /// A key from `secret` (at least [`MIN_SECRET`] bytes, used as given).
    ///
    /// ```
    /// use kvpoll::auth::AuthKey;
    /// let key = AuthKey::from_secret(b"a secret of the deployment").unwrap();
    /// assert_eq!(format!("{key:?}"), "AuthKey(..)");
    /// assert!(AuthKey::from_secret(b"short").is_err());
    /// ```
    pub fn from_secret(secret: &[u8]) -> Result<Self, AuthKeyError> {
        if secret.len() < MIN_SECRET {
            return Err(AuthKeyError::TooShort(secret.len()));
        }
        let keys = std::array::from_fn(|i| blake3::derive_key(CONTEXTS[i], secret));
        Ok(AuthKey { keys })
    }

    /// A key from a file's contents, leading and trailing white space left
    /// out (a key file written with `echo` ends in a newline).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, AuthKeyError> {
        let path = path.as_ref();
        let mut bytes = std::fs::read(path).map_err(|error| AuthKeyError::File {
            path: path.display().to_string(),
            error,
        })?;
        let key = Self::from_secret(bytes.trim_ascii());
        bytes.zeroize();
        key
    }

    /// A key from the environment variable [`ENV`], leading and trailing
    /// white space left out; `None` where it is not set.
    pub fn from_env() -> Result<Option<Self>, AuthKeyError> {
        match std::env::var_os(ENV) {
            None => Ok(None),
            Some(v) => {
                let mut bytes = v.into_encoded_bytes();
                let key = Self::from_secret(bytes.trim_ascii());
                bytes.zeroize();
                key.map(Some)
            }
        }
    }

    /// The tag of `parts` (one after the other) for `purpose`.
    pub fn tag(&self, purpose: Purpose, parts: &[&[u8]]) -> Tag {
        let mut h = blake3::Hasher::new_keyed(&self.keys[purpose as usize]);
        for p in parts {
            h.update(p);
        }
        *h.finalize().as_bytes()
    }

    /// Whether `tag` is the tag of `parts` for `purpose`, compared in
    /// constant time (a tag of another length is not).
    pub fn verify(&self, purpose: Purpose, parts: &[&[u8]], tag: &[u8]) -> bool {
        let Ok(given) = <[u8; TAG_LEN]>::try_from(tag) else {
            return false;
        };
        // blake3::Hash compares in constant time.
        blake3::Hash::from_bytes(self.tag(purpose, parts)) == blake3::Hash::from_bytes(given)
    }
}

impl Drop for AuthKey {
    fn drop(&mut self) {
        self.keys.zeroize();
    }
}

impl std::fmt::Debug for AuthKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AuthKey(..)")
    }
}

/// Why an engine refused a peer's metadata as unauthenticated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum AuthError {
    /// This engine has a key; the metadata carries no tag: the peer was
    /// built without one. Give it the same key.
    #[error("the peer's metadata carries no tag: the peer has no key (give it this engine's)")]
    Missing,
    /// The tag does not check out: the peer holds another key, or the
    /// bytes were altered on the way.
    #[error("the peer's metadata tag does not check out: the peer holds another key, or the bytes were altered")]
    BadTag,
    /// The metadata carries a tag and this engine has no key to check it
    /// with: give this engine the key its peers hold.
    #[error(
        "the peer's metadata carries a tag and this engine has no key: give it the peers' key"
    )]
    Unexpected,
}

/// Counters a receiver of tagged messages keeps per sender: the highest
/// accepted and which of the [`WINDOW`] below it were seen. A message
/// whose counter was seen, or is older than the window, is a replay (or
/// too late to tell from one).
#[derive(Debug, Clone, Default)]
pub(crate) struct Window {
    top: u64,
    /// Bit `i` (word `i / 64`, bit `i % 64`): counter `top - i` was seen.
    seen: [u64; WINDOW / 64],
}

/// Counters a [`Window`] remembers below the highest: how far out of
/// order one sender's messages may arrive (they travel on two endpoints:
/// the sender's own and the reply path of the receiver's messages).
pub(crate) const WINDOW: usize = 1024;

impl Window {
    /// Accepts `counter` (and remembers it) unless it was seen or is too
    /// old. Counter 0 is never sent, so never accepted.
    pub(crate) fn accept(&mut self, counter: u64) -> bool {
        if counter == 0 {
            return false;
        }
        if counter > self.top {
            self.shift((counter - self.top).min(WINDOW as u64) as usize);
            self.top = counter;
            self.seen[0] |= 1;
            return true;
        }
        let back = (self.top - counter) as usize;
        if back >= WINDOW {
            return false;
        }
        let (w, b) = (back / 64, back % 64);
        if self.seen[w] >> b & 1 == 1 {
            return false;
        }
        self.seen[w] |= 1 << b;
        true
    }

    /// Moves every bit `by` places up (counter `top - i` stays itself as
    /// `top` grows by `by`); bits past the window drop.
    fn shift(&mut self, by: usize) {
        let (w, b) = (by / 64, by % 64);
        for i in (0..self.seen.len()).rev() {
            let lo = i.checked_sub(w).map_or(0, |j| self.seen[j] << b);
            let carry = match i.checked_sub(w + 1) {
                Some(j) if b > 0 => self.seen[j] >> (64 - b),
                _ => 0,
            };
            self.seen[i] = lo | carry;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tag_checks_out_only_under_its_key_and_purpose() {
        let k = AuthKey::from_secret(b"0123456789abcdef").unwrap();
        let other = AuthKey::from_secret(b"0123456789abcdeF").unwrap();
        let t = k.tag(Purpose::Metadata, &[b"ab", b"c"]);
        assert!(k.verify(Purpose::Metadata, &[b"abc"], &t));
        assert!(!other.verify(Purpose::Metadata, &[b"abc"], &t));
        assert!(!k.verify(Purpose::Notifications, &[b"abc"], &t));
        assert!(!k.verify(Purpose::Metadata, &[b"abd"], &t));
        assert!(!k.verify(Purpose::Metadata, &[b"abc"], &t[..31]));
    }

    #[test]
    fn a_short_secret_is_refused_and_a_key_is_never_printed() {
        assert!(matches!(
            AuthKey::from_secret(&[7; MIN_SECRET - 1]),
            Err(AuthKeyError::TooShort(15))
        ));
        let k = AuthKey::from_secret(&[7; MIN_SECRET]).unwrap();
        assert_eq!(format!("{k:?}"), "AuthKey(..)");
    }

    #[test]
    fn a_key_file_is_read_without_its_surrounding_white_space() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key");
        std::fs::write(&path, b"  0123456789abcdef\n").unwrap();
        let k = AuthKey::from_file(&path).unwrap();
        let same = AuthKey::from_secret(b"0123456789abcdef").unwrap();
        let t = same.tag(Purpose::Control, &[b"x"]);
        assert!(k.verify(Purpose::Control, &[b"x"], &t));
        assert!(matches!(
            AuthKey::from_file(dir.path().join("none")),
            Err(AuthKeyError::File { .. })
        ));
    }

    #[test]
    fn a_window_accepts_each_counter_once_in_any_order_within_it() {
        let mut w = Window::default();
        assert!(!w.accept(0), "counter 0 is never sent");
        for c in [5u64, 3, 4, 1, 2, 70, 69, 200, 6] {
            assert!(w.accept(c), "{c} first time");
            assert!(!w.accept(c), "{c} again");
        }
        for c in [7u64, 68, 199] {
            assert!(w.accept(c), "{c} unseen, within the window");
        }
        assert!(!w.accept(200) && !w.accept(70) && !w.accept(5));
        let top = 3000u64;
        assert!(w.accept(top));
        assert!(w.accept(top - WINDOW as u64 + 1), "the window's oldest");
        assert!(!w.accept(top - WINDOW as u64), "past the window");
        assert!(w.accept(top + 5 * WINDOW as u64));
        assert!(!w.accept(top), "dropped out of the window");
    }

    #[test]
    fn a_shift_moves_every_seen_counter_with_the_top() {
        let mut w = Window::default();
        let seen: Vec<u64> = (1..=900).step_by(7).collect();
        for &c in &seen {
            assert!(w.accept(c));
        }
        for step in [1u64, 63, 64, 65, 100] {
            let top = w.top + step;
            assert!(w.accept(top));
            for &c in seen.iter().filter(|&&c| top - c < WINDOW as u64) {
                assert!(!w.accept(c), "{c} forgotten after a shift of {step}");
            }
        }
    }
}
