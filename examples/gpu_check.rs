//! Moves KV blocks through UCX in GPU memory and checks every byte: the
//! prepared check `scripts/gpu-check.sh` runs on GPU machines.
//!
//! Stages, each printed as one `stage NAME: ok|FAILED ...` line:
//! 1. `loopback`: one block host -> GPU (UCX get) and GPU -> host (UCX
//!    put) between two workers of this process.
//! 2. `pull` and `push`: two engines in this process, each with KV layers
//!    in device memory registered by `Engine::register_device_memory`; the
//!    decode reads the prefill's lent blocks, then the prefill writes into
//!    the decode's received blocks. The bytes are checked with the CUDA
//!    driver directly, not through the engine.
//! 3. `two-process`: the same pull with the prefill in a child process
//!    (this binary again, `--prefill`), where UCX moves device memory
//!    between processes (cuda_ipc on one host).
//!
//! Exit status: 0 every stage passed; 1 a stage failed; 3 no GPU or no
//! CUDA-enabled UCX (the typed error is printed).

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use kvpoll::gpu::{driver_present, loopback_check, GpuError};
use kvpoll::{
    BlockId, BuildError, Engine, Incarnation, Outcomes, PeerId, RegionError, RequestId, Transfer,
};

/// KV layers per engine and blocks per layer.
const LAYERS: usize = 2;
const BLOCKS: u64 = 16;
/// Blocks moved per request.
const MOVED: [u32; 4] = [1, 5, 6, 15];
/// How long a request may take before the stage fails.
const PATIENCE: Duration = Duration::from_secs(60);

struct Options {
    ordinal: usize,
    block_size: usize,
}

/// The byte pattern of `block` of `layer` for `seed`: no two blocks alike.
fn pattern(seed: u8, layer: usize, block: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32 * 131 + block * 7 + layer as u32 * 29 + u32::from(seed) * 61) as u8)
        .collect()
}

/// Device memory for one engine's KV layers, allocated with cudarc.
struct Layers {
    stream: Arc<CudaStream>,
    memory: Vec<CudaSlice<u8>>,
}

impl Layers {
    fn allocate(ordinal: usize, block_size: usize) -> Result<Self, String> {
        let ctx = CudaContext::new(ordinal).map_err(|e| format!("CUDA context: {e}"))?;
        let stream = ctx.default_stream();
        let mut memory = Vec::new();
        for _ in 0..LAYERS {
            memory.push(
                stream
                    .alloc_zeros::<u8>(BLOCKS as usize * block_size)
                    .map_err(|e| format!("cuMemAlloc: {e}"))?,
            );
        }
        stream.synchronize().map_err(|e| e.to_string())?;
        Ok(Self { stream, memory })
    }

    /// Registers every layer with `engine` as device memory.
    fn register(&self, engine: &mut Engine) -> Result<(), RegionError> {
        for m in &self.memory {
            let (ptr, _sync) = m.device_ptr(&self.stream);
            // SAFETY: `self` outlives the engine in every stage (engines are
            // shut down and dropped before the layers).
            unsafe { engine.register_device_memory(ptr, m.len())? };
        }
        Ok(())
    }

    /// Block `block` of `layer`, read with the CUDA driver.
    fn block(&self, layer: usize, block: u32, block_size: usize) -> Result<Vec<u8>, String> {
        let start = block as usize * block_size;
        let src = self.memory[layer].slice(start..start + block_size);
        let mut out = vec![0u8; block_size];
        self.stream
            .memcpy_dtoh(&src, &mut out)
            .and_then(|()| self.stream.synchronize())
            .map_err(|e| format!("cuMemcpyDtoH: {e}"))?;
        Ok(out)
    }
}

fn engine(block_size: usize) -> Result<Engine, BuildError> {
    Engine::builder().block_size(block_size as u64).build()
}

/// An engine error as the stage's failure text.
fn e(err: impl std::fmt::Display) -> String {
    err.to_string()
}

/// Waits until `done` says the outcomes are in, or fails with what arrived.
fn wait_for(
    engine: &mut Engine,
    what: &str,
    done: impl Fn(&Outcomes) -> bool,
) -> Result<Outcomes, String> {
    let mut out = Outcomes::default();
    let start = Instant::now();
    while !done(&out) {
        if !out.failed_recving.is_empty() || !out.failed_sending.is_empty() {
            return Err(format!("{what} failed: {out:?}"));
        }
        if start.elapsed() > PATIENCE {
            return Err(format!("{what}: no report in {PATIENCE:?} ({out:?})"));
        }
        engine.wait(&mut out, Duration::from_millis(10));
    }
    Ok(out)
}

fn fill(engine: &Engine, seed: u8, block_size: usize) -> Result<(), RegionError> {
    for layer in 0..LAYERS {
        for &b in &MOVED {
            engine.write_block(layer, BlockId(b), &pattern(seed, layer, b, block_size))?;
        }
    }
    Ok(())
}

