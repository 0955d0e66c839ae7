//! Bounded SPSC rings between the engine thread and a poller, over `rtrb`.
//!
//! - [`commands`](crate::ring::commands): engine → poller. A full ring
//!   refuses the command ([`Full`](crate::ring::Full)) and hands it back:
//!   the engine retries later (back-pressure on submission).
//! - [`events`](crate::ring::events): poller → engine. Events are never
//!   dropped: when the ring is full the poller keeps them, in order, in a
//!   local overflow and moves them on with
//!   [`EventPublisher::flush`](crate::ring::EventPublisher::flush) (call it
//!   every loop iteration). Past the overflow's bound the event is still
//!   kept, and [`EventPublisher::publish`](crate::ring::EventPublisher::publish)
//!   answers [`Backpressure`](crate::ring::Backpressure): the poller must
//!   stop taking new work until the engine catches up. What can still arrive
//!   then is bounded by the requests in flight (one report each, plus
//!   failure notices), so the overflow stays bounded too; only beyond its
//!   bound does it allocate.
//!
//! ```
//! use kvpoll::ring::events;
//! let (mut tx, mut rx) = events::<u32>(2, 4);
//! for i in 0..5 {
//!     tx.publish(i).unwrap(); // the ring holds 2, the overflow the rest
//! }
//! assert_eq!(tx.overflowed(), 3);
//! let mut got = Vec::new();
//! while got.len() < 5 {
//!     while let Some(e) = rx.recv() {
//!         got.push(e);
//!     }
//!     tx.flush();
//! }
//! assert_eq!(got, [0, 1, 2, 3, 4]);
//! ```

#![warn(missing_docs)]

use std::collections::VecDeque;

use rtrb::{Consumer, Producer, PushError, RingBuffer};

/// The command ring was full: the command is handed back.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("command ring full: the poller is behind; retry the command later")]
pub struct Full<T>(pub T);

/// The event overflow passed its bound (the event was kept): stop taking new
/// work until the engine drains its events.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("event overflow holds {pending} events (bound {bound}): stop taking new work")]
pub struct Backpressure {
    /// Events waiting in the overflow.
    pub pending: usize,
    /// The overflow's bound.
    pub bound: usize,
}

/// Engine side of a command ring.
pub struct CommandSender<T> {
    ring: Producer<T>,
}

/// Poller side of a command ring.
pub struct CommandReceiver<T> {
    ring: Consumer<T>,
}

/// A command ring holding `capacity` commands.
///
/// ```
/// let (mut tx, mut rx) = kvpoll::ring::commands::<u8>(1);
/// tx.send(1).unwrap();
/// assert_eq!(tx.send(2), Err(kvpoll::ring::Full(2)));
/// assert_eq!(rx.recv(), Some(1));
/// ```
pub fn commands<T>(capacity: usize) -> (CommandSender<T>, CommandReceiver<T>) {
    let (p, c) = RingBuffer::new(capacity);
    (CommandSender { ring: p }, CommandReceiver { ring: c })
}

impl<T> CommandSender<T> {
    /// The most commands the ring holds: a batch larger than this can never
    /// be sent.
    pub fn capacity(&self) -> usize {
        self.ring.buffer().capacity()
    }

    /// Commands waiting in the ring.
    pub fn occupancy(&self) -> usize {
        self.capacity() - self.ring.slots()
    }

    /// Sends `cmd`, or hands it back if the ring is full.
    pub fn send(&mut self, cmd: T) -> Result<(), Full<T>> {
        self.ring.push(cmd).map_err(|PushError::Full(c)| Full(c))
    }
}

impl<T: Copy> CommandSender<T> {
    /// Sends every command of `cmds`, or none of them when the ring lacks
    /// room for all: a multi-entry command (a request and its plan) is never
    /// seen half-written by the receiver.
    pub fn send_all(&mut self, cmds: &[T]) -> Result<(), Full<usize>> {
        match self.ring.write_chunk_uninit(cmds.len()) {
            Ok(chunk) => {
                chunk.fill_from_iter(cmds.iter().copied());
                Ok(())
            }
            Err(_) => Err(Full(cmds.len())),
        }
    }
}

impl<T> CommandReceiver<T> {
    /// The next command, if any.
    pub fn recv(&mut self) -> Option<T> {
        self.ring.pop().ok()
    }

    /// Whether no command is waiting.
    pub fn is_empty(&self) -> bool {
        self.ring.is_empty()
    }
}

/// Poller side of an event ring.
pub struct EventPublisher<T> {
    ring: Producer<T>,
    overflow: VecDeque<T>,
    bound: usize,
    overflowed: u64,
    high_water: usize,
}

/// Engine side of an event ring.
pub struct EventReceiver<T> {
    ring: Consumer<T>,
}

