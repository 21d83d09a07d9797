//! Bakes libtorch's folder into the binary's rpath so `rookery` (with `--features torch`, for `generate --backend torch`) runs
//! without LD_LIBRARY_PATH. torch-sys exports the folder as DEP_TCH_LIBTORCH_LIB
//! to its direct dependents only, which is why `torch-sys` is a direct dependency.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    }
}
