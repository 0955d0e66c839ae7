//! Pull: the producer lends, the consumer reads.
//!
//! The producer (a prefill rank) lends blocks to `n` readers with
//! [`Engine::lend`] and hands the returned [`Incarnation`] to them with the
//! block ids; each consumer (a decode rank) reads them with
//! [`Engine::read`], one [`Transfer`] per producer it reads from.
//!
//! Guarantees:
//! - **Exactly once.** Each request is reported once over the engine's
//!   life: a read in `finished_recving` or `failed_recving`, a lend in
//!   `finished_sending` or `expired`.
//! - **Never before quiescence.** A read is reported only once every one
//!   of its handles stopped (completed, failed or was cancelled): no byte
//!   of it lands after its report. A failed read names the local blocks
//!   whose contents are invalid ([`Outcomes::blocks_of`]).
//! - **The lease is a fence.** A lend is released (`finished_sending`)
//!   when its `n` readers notified; at its lease's end it is `expired`.
//!   With read confirmation on (the default) a reader asks its lender
//!   before it reports: a read that outlived its lend fails
//!   (`Cause::LeaseLost`) rather than finish with bytes of a request that
//!   reused the blocks.
//! - **Read before lend.** A read that reaches its lender before the lend
//!   does is answered once the lend arrives, within
//!   [`EngineBuilder::lend_grace`].
//! - **Incarnations.** Every lend is a fresh incarnation: a late note
//!   about an earlier lend of the same request id never touches the next
//!   one, so ids may be reused once reported.
//!
//! ```
//! use std::time::Duration;
//! use kvpoll::{BlockId, Engine, Error, Outcomes, RequestId, Transfer};
//!
//! let mut prefill = Engine::builder().block_size(4096).build()?;
//! let mut decode = Engine::builder().block_size(4096).build()?;
//! prefill.register(8)?;
//! decode.register(8)?;
//! prefill.write_block(0, BlockId(3), &[1u8; 4096])?;
//! let peer = decode.add_peer(&prefill.local_metadata()?)?;
//!
//! let id = RequestId(1);
//! let lend = prefill.lend(id, &[BlockId(3)], 1, Duration::from_secs(30))?;
//! let t = Transfer { peer, local: &[BlockId(0)], remote: &[BlockId(3)], lend };
//! decode.read(id, &[t])?;
//!
//! let mut out = Outcomes::default();
//! while out.finished_recving.is_empty() && out.failed_recving.is_empty() {
//!     decode.wait(&mut out, Duration::from_millis(10));
//! }
//! assert_eq!(out.finished_recving, [id]);
//! let mut kv = [0u8; 4096];
//! decode.read_block(0, BlockId(0), &mut kv)?;
//! assert_eq!(kv, [1u8; 4096]);
//!
//! // The reader's word released the lend.
//! let mut freed = Outcomes::default();
//! while freed.finished_sending.is_empty() {
//!     prefill.wait(&mut freed, Duration::from_millis(10));
//! }
//! assert_eq!(freed.finished_sending, [id]);
//! # Ok::<(), Error>(())
//! ```

#[allow(unused_imports)] // the links above
use crate::{Engine, EngineBuilder, Incarnation, Outcomes, Transfer};
