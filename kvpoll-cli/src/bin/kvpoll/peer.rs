//! `kvpoll ucx-peer`: a process that registers a region filled with a known
//! pattern, prints its worker address and rkey on one line, and serves UCX
//! until its standard input closes. The two-process tests drive it.
//!
//! Output: `READY <hex worker address> <hex packed rkey>`.

use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvpoll::transport::ucx::{Context, ContextOptions, MemoryRegion, Worker, NOTIFY_AM_ID};
use kvpoll::wire::to_hex;

use kvpoll_cli::bench::memory::CallerMemory;

use crate::cli::{CliError, EnginePeerArgs, MemPeerArgs, PeerLendTo, PeerMemory, UcxPeerArgs};

/// A flag that turns true when standard input closes: how a child process
/// learns that its parent is done with it.
pub fn stdin_closed() -> Arc<AtomicBool> {
    stdin_closed_then(|| {})
}

/// [`stdin_closed`], calling `then` once the flag turned true: a process
/// that blocks on something else (its engine's reports) is woken by it.
pub fn stdin_closed_then(then: impl FnOnce() + Send + 'static) -> Arc<AtomicBool> {
    let closed = Arc::new(AtomicBool::new(false));
    let flag = closed.clone();
    std::thread::spawn(move || {
        let mut sink = [0u8; 64];
        let mut stdin = std::io::stdin();
        while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
        flag.store(true, Ordering::Release);
        then();
    });
    closed
}

pub fn run(args: &UcxPeerArgs) -> Result<(), CliError> {
    let UcxPeerArgs {
        ref tls,
        pattern:
            MemPeerArgs {
                blocks,
                block_size,
                seed,
            },
        memory,
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
    // Dropped after the region that maps it.
    let mut caller = None;
    let region = match memory {
        PeerMemory::Ucx => MemoryRegion::allocate(&ctx, len as usize).map_err(fail)?,
        PeerMemory::Caller => {
            let m = caller.insert(CallerMemory::new(len as usize).map_err(mapping)?);
            // SAFETY: the mapping outlives the region (dropped after it).
            unsafe { MemoryRegion::map(&ctx, m.as_ptr(), len as usize) }.map_err(fail)?
        }
    };
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
    let _ = &caller;
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
        ref auth,
        blocks,
        block_size,
        seed,
        regions,
        lend_ahead,
        lend_blocks,
        lend_to,
        check_every,
        writer_seed,
        memory,
        command_ring,
    } = *args;
    let regions = usize::from(regions);
    fn fail(e: impl std::fmt::Display) -> CliError {
        CliError::Failed(e.to_string())
    }
    let mut builder = kvpoll::Engine::builder()
        .block_size(block_size)
        .ucx(ContextOptions::with_transports(tls))
        .auth_key(auth.key()?);
    if lend_ahead > 0 {
        // Room for what is lent ahead, and for as many reported but not
        // yet polled.
        builder = builder.ledger(2 * lend_ahead + 64, lend_blocks.max(8));
    }
    if let Some(entries) = command_ring {
        builder = builder.command_ring(entries as usize);
    }
    // Caller memory outlives the engine (declared first, dropped last).
    let mut mappings = Vec::new();
    let mut engine = builder.build().map_err(fail)?;
    let mut block = vec![0u8; block_size as usize];
    for r in 0..regions {
        match memory {
            PeerMemory::Ucx => engine.register(blocks).map_err(fail)?,
            PeerMemory::Caller => {
                let len = blocks
                    .checked_mul(block_size)
                    .and_then(|l| usize::try_from(l).ok())
                    .ok_or_else(|| CliError::Failed("region size out of range".into()))?;
                let m = CallerMemory::new(len).map_err(mapping)?;
                // SAFETY: the mapping lives in `mappings` until after the
                // engine shut down and dropped.
                let i = unsafe { engine.register_memory(m.as_ptr(), len) }.map_err(fail)?;
                mappings.push(m);
                i
            }
        };
        for b in 0..blocks {
            // Region r of rank `seed` holds the pattern of seed*100 + r.
            kvpoll_cli::pattern::fill(seed * 100 + r as u64, b, &mut block);
            engine
                .write_block(r, kvpoll::BlockId(b as u32), &block)
                .map_err(fail)?;
        }
    }
    // Lent before READY: the reader's first reads find their lends.
    let mut lender = Lender {
        ahead: u64::from(lend_ahead),
        next: 0,
        released: 0,
        blocks_each: u64::from(lend_blocks),
        blocks,
        to: lend_to,
        ids: Vec::new(),
        regions,
        check_every,
        writer_seed,
    };
    let mut outcomes = kvpoll::Outcomes::default();
    lender.catch_up(&mut engine, &mut outcomes)?;
    let meta = engine.local_metadata().map_err(fail)?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "READY {}", to_hex(&meta))
        .and_then(|_| out.flush())
        .map_err(|e| CliError::Failed(format!("writing to stdout: {e}")))?;
    drop(out);
    if lend_to == PeerLendTo::Writers {
        // A push destination acknowledges its writers: it must know them.
        // The first line on standard input is `PEER <hex metadata>`.
        let mut line = String::new();
        std::io::stdin()
            .read_line(&mut line)
            .map_err(|e| CliError::Failed(format!("reading the writer's metadata: {e}")))?;
        let meta = line
            .trim()
            .strip_prefix("PEER ")
            .and_then(|h| kvpoll::wire::from_hex(h).ok())
            .ok_or_else(|| CliError::Failed("expected PEER <hex metadata> first".into()))?;
        engine.add_peer(&meta).map_err(fail)?;
    }
    let waker = engine.waker();
    let closed = stdin_closed_then(move || waker.wake());
    while !closed.load(Ordering::Acquire) {
        // Woken by its engine's reports (a reader's release of a lend, a
        // write that landed), as a serving engine that waits for its
        // transfers would be, or by standard input closing (otherwise once
        // a second): a lender that woke every millisecond to look at standard
        // input spent 0.47-0.61 ms of CPU a 64 MiB read, which the bench
        // counts against the transfer.
        lender.take_reports(&mut engine, &mut outcomes, Duration::from_secs(1))?;
        lender.catch_up(&mut engine, &mut outcomes)?;
    }
    engine.shutdown();
    drop(engine);
    drop(mappings);
    Ok(())
}

