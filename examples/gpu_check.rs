//! Moves one block through UCX into and out of GPU memory and prints what
//! happened: the prepared check `scripts/gpu-check.sh` runs on GPU machines.
//!
//! Exit status: 0 the block arrived intact both ways; 1 it did not, or a
//! call failed; 3 no GPU or no CUDA-enabled UCX (the typed error is printed).

use std::process::ExitCode;

use kvpoll::gpu::{driver_present, loopback_check, GpuError};

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let mut ordinal = 0usize;
    let mut block_size = 64 * 1024usize;
    while let Some(arg) = args.next() {
        let value = args.next().and_then(|v| v.parse().ok());
        match (arg.as_str(), value) {
            ("--ordinal", Some(v)) => ordinal = v,
            ("--block-size", Some(v)) if v > 0 => block_size = v,
            _ => {
                eprintln!("usage: gpu_check [--ordinal N] [--block-size BYTES]");
                return ExitCode::from(2);
            }
        }
    }
    println!("cuda driver library present: {}", driver_present());
    match loopback_check(ordinal, block_size) {
        Ok(report) => {
            println!(
                "gpu {}: one {}-byte block host->gpu (UCX get): {}; gpu->host (UCX put): {}",
                report.ordinal,
                report.block_size,
                if report.host_to_gpu {
                    "intact"
                } else {
                    "CORRUPTED"
                },
                if report.gpu_to_host {
                    "intact"
                } else {
                    "CORRUPTED"
                },
            );
            if report.host_to_gpu && report.gpu_to_host {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e @ (GpuError::NoDriver | GpuError::NoDevice { .. } | GpuError::UcxWithoutCuda)) => {
            println!("unavailable: {e}");
            ExitCode::from(3)
        }
        Err(e) => {
            println!("failed: {e}");
            ExitCode::from(1)
        }
    }
}
