//! Generates bindings to the system UCX with bindgen, located by pkg-config.
//!
//! A site UCX (for example a CUDA-enabled build in /opt/ucx) is picked up
//! through `PKG_CONFIG_PATH`, as pkg-config always does.

use std::env;
use std::path::PathBuf;

const MIN_VERSION: &str = "1.10";

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");

    let ucx = match pkg_config::Config::new()
        .atleast_version(MIN_VERSION)
        .probe("ucx")
    {
        Ok(lib) => lib,
        Err(err) => {
            eprintln!(
                "\nucx-sys: UCX >= {MIN_VERSION} was not found through pkg-config ({err}).\n\
                 On Debian/Ubuntu install it with:\n\
                 \n    apt-get install -y libucx-dev libclang-dev pkg-config\n\
                 \nFor a site UCX (for example a CUDA-enabled build), point \
                 PKG_CONFIG_PATH at the directory that holds its ucx.pc.\n"
            );
            std::process::exit(1);
        }
    };

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
    for path in &ucx.include_paths {
        builder = builder.clang_arg(format!("-I{}", path.display()));
    }
    let bindings = match builder.generate() {
        Ok(b) => b,
        Err(err) => {
            eprintln!(
                "\nucx-sys: bindgen could not parse the UCX headers ({err}).\n\
                 bindgen needs libclang: apt-get install -y libclang-dev\n"
            );
            std::process::exit(1);
        }
    };
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    bindings
        .write_to_file(out.join("bindings.rs"))
        .expect("write bindings.rs into OUT_DIR");
}