fn mapping(e: std::io::Error) -> CliError {
    CliError::Failed(format!("mapping caller memory: {e}"))
}

/// Checks the blocks of every `check_every`th push destination that ended
/// well against the writers' pattern (region r: `writer_seed*100 + r`,
/// remote block b written from the writer's block b), printing `CHECKED
/// <id> ok|bad`.
fn check_received(
    engine: &kvpoll::Engine,
    outcomes: &kvpoll::Outcomes,
    lender: &Lender,
) -> Result<(), CliError> {
    let mut buf = vec![0u8; engine.block_size() as usize];
    let mut lines = String::new();
    let seed = lender.writer_seed;
    for id in &outcomes.finished_recving {
        if id.0 % u64::from(lender.check_every) != 0 {
            continue;
        }
        let mut ok = true;
        for b in lender.blocks_of(id.0) {
            for r in 0..lender.regions {
                engine
                    .read_block(r, b, &mut buf)
                    .map_err(|e| CliError::Failed(e.to_string()))?;
                ok &= kvpoll_cli::pattern::check(seed * 100 + r as u64, u64::from(b.0), &buf);
            }
        }
        lines.push_str(&format!(
            "CHECKED {} {}\n",
            id.0,
            if ok { "ok" } else { "bad" }
        ));
    }
    if !lines.is_empty() {
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(lines.as_bytes()).and_then(|_| out.flush());
    }
    Ok(())
}

/// How long a lender whose command ring is full waits for its engine's
/// reports before it lends again: its poller drains the ring meanwhile.
const RING_FULL_WAIT: Duration = Duration::from_micros(50);

/// Lends made between two looks at the engine's reports while lending
/// ahead: the lender polls as it lends, so that what its readers
/// released is taken in (and their slots lent again) without waiting
/// for thousands of lends to be queued first.
const LENDS_PER_POLL: u32 = 256;

/// Where lending ahead stopped.
enum TopUp {
    /// Caught up: `ahead` past what was released.
    CaughtUp,
    /// [`LENDS_PER_POLL`] lends made: look at the reports, lend on.
    Batch,
    /// The command ring is full (the poller is behind): wait a little
    /// for the reports, lend on.
    RingFull,
}

/// Lends request ids in order, `ahead` more than were released: id i
/// names blocks i*K .. i*K+K modulo the region's blocks.
struct Lender {
    ahead: u64,
    next: u64,
    released: u64,
    blocks_each: u64,
    blocks: u64,
    to: PeerLendTo,
    ids: Vec<kvpoll::BlockId>,
    regions: usize,
    /// Writers: check every Nth request received (0: none).
    check_every: u32,
    writer_seed: u64,
}

