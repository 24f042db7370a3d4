//! Bakes libtorch's folder (exported by stagehand-runtime's build script) into this package's
//! binaries as a RUNPATH, so they run without LD_LIBRARY_PATH.
fn main() {
    if let Ok(rpath) = std::env::var("DEP_STAGEHAND_SHIM_RPATH") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{rpath}");
    }
}