/// Checks that `dst` holds `seed`'s pattern of the source block `src[i]`
/// in block `dst_blocks[i]`, through the driver and through the engine.
fn check(
    layers: &Layers,
    engine: &Engine,
    seed: u8,
    src: &[u32],
    dst: &[u32],
    block_size: usize,
) -> Result<(), String> {
    let mut via_engine = vec![0u8; block_size];
    for layer in 0..LAYERS {
        for (&s, &d) in src.iter().zip(dst) {
            let want = pattern(seed, layer, s, block_size);
            if layers.block(layer, d, block_size)? != want {
                return Err(format!(
                    "layer {layer} block {d}: bytes differ (CUDA driver read)"
                ));
            }
            engine
                .read_block(layer, BlockId(d), &mut via_engine)
                .map_err(|e| e.to_string())?;
            if via_engine != want {
                return Err(format!(
                    "layer {layer} block {d}: Engine::read_block differs"
                ));
            }
        }
    }
    Ok(())
}

/// One handle: `local` of this engine paired with `remote` of `peer`.
fn one<'a>(
    peer: PeerId,
    local: &'a [BlockId],
    remote: &'a [BlockId],
    lend: Incarnation,
) -> [Transfer<'a>; 1] {
    [Transfer {
        peer,
        local,
        remote,
        lend,
    }]
}

fn blocks(ids: &[u32]) -> Vec<BlockId> {
    ids.iter().map(|&b| BlockId(b)).collect()
}

/// Stage 2: pull then push between two engines of this process.
fn in_process(o: &Options) -> Result<(), String> {
    let (prefill_mem, decode_mem) = (
        Layers::allocate(o.ordinal, o.block_size)?,
        Layers::allocate(o.ordinal, o.block_size)?,
    );
    let mut prefill = engine(o.block_size).map_err(e)?;
    let mut decode = engine(o.block_size).map_err(e)?;
    prefill_mem.register(&mut prefill).map_err(e)?;
    decode_mem.register(&mut decode).map_err(e)?;
    let to_prefill = decode
        .add_peer(&prefill.local_metadata().map_err(e)?)
        .map_err(e)?;
    let to_decode = prefill
        .add_peer(&decode.local_metadata().map_err(e)?)
        .map_err(e)?;

    // Pull: the decode reads the prefill's blocks into other block ids.
    fill(&prefill, 1, o.block_size).map_err(e)?;
    let dst: Vec<u32> = MOVED.iter().map(|b| BLOCKS as u32 - 1 - b).collect();
    let (src_ids, dst_ids) = (blocks(&MOVED), blocks(&dst));
    let id = RequestId(1);
    let lend = prefill.lend(id, &src_ids, 1, PATIENCE).map_err(e)?;
    decode
        .read(id, &one(to_prefill, &dst_ids, &src_ids, lend))
        .map_err(e)?;
    wait_for(&mut decode, "pull read", |o| {
        o.finished_recving.contains(&id)
    })?;
    wait_for(&mut prefill, "pull lend", |o| {
        o.finished_sending.contains(&id)
    })?;
    check(&decode_mem, &decode, 1, &MOVED, &dst, o.block_size).map_err(|w| format!("pull: {w}"))?;
    println!(
        "stage pull: ok ({} blocks x {LAYERS} layers, device -> device)",
        MOVED.len()
    );

    // Push: the prefill writes new bytes into blocks the decode received.
    fill(&prefill, 2, o.block_size).map_err(e)?;
    let id = RequestId(2);
    let recv = decode.receive(id, &dst_ids, 1, PATIENCE).map_err(e)?;
    prefill
        .write(id, &one(to_decode, &src_ids, &dst_ids, recv), 1, PATIENCE)
        .map_err(e)?;
    wait_for(&mut prefill, "push write", |o| {
        o.finished_sending.contains(&id)
    })?;
    wait_for(&mut decode, "push receive", |o| {
        o.finished_recving.contains(&id)
    })?;
    check(&decode_mem, &decode, 2, &MOVED, &dst, o.block_size).map_err(|w| format!("push: {w}"))?;
    println!(
        "stage push: ok ({} blocks x {LAYERS} layers, device -> device)",
        MOVED.len()
    );
    prefill.shutdown();
    decode.shutdown();
    Ok(())
}

