//! `kvpoll topo`: shows the machine as placement sees it and suggests a core
//! map; `--check MAP` validates a map against this machine and gives advice.

use kvpoll::placement::{check, format_cpu_list, CoreMap, CoreMapFile, Topology, AUTO};

use crate::cli::{CliError, TopoArgs};

/// The line after which `kvpoll topo` prints the suggested map (TOML to the
/// end of the output).
const MAP_MARKER: &str = "--- suggested core map (TOML; save it and pass it to --check) ---";

pub fn run(args: &TopoArgs) -> Result<(), CliError> {
    let map_only = args.map;

    let topology = Topology::detect().map_err(|e| CliError::Failed(e.to_string()))?;
    if let Some(path) = &args.check {
        return check_map(path, &topology);
    }
    let suggestion = CoreMap::auto_toml(&topology);
    if map_only {
        let text = suggestion.map_err(|e| CliError::Failed(e.to_string()))?;
        print!("{text}");
        return Ok(());
    }
    println!("topology (hwloc):");
    print!("{topology}");
    println!();
    match suggestion {
        Ok(text) => {
            println!("{MAP_MARKER}");
            print!("{text}");
        }
        Err(e) => println!("no core map to suggest: {e}"),
    }
    Ok(())
}

/// Exit 0 when the map is valid here (warnings allowed), 1 when not.
fn check_map(path: &str, topology: &Topology) -> Result<(), CliError> {
    let file = if path == AUTO {
        CoreMapFile::Auto {
            name: AUTO.to_owned(),
        }
    } else {
        CoreMapFile::load(path).map_err(|e| CliError::Failed(e.to_string()))?
    };
    let derived = matches!(file, CoreMapFile::Auto { .. });
    let map = file
        .resolve(topology)
        .map_err(|e| CliError::Failed(e.to_string()))?;
    if derived {
        println!("{path}: derived from this machine:");
        print!("{}", map.to_toml());
    }
    let warnings = check(&map, topology);
    for w in &warnings {
        println!("{w}");
    }
    let cores: Vec<usize> = map.pollers().iter().map(|p| p.core).collect();
    println!(
        "{path}: valid on this machine: {} poller(s) on CPU {}, engine on CPU {}; {} warning(s)",
        cores.len(),
        format_cpu_list(&cores),
        format_cpu_list(map.engine_cores()),
        warnings.len()
    );
    Ok(())
}
