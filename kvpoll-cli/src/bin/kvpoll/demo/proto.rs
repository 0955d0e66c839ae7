//! The demo's control protocol between a decode rank and a prefill rank:
//! one text line a message over TCP. Everything read is validated; a bad
//! line is an error, never a panic.

use std::fmt::Write as _;

use kvpoll::wire::{from_hex, to_hex};

/// Most blocks one message may name.
pub const MAX_BLOCKS: usize = 4096;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Msg {
    /// Engine metadata (both directions, first thing on a connection).
    Meta(Vec<u8>),
    /// Decode → prefill: fill `n` blocks for request `req` and lend them.
    Prepare { req: u64, n: u32 },
    /// Prefill → decode: the blocks to read.
    Ready { req: u64, blocks: Vec<u32> },
    /// Prefill → decode: no free blocks now; the request is not served.
    Busy { req: u64 },
    /// Decode → prefill: write request `req` into these (lent) blocks.
    Push { req: u64, blocks: Vec<u32> },
    /// Prefill → decode: the push was done (acknowledged) or not.
    Pushed { req: u64, done: bool },
    /// Coordinator → prefill: stop progressing for `ms` (fault injection).
    Stall { ms: u64 },
    /// Coordinator → prefill: report block accounting.
    Stats,
    /// Prefill → coordinator: blocks in the pool, free, and poller counters.
    StatsReply {
        total: u64,
        free: u64,
        busy: u64,
        idle: u64,
    },
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProtoError {
    #[error("empty line")]
    Empty,
    #[error("unknown message {0:?}")]
    Unknown(String),
    #[error("message {0}: missing or bad field {1}")]
    Field(&'static str, &'static str),
    #[error("message names more than {MAX_BLOCKS} blocks")]
    TooManyBlocks,
}

fn blocks_text(out: &mut String, blocks: &[u32]) {
    for b in blocks {
        let _ = write!(out, " {b}");
    }
}

impl Msg {
    pub fn to_line(&self) -> String {
        let mut s = String::new();
        match self {
            Msg::Meta(m) => s = format!("META {}", to_hex(m)),
            Msg::Prepare { req, n } => s = format!("PREPARE {req} {n}"),
            Msg::Ready { req, blocks } => {
                s = format!("READY {req}");
                blocks_text(&mut s, blocks);
            }
            Msg::Busy { req } => s = format!("BUSY {req}"),
            Msg::Push { req, blocks } => {
                s = format!("PUSH {req}");
                blocks_text(&mut s, blocks);
            }
            Msg::Pushed { req, done } => s = format!("PUSHED {req} {}", u8::from(*done)),
            Msg::Stall { ms } => s = format!("STALL {ms}"),
            Msg::Stats => s.push_str("STATS"),
            Msg::StatsReply {
                total,
                free,
                busy,
                idle,
            } => s = format!("STATSREPLY {total} {free} {busy} {idle}"),
        }
        s.push('\n');
        s
    }

    pub fn parse(line: &str) -> Result<Msg, ProtoError> {
        let mut w = line.split_ascii_whitespace();
        let verb = w.next().ok_or(ProtoError::Empty)?;
        let mut num = |m: &'static str, f: &'static str| -> Result<u64, ProtoError> {
            w.next()
                .and_then(|x| x.parse().ok())
                .ok_or(ProtoError::Field(m, f))
        };
        let msg = match verb {
            "META" => {
                let hex = line["META".len()..].trim();
                Msg::Meta(from_hex(hex).map_err(|_| ProtoError::Field("META", "hex"))?)
            }
            "PREPARE" => Msg::Prepare {
                req: num("PREPARE", "req")?,
                n: u32::try_from(num("PREPARE", "n")?)
                    .map_err(|_| ProtoError::Field("PREPARE", "n"))?,
            },
            "READY" | "PUSH" => {
                let req = num(if verb == "READY" { "READY" } else { "PUSH" }, "req")?;
                let mut blocks = Vec::new();
                for x in w {
                    if blocks.len() == MAX_BLOCKS {
                        return Err(ProtoError::TooManyBlocks);
                    }
                    blocks.push(
                        x.parse()
                            .map_err(|_| ProtoError::Field("READY/PUSH", "block"))?,
                    );
                }
                if verb == "READY" {
                    Msg::Ready { req, blocks }
                } else {
                    Msg::Push { req, blocks }
                }
            }
            "BUSY" => Msg::Busy {
                req: num("BUSY", "req")?,
            },
            "PUSHED" => Msg::Pushed {
                req: num("PUSHED", "req")?,
                done: num("PUSHED", "done")? == 1,
            },
            "STALL" => Msg::Stall {
                ms: num("STALL", "ms")?,
            },
            "STATS" => Msg::Stats,
            "STATSREPLY" => Msg::StatsReply {
                total: num("STATSREPLY", "total")?,
                free: num("STATSREPLY", "free")?,
                busy: num("STATSREPLY", "busy")?,
                idle: num("STATSREPLY", "idle")?,
            },
            other => return Err(ProtoError::Unknown(other.chars().take(32).collect())),
        };
        Ok(msg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_message_round_trips() {
        for m in [
            Msg::Meta(vec![1, 2, 255]),
            Msg::Prepare { req: 9, n: 4 },
            Msg::Ready {
                req: 9,
                blocks: vec![1, 2, 3],
            },
            Msg::Busy { req: 3 },
            Msg::Push {
                req: 9,
                blocks: vec![7],
            },
            Msg::Pushed { req: 9, done: true },
            Msg::Stall { ms: 500 },
            Msg::Stats,
            Msg::StatsReply {
                total: 8,
                free: 8,
                busy: 1,
                idle: 2,
            },
        ] {
            assert_eq!(Msg::parse(&m.to_line()), Ok(m));
        }
    }

    #[test]
    fn bad_lines_are_errors() {
        assert!(Msg::parse("").is_err());
        assert!(Msg::parse("PREPARE x 1").is_err());
        assert!(Msg::parse("READY 1 2 zz").is_err());
        assert!(Msg::parse("META 0g").is_err());
        assert!(Msg::parse("LAUNCH").is_err());
    }
}
