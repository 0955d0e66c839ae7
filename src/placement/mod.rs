//! Placement: where pollers and engine threads run.
//!
//! - [`CoreMap`] — the core-map format (`tuning/*.toml`): per poller its CPU,
//!   UCX workers and [`IdlePolicy`]; the engine threads' CPUs. Parsed with
//!   typed errors naming file and line, validated against a [`Topology`],
//!   or derived from one with [`CoreMap::auto`].
//! - [`Topology`] — the machine read with hwloc: CPUs and their physical
//!   cores, packages and NUMA nodes, NICs and GPUs with their PCI locality,
//!   and the [`Isolation`] state from `/sys` and the kernel command line.
//! - [`check`] — advice on a valid map (busy poller not isolated,
//!   hyperthread siblings, NIC on another NUMA node).
//! - [`pin_current_thread`] — pinning with read-back.
//!
//! An engine starts its pollers with:
//!
//! ```no_run
//! use kvpoll::placement::{pin_current_thread, CoreMap, Topology};
//! let topology = Topology::detect()?;
//! let map = CoreMap::load("tuning/two-core.toml", &topology)?;
//! for poller in map.pollers().iter().cloned() {
//!     std::thread::spawn(move || {
//!         let outcome = pin_current_thread(poller.core, poller.idle)?;
//!         if let Some(w) = &outcome.warning {
//!             tracing::warn!(core = poller.core, "poller: {w}");
//!         }
//!         // ... create poller.workers, run the loop with poller.idle ...
//!         Ok::<(), kvpoll::placement::PlacementError>(())
//!     });
//! }
//! # Ok::<(), kvpoll::placement::PlacementError>(())
//! ```

mod auto;
mod check;
mod core_map;
mod cpulist;
mod error;
mod isolation;
mod pin;
mod topology;

pub use check::{check, Warning, WarningKind};
pub use core_map::{CoreMap, CoreMapFile, IdlePolicy, PollerSpec, AUTO, MAX_CORE_MAP_BYTES};
pub use cpulist::{format_cpu_list, parse_cpu_list};
pub use error::PlacementError;
pub use isolation::{interrupts_per_cpu, BootOptions, Isolation};
pub use pin::{current_affinity, current_cpu, machine_cpus, pin_current_thread, PinOutcome};
pub use topology::{Cpu, Device, DeviceKind, NumaNode, Topology, TreeNode, ALL_DEVICES};
