//! Bakes libtorch's folder (exported by stagehand-runtime's build script, a dependency under the
//! `handle` feature) into this package's binaries as a RUNPATH, so tests run without
//! LD_LIBRARY_PATH when the feature links libtorch into them.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_STAGEHAND_SHIM_RPATH");
    if let Ok(rpath) = std::env::var("DEP_STAGEHAND_SHIM_RPATH") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{rpath}");
    }
}
