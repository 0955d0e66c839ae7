//! `kvpoll ucx-peer`: a process that registers a region filled with a known
//! pattern, prints its worker address and rkey on one line, and serves UCX
//! until its standard input closes. The two-process tests drive it.
//!
//! Output: `READY <hex worker address> <hex packed rkey>`.

use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kvpoll::transport::ucx::{Context, ContextOptions, MemoryRegion, Worker, NOTIFY_AM_ID};
use kvpoll::wire::to_hex;

use crate::cli::{CliError, EnginePeerArgs, UcxPeerArgs};

/// A flag that turns true when standard input closes: how a child process
/// learns that its parent is done with it.
pub fn stdin_closed() -> Arc<AtomicBool> {
    let closed = Arc::new(AtomicBool::new(false));
    let flag = closed.clone();
    std::thread::spawn(move || {
        let mut sink = [0u8; 64];
        let mut stdin = std::io::stdin();
        while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
        flag.store(true, Ordering::Release);
    });
    closed
}

pub fn run(args: &UcxPeerArgs) -> Result<(), CliError> {
    let UcxPeerArgs {
        ref tls,
        blocks,
        block_size,
        seed,
    } = *args;
    let fail = |e: kvpoll::transport::ucx::UcxError| CliError::Failed(e.to_string());

    let ctx = Context::new(&ContextOptions::with_transports(tls)).map_err(fail)?;
    let worker = Worker::new(&ctx).map_err(fail)?;
    // The e2e bench's raw loop notifies this peer once per request, as a
    // kvpoll reader notifies its producer: take them, drop them.
    worker.listen_active_messages(NOTIFY_AM_ID).map_err(fail)?;
    let len = blocks
        .checked_mul(block_size)
        .filter(|&l| l > 0 && l <= 1 << 34)
        .ok_or_else(|| CliError::Failed("region size out of range".into()))?;
    let region = MemoryRegion::allocate(&ctx, len as usize).map_err(fail)?;
    let mut block = vec![0u8; block_size as usize];
    for b in 0..blocks {
        kvpoll_cli::pattern::fill(seed, b, &mut block);
        region.write(b * block_size, &block).map_err(fail)?;
    }
    let addr = worker.address().map_err(fail)?;
    let rkey = region.pack_rkey().map_err(fail)?;
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "READY {} {}",
        to_hex(addr.as_bytes()),
        to_hex(rkey.as_bytes())
    )
    .and_then(|_| out.flush())
    .map_err(|e| CliError::Failed(format!("writing to stdout: {e}")))?;
    drop(out);

    let closed = stdin_closed();
    // Over tcp the target of a get must progress to answer it. Spin while
    // there is work; when there is none, block on the worker's event fd
    // (as a kvpoll poller does, so that the e2e bench's raw loop is not
    // slowed by a napping peer), 10 ms at most to notice stdin closing.
    let mut idle = 0u32;
    while !closed.load(Ordering::Acquire) {
        let events = worker.progress();
        worker.take_active_messages(|_| {});
        if events > 0 {
            idle = 0;
            continue;
        }
        idle += 1;
        if idle >= 256 {
            if worker.event_fd().is_none() {
                std::thread::sleep(std::time::Duration::from_micros(50));
            } else {
                // Not armed (events pending): the next progress takes them.
                let _ = worker.wait(std::time::Duration::from_millis(10));
            }
        }
    }
    Ok(())
}

/// `kvpoll engine-peer`: a whole kvpoll engine in its own process, serving
/// its blocks (filled with the pattern of `--seed`) to readers. Prints
/// `READY <hex metadata>` (after the `LENT` lines of what it lent ahead)
/// and runs until its standard input closes.
pub fn run_engine(args: &EnginePeerArgs) -> Result<(), CliError> {
    let EnginePeerArgs {
        ref tls,
        blocks,
        block_size,
        seed,
        regions,
        lend_ahead,
    } = *args;
    let regions = usize::from(regions);
    let fail = |e: kvpoll::EngineError| CliError::Failed(e.to_string());
    let mut builder = kvpoll::Engine::builder()
        .block_size(block_size)
        .ucx(ContextOptions::with_transports(tls));
    if lend_ahead > 0 {
        // Room for what is lent ahead, and for as many reported but not
        // yet polled.
        builder = builder.ledger(2 * lend_ahead + 64, 8);
    }
    let mut engine = builder.build().map_err(fail)?;
    let mut block = vec![0u8; block_size as usize];
    for r in 0..regions {
        engine.register(blocks).map_err(fail)?;
        for b in 0..blocks {
            // Region r of rank `seed` holds the pattern of seed*100 + r.
            kvpoll_cli::pattern::fill(seed * 100 + r as u64, b, &mut block);
            engine
                .write_block(r, kvpoll::BlockId(b as u32), &block)
                .map_err(fail)?;
        }
    }
    // Lent before READY: the reader's first reads find their lends.
    let mut lender = Lender::new(lend_ahead);
    lender.top_up(&mut engine).map_err(fail)?;
    let meta = engine.local_metadata().map_err(fail)?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "READY {}", to_hex(&meta))
        .and_then(|_| out.flush())
        .map_err(|e| CliError::Failed(format!("writing to stdout: {e}")))?;
    drop(out);
    let closed = stdin_closed();
    let mut outcomes = kvpoll::Outcomes::default();
    let mut quiet = 0u32;
    while !closed.load(Ordering::Acquire) {
        outcomes.clear();
        engine.poll(&mut outcomes);
        let ended = outcomes.finished_sending.len() + outcomes.expired.len();
        lender.released += ended as u64;
        lender.top_up(&mut engine).map_err(fail)?;
        // A lender whose reader is reading looks often enough to stay
        // ahead of it (100 µs at most); otherwise, as a peer that lends
        // nothing, it only keeps its engine drained (every 1 ms), and
        // leaves the CPU to the runs that do not read from it.
        quiet = if ended == 0 {
            quiet.saturating_add(1)
        } else {
            0
        };
        let nap = if lend_ahead > 0 && quiet < 100 {
            100
        } else {
            1000
        };
        if ended == 0 {
            std::thread::sleep(std::time::Duration::from_micros(nap));
        }
    }
    engine.shutdown();
    Ok(())
}

/// Lends request ids in order, `ahead` more than were released.
struct Lender {
    ahead: u64,
    next: u64,
    released: u64,
}

impl Lender {
    fn new(ahead: u32) -> Self {
        Lender {
            ahead: u64::from(ahead),
            next: 0,
            released: 0,
        }
    }

    /// Lends up to `ahead` past what was released, printing `LENT <id>
    /// <incarnation, hex>` for each: the reader reads each id with that
    /// incarnation.
    fn top_up(&mut self, engine: &mut kvpoll::Engine) -> Result<(), kvpoll::EngineError> {
        let mut lent = String::new();
        while self.next < self.released + self.ahead {
            let inc = engine.lend(
                kvpoll::RequestId(self.next),
                &[kvpoll::BlockId(0)],
                1,
                std::time::Duration::from_secs(3600),
            )?;
            lent.push_str(&format!("LENT {} {:x}\n", self.next, inc.0));
            self.next += 1;
        }
        if !lent.is_empty() {
            let mut out = std::io::stdout().lock();
            // A reader that went away leaves nobody to tell: not an error.
            let _ = out.write_all(lent.as_bytes()).and_then(|_| out.flush());
        }
        Ok(())
    }
}
