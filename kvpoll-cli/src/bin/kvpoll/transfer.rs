//! `kvpoll demo`: a real transfer between two UCX workers — blocks filled
//! with a checkable pattern are read with batches of gets, every block is
//! verified, and the tool prints what it moved and how fast.
//!
//! (The full disaggregated prefill/decode demo builds on the engine.)

use std::time::{Duration, Instant};

use kvpoll::transport::ucx::{
    BlockOp, Completion, Context, ContextOptions, Endpoint, MemoryRegion, RemoteKey, UcxError,
    Worker,
};
use kvpoll_cli::pattern;

use crate::cli::{CliError, TransferArgs};

pub fn run(plan: &TransferArgs) -> Result<(), CliError> {
    if plan.blocks.saturating_mul(plan.block_size) > 4 << 30 {
        return Err(CliError::Usage(
            "--blocks x --block-size would exceed 4 GiB".into(),
        ));
    }
    transfer(plan).map_err(|e| CliError::Failed(e.to_string()))
}

fn transfer(plan: &TransferArgs) -> Result<(), UcxError> {
    let len = (plan.blocks * plan.block_size) as usize;
    let options = ContextOptions::with_transports(&plan.tls);
    let (prefill_ctx, decode_ctx) = (Context::new(&options)?, Context::new(&options)?);
    let prefill = Worker::new(&prefill_ctx)?;
    let decode = Worker::new(&decode_ctx)?;
    let source = MemoryRegion::allocate(&prefill_ctx, len)?;
    let dest = MemoryRegion::allocate(&decode_ctx, len)?;
    let ep = Endpoint::connect(&decode, &prefill.address()?, 1)?;
    let rkey = RemoteKey::unpack(&ep, &source.pack_rkey()?)?;

    if !plan.json {
        println!(
            "kvpoll demo: {} rounds x {} blocks x {} bytes over {} (two UCX workers, one process)",
            plan.rounds, plan.blocks, plan.block_size, plan.tls
        );
    }
    let mut block = vec![0u8; plan.block_size as usize];
    let mut ops = Vec::with_capacity(plan.blocks as usize);
    let mut done: Vec<Completion> = Vec::with_capacity(plan.blocks as usize);
    let (mut moved, mut busy, mut corrupted, mut failed) = (0u64, Duration::ZERO, 0u64, 0u64);
    for round in 0..plan.rounds {
        let seed = round + 1;
        for b in 0..plan.blocks {
            pattern::fill(seed, b, &mut block);
            source.write(b * plan.block_size, &block)?;
        }
        // Block b of the reader takes remote block (b * 7919) mod n: a
        // scattered mapping, like a real block table.
        ops.clear();
        ops.extend((0..plan.blocks).map(|b| BlockOp {
            local_offset: b * plan.block_size,
            remote_offset: (b * 7919 % plan.blocks) * plan.block_size,
            len: plan.block_size as usize,
            token: b,
        }));
        done.clear();
        let t = Instant::now();
        ep.get_batch(&dest, &rkey, &ops).map_err(|e| e.error)?;
        while done.len() < ops.len() {
            decode.progress();
            prefill.progress();
            decode.take_completions(&mut done);
        }
        let dt = t.elapsed();
        // The first round pays for connection setup and cold caches; it is
        // verified like the others but left out of the rate.
        let warm_up = round == 0 && plan.rounds > 1;
        if !warm_up {
            busy += dt;
            moved += len as u64;
        }
        failed += done.iter().filter(|c| !c.status.is_ok()).count() as u64;
        let mut bad = 0;
        for b in 0..plan.blocks {
            dest.read(b * plan.block_size, &mut block)?;
            if !pattern::check(seed, b * 7919 % plan.blocks, &block) {
                bad += 1;
            }
        }
        corrupted += bad;
        if !plan.json {
            println!(
                "{} {}: {} in {:.2} ms = {:.2} GB/s, {}/{} blocks verified",
                if warm_up { "warm-up" } else { "round" },
                round + 1,
                human(len as u64),
                dt.as_secs_f64() * 1e3,
                len as f64 / dt.as_secs_f64() / 1e9,
                plan.blocks - bad,
                plan.blocks
            );
        }
    }
    let secs = busy.as_secs_f64();
    let blocks = moved / plan.block_size;
    if plan.json {
        println!(
            "{{\"transports\":\"{}\",\"bytes\":{moved},\"blocks\":{blocks},\"seconds\":{secs:.6},\"gb_per_s\":{:.3},\"blocks_per_s\":{:.0},\"corrupted_blocks\":{corrupted},\"failed_ops\":{failed}}}",
            plan.tls,
            moved as f64 / secs / 1e9,
            blocks as f64 / secs
        );
    } else {
        println!(
            "moved {} ({moved} bytes, {blocks} blocks, warm-up excluded) in {:.1} ms: {:.2} GB/s, {:.0} blocks/s; {corrupted} corrupted blocks, {failed} failed operations",
            human(moved),
            secs * 1e3,
            moved as f64 / secs / 1e9,
            blocks as f64 / secs
        );
    }
    if corrupted > 0 || failed > 0 {
        return Err(UcxError::Call {
            op: "demo verification",
            status: kvpoll::transport::ucx::UcxStatus(-1),
        });
    }
    Ok(())
}

fn human(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
    }
}
