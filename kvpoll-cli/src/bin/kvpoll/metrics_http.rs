//! `kvpoll serve --metrics ADDR`: the engine's metrics over HTTP, for
//! Prometheus to scrape. One thread, one request per connection: a scrape
//! every few seconds needs no more.
//!
//! `GET /metrics` (or `/`) answers the Prometheus text format 0.0.4, or
//! OpenMetrics when the scraper's `Accept` header asks for
//! `application/openmetrics-text`; anything else is 404 or 405.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvpoll::metrics::{
    render, render_text, MetricsSnapshot, OPENMETRICS_CONTENT_TYPE, TEXT_CONTENT_TYPE,
};

/// A request head larger than this is refused.
const MAX_HEAD: usize = 8 * 1024;

/// Binds `addr` and serves `snapshot` from a thread of its own; returns the
/// bound address (port 0 picks a free one).
pub fn start(
    addr: SocketAddr,
    snapshot: Arc<Mutex<MetricsSnapshot>>,
) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr)?;
    let bound = listener.local_addr()?;
    std::thread::Builder::new()
        .name("kvpoll-metrics".into())
        .spawn(move || {
            for stream in listener.incoming() {
                match stream {
                    Ok(s) => {
                        if let Err(e) = answer(s, &snapshot) {
                            tracing::debug!("metrics request: {e}");
                        }
                    }
                    Err(e) => tracing::warn!("metrics listener: {e}"),
                }
            }
        })?;
    Ok(bound)
}

/// What the request asked for.
struct Request {
    method: String,
    path: String,
    openmetrics: bool,
}

/// Reads the request line and headers (bounded in size and time).
fn read_request(stream: &TcpStream) -> std::io::Result<Option<Request>> {
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut reader = BufReader::new(stream.take(MAX_HEAD as u64));
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let mut words = line.split_whitespace();
    let (Some(method), Some(target)) = (words.next(), words.next()) else {
        return Ok(None);
    };
    let path = target.split('?').next().unwrap_or(target).to_owned();
    let method = method.to_owned();
    let mut openmetrics = false;
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            // The head did not end within MAX_HEAD, or the peer closed.
            return Ok(None);
        }
        let header = line.trim_end();
        if header.is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            if name.trim().eq_ignore_ascii_case("accept")
                && value.contains("application/openmetrics-text")
            {
                openmetrics = true;
            }
        }
    }
    Ok(Some(Request {
        method,
        path,
        openmetrics,
    }))
}

fn answer(mut stream: TcpStream, snapshot: &Mutex<MetricsSnapshot>) -> std::io::Result<()> {
    let Some(req) = read_request(&stream)? else {
        return respond(
            &mut stream,
            "400 Bad Request",
            "text/plain",
            b"bad request\n",
        );
    };
    if req.path != "/metrics" && req.path != "/" {
        return respond(
            &mut stream,
            "404 Not Found",
            "text/plain",
            b"try /metrics\n",
        );
    }
    if req.method != "GET" {
        return respond(
            &mut stream,
            "405 Method Not Allowed",
            "text/plain",
            b"GET only\n",
        );
    }
    let snap = snapshot.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let (body, content_type) = if req.openmetrics {
        (render(&snap), OPENMETRICS_CONTENT_TYPE)
    } else {
        (render_text(&snap), TEXT_CONTENT_TYPE)
    };
    match body {
        Ok(body) => respond(&mut stream, "200 OK", content_type, body.as_bytes()),
        Err(_) => respond(
            &mut stream,
            "500 Internal Server Error",
            "text/plain",
            b"rendering failed\n",
        ),
    }
}

fn respond(
    stream: &mut TcpStream,
    status: &str,
    content_type: &str,
    body: &[u8],
) -> std::io::Result<()> {
    write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )?;
    stream.write_all(body)?;
    stream.flush()
}
