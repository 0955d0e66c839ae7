//! Generates bindings to UCX with bindgen and links it. UCX is found one of
//! three ways, first match wins:
//!
//! 1. `KVPOLL_UCX_HOME=/prefix`: an installed UCX (`include/` and `lib/` under it),
//!    for example a CUDA-enabled build in /opt/ucx, or the package directory
//!    of the `libucx` Python wheel (`.../site-packages/libucx`).
//! 2. `KVPOLL_UCX_WHEEL=1`: the `libucx` package that `KVPOLL_UCX_PYTHON` (else
//!    `PYO3_PYTHON`, else `python3`) imports, i.e. the UCX of the
//!    `libucx-cu12`/`libucx-cu13` wheel installed there.
//! 3. pkg-config (`ucx.pc`), the system's or whatever `PKG_CONFIG_PATH` names.
//!
//! A UCX that is not the system's is linked with an rpath to its `lib/`, so
//! binaries and tests find it at run time; `KVPOLL_UCX_RPATH` replaces that rpath
//! (the wheel build gives `$ORIGIN/../libucx/lib`). The rpath is published
//! as `DEP_UCP_RPATH` for the crates that link executables (`dependent_build.rs`).
//!
//! None of these variables starts with `UCX_`: UCX reads every `UCX_*`
//! variable of a process and warns about those it does not know.
//!
//! The build records where UCX came from and its version in
//! `UCX_SYS_SOURCE`, `UCX_SYS_LIBDIR` and `UCX_SYS_VERSION` (see
//! `ucx_sys::BUILT_*`).

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

const MIN_VERSION: &str = "1.10";

/// Where UCX was found.
struct Found {
    source: &'static str,
    include: Vec<PathBuf>,
    /// The directory of libucp, for an rpath; `None` for the system's.
    libdir: Option<PathBuf>,
    version: String,
}

fn fail(msg: &str) -> ! {
    eprintln!("\nucx-sys: {msg}\n");
    std::process::exit(1);
}

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    for var in [
        "PKG_CONFIG_PATH",
        "KVPOLL_UCX_HOME",
        "KVPOLL_UCX_WHEEL",
        "KVPOLL_UCX_PYTHON",
        "PYO3_PYTHON",
        "KVPOLL_UCX_RPATH",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }

    let found = if let Some(home) = env::var_os("KVPOLL_UCX_HOME").filter(|h| !h.is_empty()) {
        from_prefix(Path::new(&home), "prefix")
    } else if env::var("KVPOLL_UCX_WHEEL").is_ok_and(|v| v == "1") {
        from_prefix(&wheel_dir(), "wheel")
    } else {
        from_pkg_config()
    };

    if let Some(dir) = &found.libdir {
        println!("cargo:rustc-link-search=native={}", dir.display());
        for lib in ["ucp", "uct", "ucs", "ucm"] {
            println!("cargo:rustc-link-lib=dylib={lib}");
        }
        let rpath = env::var("KVPOLL_UCX_RPATH").unwrap_or_else(|_| dir.display().to_string());
        // For this crate's own tests; dependents read DEP_UCP_RPATH.
        println!("cargo:rustc-link-arg=-Wl,-rpath,{rpath}");
        println!("cargo:rpath={rpath}");
        println!("cargo:rerun-if-changed={}", dir.join("libucp.so").display());
    }
    let libdir = found
        .libdir
        .as_ref()
        .map_or_else(|| "(system)".to_owned(), |d| d.display().to_string());
    println!("cargo:rustc-env=UCX_SYS_SOURCE={}", found.source);
    println!("cargo:rustc-env=UCX_SYS_LIBDIR={libdir}");
    println!("cargo:rustc-env=UCX_SYS_VERSION={}", found.version);
    println!("cargo:version={}", found.version);

    let mut builder = bindgen::Builder::default()
        .header("wrapper.h")
        .allowlist_function("ucp_.*")
        .allowlist_function("ucs_status_string")
        .allowlist_type("ucp_.*")
        .allowlist_type("ucs_.*")
        .allowlist_var("UCP_.*")
        .allowlist_var("UCS_.*")
        .allowlist_var("UCT_.*")
        // ucs_status_t is a one-byte C enum; keep it an integer type with
        // named constants so an unknown value from a newer UCX is not UB.
        .constified_enum_module("ucs_status_t")
        .prepend_enum_name(false)
        .derive_default(true)
        .layout_tests(false)
        .generate_comments(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for path in &found.include {
        builder = builder.clang_arg(format!("-I{}", path.display()));
    }
    let bindings = match builder.generate() {
        Ok(b) => b,
        Err(err) => fail(&format!(
            "bindgen could not parse the UCX headers ({err}).\n\
             bindgen needs libclang: apt-get install -y libclang-dev"
        )),
    };
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    bindings
        .write_to_file(out.join("bindings.rs"))
        .expect("write bindings.rs into OUT_DIR");
}

