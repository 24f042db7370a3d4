//! Compiles the C++ shim against the installed libtorch headers and bakes libtorch's folder into
//! this package's binaries as a RUNPATH (which LD_LIBRARY_PATH can still override), so tests and
//! examples run without environment variables.

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-changed=csrc/shim.cpp");
    let libtorch = match std::env::var_os("LIBTORCH") {
        Some(p) => PathBuf::from(p),
        None => {
            eprintln!(
                "error: LIBTORCH is not set. Run `scripts/setup` from the repository root (it \
                 installs libtorch 2.11.0 into .libtorch, which .cargo/config.toml points at)."
            );
            std::process::exit(1);
        }
    };
    let include = libtorch.join("include");
    if !include.join("torch/csrc/autograd/engine.h").exists() {
        eprintln!(
            "error: no libtorch headers under '{}'. Run `scripts/setup` from the repository root.",
            include.display()
        );
        std::process::exit(1);
    }
    cc::Build::new()
        .cpp(true)
        .file("csrc/shim.cpp")
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-deprecated-declarations")
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .opt_level(2)
        .warnings(false)
        .compile("stagehand_shim");
    let lib = libtorch.join("lib");
    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=c10");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    // Dependents read this as DEP_STAGEHAND_SHIM_RPATH to bake the same RUNPATH.
    println!("cargo:rpath={}", lib.display());
}
