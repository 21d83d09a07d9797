//! Bakes libtorch's folder into the test binaries' rpath when the server
//! they fuzz is built with libtorch (`--all-features`), as server/build.rs
//! does for `rookery`. torch-sys exports the folder as DEP_TCH_LIBTORCH_LIB
//! to its direct dependents only, which is why it is a direct dependency.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    }
}
