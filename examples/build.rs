//! Bakes libtorch's folder (exported by stagehand-runtime's build script when its `torch`
//! feature is on) into this package's binaries as a RUNPATH, so tests run without
//! LD_LIBRARY_PATH even when feature unification links libtorch into them.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_STAGEHAND_SHIM_RPATH");
    if let Ok(rpath) = std::env::var("DEP_STAGEHAND_SHIM_RPATH") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{rpath}");
    }
}