/// An event ring holding `capacity` events, with a local overflow of
/// `overflow` events on the poller side (allocated now).
pub fn events<T>(capacity: usize, overflow: usize) -> (EventPublisher<T>, EventReceiver<T>) {
    let (p, c) = RingBuffer::new(capacity);
    (
        EventPublisher {
            ring: p,
            overflow: VecDeque::with_capacity(overflow),
            bound: overflow,
            overflowed: 0,
            high_water: 0,
        },
        EventReceiver { ring: c },
    )
}

impl<T> EventPublisher<T> {
    /// Publishes `event`, keeping order: straight into the ring when nothing
    /// waits, else behind the waiting ones in the overflow. Never drops it;
    /// `Err` says the overflow passed its bound.
    pub fn publish(&mut self, event: T) -> Result<(), Backpressure> {
        if self.overflow.is_empty() {
            match self.ring.push(event) {
                Ok(()) => return Ok(()),
                Err(PushError::Full(e)) => return self.keep(e),
            }
        }
        self.flush();
        if self.overflow.is_empty() {
            if let Err(PushError::Full(e)) = self.ring.push(event) {
                return self.keep(e);
            }
            return Ok(());
        }
        self.keep(event)
    }

    fn keep(&mut self, event: T) -> Result<(), Backpressure> {
        self.overflow.push_back(event);
        self.overflowed += 1;
        self.high_water = self.high_water.max(self.overflow.len());
        if self.overflow.len() > self.bound {
            return Err(Backpressure {
                pending: self.overflow.len(),
                bound: self.bound,
            });
        }
        Ok(())
    }

    /// Moves waiting events into the ring while it has room; returns how many
    /// still wait.
    pub fn flush(&mut self) -> usize {
        while let Some(e) = self.overflow.pop_front() {
            if let Err(PushError::Full(e)) = self.ring.push(e) {
                self.overflow.push_front(e);
                break;
            }
        }
        self.overflow.len()
    }

    /// Events waiting in the overflow.
    pub fn pending(&self) -> usize {
        self.overflow.len()
    }

    /// Whether the overflow is past its bound (stop taking new work).
    pub fn is_backpressured(&self) -> bool {
        self.overflow.len() > self.bound
    }

    /// Events that ever had to wait in the overflow.
    pub fn overflowed(&self) -> u64 {
        self.overflowed
    }

    /// The most events that waited at once.
    pub fn high_water(&self) -> usize {
        self.high_water
    }
}

impl<T> EventReceiver<T> {
    /// The next event, if any.
    pub fn recv(&mut self) -> Option<T> {
        self.ring.pop().ok()
    }

    /// Events waiting in the ring.
    pub fn occupancy(&self) -> usize {
        self.ring.slots()
    }

    /// The most events the ring holds.
    pub fn capacity(&self) -> usize {
        self.ring.buffer().capacity()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_event_ring_keeps_order_through_overflow_and_never_drops() {
        let (mut tx, mut rx) = events::<u32>(4, 8);
        let mut got = Vec::new();
        for i in 0..100 {
            if tx.publish(i).is_err() {
                // Back-pressure: the engine catches up before new work.
                while let Some(e) = rx.recv() {
                    got.push(e);
                }
                tx.flush();
            }
        }
        while got.len() < 100 {
            while let Some(e) = rx.recv() {
                got.push(e);
            }
            tx.flush();
        }
        assert_eq!(got, (0..100).collect::<Vec<_>>());
        assert!(tx.overflowed() > 0);
        assert_eq!(tx.pending(), 0);
    }

    #[test]
    fn overflow_past_its_bound_answers_backpressure_and_keeps_the_event() {
        let (mut tx, mut rx) = events::<u32>(1, 2);
        assert!(tx.publish(0).is_ok()); // ring
        assert!(tx.publish(1).is_ok()); // overflow 1
        assert!(tx.publish(2).is_ok()); // overflow 2
        assert_eq!(
            tx.publish(3),
            Err(Backpressure {
                pending: 3,
                bound: 2
            })
        );
        assert!(tx.is_backpressured());
        let mut got = Vec::new();
        while got.len() < 4 {
            if let Some(e) = rx.recv() {
                got.push(e);
            }
            tx.flush();
        }
        assert_eq!(got, [0, 1, 2, 3]);
        assert!(!tx.is_backpressured());
        assert_eq!(tx.high_water(), 3);
    }

    #[test]
    fn full_command_ring_hands_the_command_back() {
        let (mut tx, mut rx) = commands::<u32>(2);
        tx.send(1).unwrap();
        tx.send(2).unwrap();
        assert_eq!(tx.send(3), Err(Full(3)));
        assert_eq!(rx.recv(), Some(1));
        tx.send(3).unwrap();
        assert_eq!((rx.recv(), rx.recv(), rx.recv()), (Some(2), Some(3), None));
    }
}