impl Lender {
    /// The blocks request `id` names.
    fn blocks_of(&self, id: u64) -> impl Iterator<Item = kvpoll::BlockId> + '_ {
        (0..self.blocks_each)
            .map(move |j| kvpoll::BlockId(((id * self.blocks_each + j) % self.blocks) as u32))
    }

    /// Takes the engine's reports, waiting up to `timeout` for one:
    /// checks the push destinations due a check, and counts what ended as
    /// released.
    fn take_reports(
        &mut self,
        engine: &mut kvpoll::Engine,
        out: &mut kvpoll::Outcomes,
        timeout: Duration,
    ) -> Result<(), CliError> {
        out.clear();
        engine.wait(out, timeout);
        if self.check_every > 0 {
            check_received(engine, out, self)?;
        }
        let ended = out.finished_sending.len()
            + out.expired.len()
            + out.finished_recving.len()
            + out.failed_recving.len();
        self.released += ended as u64;
        Ok(())
    }

    /// Lends up to `ahead` past what was released, polling its engine as
    /// it goes. A full command ring (the poller is behind) is no failure:
    /// it takes the engine's reports meanwhile and lends again.
    fn catch_up(
        &mut self,
        engine: &mut kvpoll::Engine,
        out: &mut kvpoll::Outcomes,
    ) -> Result<(), CliError> {
        loop {
            match self
                .top_up(engine)
                .map_err(|e| CliError::Failed(e.to_string()))?
            {
                TopUp::CaughtUp => return Ok(()),
                TopUp::Batch => self.take_reports(engine, out, Duration::ZERO)?,
                TopUp::RingFull => self.take_reports(engine, out, RING_FULL_WAIT)?,
            }
        }
    }

    /// Lends up to `ahead` past what was released, [`LENDS_PER_POLL`] at
    /// most, printing `LENT <id> <incarnation, hex>` for each: the reader
    /// reads each id with that incarnation.
    fn top_up(&mut self, engine: &mut kvpoll::Engine) -> Result<TopUp, kvpoll::SubmitError> {
        let mut lent = String::new();
        let mut made = 0;
        let caught_up = loop {
            if self.next >= self.released + self.ahead {
                break Ok(TopUp::CaughtUp);
            }
            if made == LENDS_PER_POLL {
                break Ok(TopUp::Batch);
            }
            let mut ids = std::mem::take(&mut self.ids);
            ids.clear();
            ids.extend(self.blocks_of(self.next));
            let id = kvpoll::RequestId(self.next);
            let lease = Duration::from_secs(3600);
            let inc = match self.to {
                PeerLendTo::Readers => engine.lend(id, &ids, 1, lease),
                PeerLendTo::Writers => engine.receive(id, &ids, 1, lease),
            };
            self.ids = ids;
            match inc {
                Ok(inc) => {
                    lent.push_str(&format!("LENT {} {:x}\n", self.next, inc.0));
                    self.next += 1;
                    made += 1;
                }
                Err(kvpoll::SubmitError::RingFull(_)) => break Ok(TopUp::RingFull),
                Err(e) => break Err(e),
            }
        };
        if !lent.is_empty() {
            let mut out = std::io::stdout().lock();
            // A reader that went away leaves nobody to tell: not an error.
            let _ = out.write_all(lent.as_bytes()).and_then(|_| out.flush());
        }
        caught_up
    }
}

/// `kvpoll mem-peer`: blocks of the pattern of `--seed` (block b: `fill(seed,
/// b)`) in a mapping of this process, for a reader's `process_vm_readv`.
pub fn run_mem(args: &MemPeerArgs) -> Result<(), CliError> {
    let len =
        args.blocks
            .checked_mul(args.block_size)
            .filter(|&l| l <= 1 << 34)
            .ok_or_else(|| CliError::Failed("mapping size out of range".into()))? as usize;
    let mut m = CallerMemory::new(len).map_err(mapping)?;
    let bs = args.block_size as usize;
    for b in 0..args.blocks as usize {
        kvpoll_cli::pattern::fill(args.seed, b as u64, m.slice_mut(b * bs, bs));
    }
    let mut out = std::io::stdout().lock();
    writeln!(out, "READY {:x}", m.as_ptr() as usize)
        .and_then(|_| out.flush())
        .map_err(|e| CliError::Failed(format!("writing to stdout: {e}")))?;
    drop(out);
    let closed = stdin_closed();
    while !closed.load(Ordering::Acquire) {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    drop(m);
    Ok(())
}
