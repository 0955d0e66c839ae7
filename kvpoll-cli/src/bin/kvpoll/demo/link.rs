//! A TCP connection carrying [`Msg`] lines: a reader thread turns incoming
//! lines into events on a channel; writes go straight to the socket.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::sync::mpsc::Sender;

use super::proto::Msg;

/// What a reader thread reports.
pub enum Incoming {
    /// A new connection (sent before any of its lines, on the same channel).
    Opened(usize, TcpStream),
    Line(usize, Msg),
    Bad(usize),
    Closed(usize),
}

/// Starts a reader for `stream`, tagging what it reads with `tag`.
pub fn spawn_reader(stream: &TcpStream, tag: usize, tx: Sender<Incoming>) -> std::io::Result<()> {
    let reader = stream.try_clone()?;
    std::thread::spawn(move || {
        let mut lines = BufReader::new(reader);
        let mut line = String::new();
        loop {
            line.clear();
            match lines.read_line(&mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let ev = match Msg::parse(&line) {
                        Ok(m) => Incoming::Line(tag, m),
                        Err(_) => Incoming::Bad(tag),
                    };
                    if tx.send(ev).is_err() {
                        return;
                    }
                }
            }
        }
        let _ = tx.send(Incoming::Closed(tag));
    });
    Ok(())
}

/// Sends one message; a failed write means the link is gone.
pub fn send(stream: &mut TcpStream, msg: &Msg) -> bool {
    stream.write_all(msg.to_line().as_bytes()).is_ok()
}
