//! Push: the consumer opens a receive, the producer writes.
//!
//! The consumer (a decode rank) opens a receive of its blocks for `n`
//! writers with [`Engine::receive`] (or names them with
//! [`Engine::receive_from`]) and hands the returned [`Incarnation`] to
//! them with the block ids; each producer (a prefill rank) writes into
//! them with [`Engine::write`]. The consumer acknowledges on an endpoint
//! of its own: each side adds the other as a peer.
//!
//! Guarantees:
//! - **Exactly once.** A write is reported once, in `finished_sending`,
//!   `failed_sending` or `expired`; a receive in `finished_recving` or
//!   `failed_recving`.
//! - **Done means landed.** A write is done only after every put
//!   completed, was flushed on the endpoint it travelled on, and each of
//!   the `expected_acks` consumer engines acknowledged it; a failed or
//!   aborted write is never done, and is reported with its reason once
//!   quiescent.
//! - **The lease is a fence.** A receive whose lease ends with a writer
//!   still silent keeps its blocks quarantined (not reported, so not
//!   reused) until that writer speaks or its peer is lost: a stalled
//!   writer's late put never lands in blocks reused by another request.
//! - **Incarnations.** Every receive is a fresh incarnation, named by each
//!   write's [`Transfer::lend`]: a write aimed at an earlier receive of the
//!   same id is refused.
//!
//! ```
//! use std::time::Duration;
//! use kvpoll::{BlockId, Engine, Error, Outcomes, RequestId, Transfer};
//!
//! let mut prefill = Engine::builder().block_size(4096).build()?;
//! let mut decode = Engine::builder().block_size(4096).build()?;
//! prefill.register(8)?;
//! decode.register(8)?;
//! prefill.write_block(0, BlockId(2), &[9u8; 4096])?;
//! let peer = prefill.add_peer(&decode.local_metadata()?)?;
//! decode.add_peer(&prefill.local_metadata()?)?; // acknowledgements travel on it
//!
//! let id = RequestId(7);
//! let lend = decode.receive(id, &[BlockId(5)], 1, Duration::from_secs(30))?;
//! let t = Transfer { peer, local: &[BlockId(2)], remote: &[BlockId(5)], lend };
//! prefill.write(id, &[t], 1, Duration::from_secs(30))?;
//!
//! let mut sent = Outcomes::default();
//! while sent.finished_sending.is_empty() && sent.failed_sending.is_empty() && sent.expired.is_empty() {
//!     prefill.wait(&mut sent, Duration::from_millis(10));
//! }
//! assert_eq!(sent.finished_sending, [id]);
//!
//! let mut got = Outcomes::default();
//! while got.finished_recving.is_empty() && got.failed_recving.is_empty() {
//!     decode.wait(&mut got, Duration::from_millis(10));
//! }
//! assert_eq!(got.finished_recving, [id]);
//! let mut kv = [0u8; 4096];
//! decode.read_block(0, BlockId(5), &mut kv)?;
//! assert_eq!(kv, [9u8; 4096]);
//! # Ok::<(), Error>(())
//! ```

#[allow(unused_imports)] // the links above
use crate::{Engine, Incarnation, Transfer};
