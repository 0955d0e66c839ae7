//! How isolated each CPU is from the rest of the system: what the kernel
//! reports in `/sys` and what it was booted with, plus per-CPU interrupt
//! counts and frequency governors. Nothing here is fatal: a file that cannot
//! be read is noted in [`Isolation::notes`] and reads as "nothing isolated".

use std::collections::BTreeMap;
use std::fs;

use super::cpulist::parse_cpu_list;

const ISOLATED: &str = "/sys/devices/system/cpu/isolated";
const NOHZ_FULL: &str = "/sys/devices/system/cpu/nohz_full";
const CMDLINE: &str = "/proc/cmdline";
const INTERRUPTS: &str = "/proc/interrupts";

/// The isolation state of this machine's CPUs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Isolation {
    /// CPUs removed from the scheduler's load balancing (`isolcpus=`), from
    /// `/sys/devices/system/cpu/isolated`.
    pub isolated: Vec<usize>,
    /// CPUs without the periodic tick when one task runs (`nohz_full=`), from
    /// `/sys/devices/system/cpu/nohz_full` (absent on kernels built without
    /// `NO_HZ_FULL`).
    pub nohz_full: Vec<usize>,
    /// The isolation-related boot options, as written on the kernel command line.
    pub boot: BootOptions,
    /// Interrupts handled so far per CPU, summed over `/proc/interrupts`.
    pub interrupts: BTreeMap<usize, u64>,
    /// The cpufreq governor per CPU (`performance`, `powersave`, …), where
    /// the machine exposes one.
    pub governors: BTreeMap<usize, String>,
    /// Sources that could not be read or parsed, for the operator.
    pub notes: Vec<String>,
}

/// Isolation-related options from `/proc/cmdline`, verbatim.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BootOptions {
    /// `isolcpus=` (may carry flags such as `managed_irq,domain,`).
    pub isolcpus: Option<String>,
    /// `nohz_full=`.
    pub nohz_full: Option<String>,
    /// `rcu_nocbs=`.
    pub rcu_nocbs: Option<String>,
    /// `irqaffinity=` (the default CPUs for interrupts).
    pub irqaffinity: Option<String>,
}

impl BootOptions {
    /// Picks the isolation options out of a kernel command line.
    pub fn from_cmdline(cmdline: &str) -> Self {
        let mut boot = Self::default();
        // Arguments after a bare `--` go to init, not to the kernel.
        for word in cmdline.split_whitespace().take_while(|w| *w != "--") {
            let Some((key, value)) = word.split_once('=') else {
                continue;
            };
            let slot = match key {
                "isolcpus" => &mut boot.isolcpus,
                "nohz_full" => &mut boot.nohz_full,
                "rcu_nocbs" => &mut boot.rcu_nocbs,
                "irqaffinity" => &mut boot.irqaffinity,
                _ => continue,
            };
            *slot = Some(value.to_owned());
        }
        boot
    }
}

impl Isolation {
    /// Reads the isolation state of this machine. `cpus` are the CPUs whose
    /// governors to read.
    pub fn read(cpus: &[usize]) -> Self {
        let mut iso = Self::default();
        iso.isolated = iso.cpu_list_file(ISOLATED, true);
        // A kernel without NO_HZ_FULL has no such file: that means "none".
        iso.nohz_full = iso.cpu_list_file(NOHZ_FULL, false);
        match fs::read_to_string(CMDLINE) {
            Ok(text) => iso.boot = BootOptions::from_cmdline(&text),
            Err(e) => iso.notes.push(format!("{CMDLINE}: {e}")),
        }
        match fs::read_to_string(INTERRUPTS) {
            Ok(text) => iso.interrupts = interrupts_per_cpu(&text),
            Err(e) => iso.notes.push(format!("{INTERRUPTS}: {e}")),
        }
        for &cpu in cpus {
            let path = format!("/sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_governor");
            if let Ok(g) = fs::read_to_string(&path) {
                iso.governors.insert(cpu, g.trim().to_owned());
            }
        }
        iso
    }

    fn cpu_list_file(&mut self, path: &str, must_exist: bool) -> Vec<usize> {
        match fs::read_to_string(path) {
            Ok(text) => parse_cpu_list(&text).unwrap_or_else(|e| {
                self.notes.push(format!("{path}: {e}"));
                Vec::new()
            }),
            Err(e) => {
                if must_exist || e.kind() != std::io::ErrorKind::NotFound {
                    self.notes.push(format!("{path}: {e}"));
                }
                Vec::new()
            }
        }
    }

    /// Whether `cpu` is isolated from the scheduler (`isolcpus`).
    pub fn is_isolated(&self, cpu: usize) -> bool {
        self.isolated.contains(&cpu)
    }

    /// Whether `cpu` runs tickless (`nohz_full`).
    pub fn is_nohz_full(&self, cpu: usize) -> bool {
        self.nohz_full.contains(&cpu)
    }
}

/// Sums `/proc/interrupts` per CPU column. Lines with fewer numbers than
/// CPUs (the machine-wide `ERR:` and `MIS:` totals) are skipped.
pub fn interrupts_per_cpu(text: &str) -> BTreeMap<usize, u64> {
    let mut lines = text.lines();
    let Some(header) = lines.next() else {
        return BTreeMap::new();
    };
    // The header names the CPU of each column: "CPU0 CPU1 CPU4" (offline
    // CPUs have no column, so the column index is not the CPU number).
    let cpus: Vec<usize> = header
        .split_whitespace()
        .filter_map(|w| w.strip_prefix("CPU")?.parse().ok())
        .collect();
    let mut sums: BTreeMap<usize, u64> = cpus.iter().map(|&c| (c, 0)).collect();
    for line in lines {
        let Some((_, counts)) = line.split_once(':') else {
            continue;
        };
        let numbers: Vec<u64> = counts
            .split_whitespace()
            .map_while(|w| w.parse().ok())
            .take(cpus.len())
            .collect();
        if numbers.len() < cpus.len() {
            continue;
        }
        for (cpu, n) in cpus.iter().zip(numbers) {
            if let Some(sum) = sums.get_mut(cpu) {
                *sum = sum.saturating_add(n);
            }
        }
    }
    sums
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boot_options_ignore_init_arguments_after_double_dash() {
        let boot = BootOptions::from_cmdline(
            "quiet isolcpus=managed_irq,domain,2-5 nohz_full=2-5 -- rcu_nocbs=9",
        );
        assert_eq!(boot.isolcpus.as_deref(), Some("managed_irq,domain,2-5"));
        assert_eq!(boot.nohz_full.as_deref(), Some("2-5"));
        assert_eq!(boot.rcu_nocbs, None);
        assert_eq!(boot.irqaffinity, None);
    }

    #[test]
    fn interrupts_are_summed_per_cpu_column_by_header_name() {
        let text = "           CPU0       CPU2\n\
                      0:         35          1   IO-APIC   2-edge      timer\n\
                    LOC:     100000        500   Local timer interrupts\n\
                    ERR:          7\n";
        let sums = interrupts_per_cpu(text);
        assert_eq!(sums.get(&0), Some(&(35 + 100_000)));
        assert_eq!(sums.get(&2), Some(&501));
        assert_eq!(sums.get(&1), None);
    }
}