/// The child of stage 3: lends its filled device blocks to the parent,
/// printing `META <hex>` and `LEND <incarnation>`, and exits once the
/// parent's read released the lend.
fn prefill_child(o: &Options) -> Result<(), String> {
    let mem = Layers::allocate(o.ordinal, o.block_size)?;
    let mut prefill = engine(o.block_size).map_err(e)?;
    mem.register(&mut prefill).map_err(e)?;
    fill(&prefill, 3, o.block_size).map_err(e)?;
    let id = RequestId(3);
    let lend = prefill.lend(id, &blocks(&MOVED), 1, PATIENCE).map_err(e)?;
    let meta = prefill.local_metadata().map_err(e)?;
    let hex: String = meta.iter().map(|b| format!("{b:02x}")).collect();
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "META {hex}\nLEND {}", lend.0).map_err(|e| e.to_string())?;
    stdout.flush().map_err(|e| e.to_string())?;
    drop(stdout);
    wait_for(&mut prefill, "two-process lend", |o| {
        o.finished_sending.contains(&id)
    })?;
    prefill.shutdown();
    Ok(())
}

fn unhex(s: &str) -> Result<Vec<u8>, String> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(s.get(2 * i..2 * i + 2).unwrap_or(""), 16))
        .collect::<Result<_, _>>()
        .map_err(|e| format!("child metadata: {e}"))
}

/// Stage 3: the decode here reads device blocks from a prefill child.
fn two_process(o: &Options) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .args(["--prefill", "--ordinal", &o.ordinal.to_string()])
        .args(["--block-size", &o.block_size.to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("spawn the prefill child: {e}"))?;
    let result = (|| {
        let stdout = child.stdout.take().ok_or("no child stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let mut next = |tag: &str| -> Result<String, String> {
            let line = lines
                .next()
                .ok_or_else(|| format!("the child exited before {tag}"))?
                .map_err(|e| e.to_string())?;
            line.strip_prefix(tag)
                .map(|s| s.trim().to_owned())
                .ok_or_else(|| format!("expected {tag} from the child, got {line:?}"))
        };
        let meta = unhex(&next("META")?)?;
        let lend = Incarnation(next("LEND")?.parse().map_err(|e| format!("LEND: {e}"))?);
        let mem = Layers::allocate(o.ordinal, o.block_size)?;
        let mut decode = engine(o.block_size).map_err(e)?;
        mem.register(&mut decode).map_err(e)?;
        let peer = decode.add_peer(&meta).map_err(e)?;
        let id = RequestId(3);
        let ids = blocks(&MOVED);
        decode.read(id, &one(peer, &ids, &ids, lend)).map_err(e)?;
        wait_for(&mut decode, "two-process read", |o| {
            o.finished_recving.contains(&id)
        })?;
        check(&mem, &decode, 3, &MOVED, &MOVED, o.block_size)?;
        decode.shutdown();
        Ok::<(), String>(())
    })();
    let status = child.wait().map_err(|e| e.to_string())?;
    result?;
    if !status.success() {
        return Err(format!("the prefill child exited with {status}"));
    }
    println!(
        "stage two-process: ok ({} blocks x {LAYERS} layers, device -> device)",
        MOVED.len()
    );
    Ok(())
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let mut o = Options {
        ordinal: 0,
        block_size: 64 * 1024,
    };
    let mut child = false;
    while let Some(arg) = args.next() {
        if arg == "--prefill" {
            child = true;
            continue;
        }
        let value = args.next().and_then(|v| v.parse().ok());
        match (arg.as_str(), value) {
            ("--ordinal", Some(v)) => o.ordinal = v,
            ("--block-size", Some(v)) if v > 0 => o.block_size = v,
            _ => {
                eprintln!("usage: gpu_check [--ordinal N] [--block-size BYTES]");
                return ExitCode::from(2);
            }
        }
    }
    if child {
        return match prefill_child(&o) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("prefill child: {e}");
                ExitCode::from(1)
            }
        };
    }
    println!("cuda driver library present: {}", driver_present());
    println!("{}", kvpoll::transport::ucx::version_line());
    // Every stage runs, so that one failure does not hide the others.
    let mut failed = false;
    match loopback_check(o.ordinal, o.block_size) {
        Ok(report) if report.host_to_gpu && report.gpu_to_host => {
            println!(
                "stage loopback: ok (one {}-byte block host -> gpu -> host)",
                o.block_size
            )
        }
        Ok(report) => {
            println!("stage loopback: FAILED: bytes differ ({report:?})");
            failed = true;
        }
        Err(e @ (GpuError::NoDriver | GpuError::NoDevice { .. } | GpuError::UcxWithoutCuda)) => {
            println!("unavailable: {e}");
            return ExitCode::from(3);
        }
        Err(e) => {
            println!("stage loopback: FAILED: {e}");
            failed = true;
        }
    }
    for (name, stage) in [
        (
            "pull/push",
            in_process as fn(&Options) -> Result<(), String>,
        ),
        ("two-process", two_process),
    ] {
        if let Err(e) = stage(&o) {
            println!("stage {name}: FAILED: {e}");
            failed = true;
        }
    }
    if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