fn from_pkg_config() -> Found {
    match pkg_config::Config::new()
        .atleast_version(MIN_VERSION)
        .probe("ucx")
    {
        Ok(lib) => Found {
            source: "pkg-config",
            include: lib.include_paths,
            libdir: None,
            version: lib.version,
        },
        Err(err) => fail(&format!(
            "UCX >= {MIN_VERSION} was not found through pkg-config ({err}).\n\
             On Debian/Ubuntu install it with:\n\
             \n    apt-get install -y libucx-dev libclang-dev pkg-config\n\
             \nor point KVPOLL_UCX_HOME at an installed UCX (a directory with include/ and lib/),\n\
             or set KVPOLL_UCX_WHEEL=1 to use the libucx-cu12 Python wheel's UCX."
        )),
    }
}

/// The `libucx` package directory of the wheel the chosen Python imports.
fn wheel_dir() -> PathBuf {
    let python = ["KVPOLL_UCX_PYTHON", "PYO3_PYTHON"]
        .iter()
        .find_map(|v| env::var(v).ok().filter(|p| !p.is_empty()))
        .unwrap_or_else(|| "python3".to_owned());
    let out = Command::new(&python)
        .args([
            "-c",
            "import libucx, os; print(os.path.dirname(libucx.__file__))",
        ])
        .output();
    match out {
        Ok(o) if o.status.success() => PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()),
        Ok(o) => fail(&format!(
            "KVPOLL_UCX_WHEEL=1 but `{python}` cannot import libucx ({}).\n\
             Install the wheel there: {python} -m pip install libucx-cu12",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(err) => fail(&format!(
            "KVPOLL_UCX_WHEEL=1 but `{python}` cannot be run ({err})"
        )),
    }
}

/// An installed UCX under `prefix`. Its `ucx.pc`, if any, is read for the
/// version only: the wheel's names the build machine's prefix.
fn from_prefix(prefix: &Path, source: &'static str) -> Found {
    let include = prefix.join("include");
    let libdir = prefix.join("lib");
    if !include.join("ucp/api/ucp.h").is_file() || !libdir.join("libucp.so").exists() {
        fail(&format!(
            "{} holds no UCX: expected include/ucp/api/ucp.h and lib/libucp.so under it",
            prefix.display()
        ));
    }
    let version = version_at(prefix).unwrap_or_else(|| {
        fail(&format!(
            "cannot tell the version of the UCX in {}",
            prefix.display()
        ))
    });
    let (major, minor) = major_minor(&version);
    let (min_major, min_minor) = major_minor(MIN_VERSION);
    if (major, minor) < (min_major, min_minor) {
        fail(&format!(
            "the UCX in {} is {version}; kvpoll needs >= {MIN_VERSION}",
            prefix.display()
        ));
    }
    // The wheel's package directory is `libucx`; call it by that name.
    let source = if prefix.join("UCX_WHEEL_VERSION.txt").is_file() {
        "wheel"
    } else {
        source
    };
    Found {
        source,
        include: vec![include],
        libdir: Some(libdir),
        version,
    }
}

/// The full version of the UCX under `prefix`: the `Version:` of its
/// `ucx.pc`, else major.minor from `ucp_version.h`.
fn version_at(prefix: &Path) -> Option<String> {
    let pc = std::fs::read_to_string(prefix.join("lib/pkgconfig/ucx.pc")).ok();
    if let Some(v) = pc.as_deref().and_then(|t| {
        t.lines()
            .find_map(|l| l.strip_prefix("Version:"))
            .map(|v| v.trim().to_owned())
    }) {
        return Some(v);
    }
    let header = std::fs::read_to_string(prefix.join("include/ucp/api/ucp_version.h")).ok()?;
    let define = |name: &str| {
        header.lines().find_map(|l| {
            let mut words = l.split_whitespace();
            (words.next() == Some("#define") && words.next() == Some(name))
                .then(|| words.next().map(str::to_owned))
                .flatten()
        })
    };
    Some(format!(
        "{}.{}",
        define("UCP_API_MAJOR")?,
        define("UCP_API_MINOR")?
    ))
}

fn major_minor(version: &str) -> (u32, u32) {
    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
}
