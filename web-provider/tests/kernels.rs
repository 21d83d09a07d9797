//! Every kernel of `rookery_kernels` on real WebGPU (headless
//! Chromium) against its CPU reference: the same [`checks::standard_checks`]
//! the native harness (`shared/kernels/tests/gpu_kernels.rs`) runs on lavapipe, so
//! the browser and native backends pass the very same cases. Fails, not
//! skips, without a WebGPU adapter. Run like `browser.rs` (see there).
#![cfg(target_arch = "wasm32")]
// Clippy's test exemption only knows `#[test]`, not `#[wasm_bindgen_test]`.
#![allow(clippy::unwrap_used)]

use rookery_kernels::GpuContext;
use rookery_kernels::checks;
use rookery_kernels::elementwise::Unary;
use wasm_bindgen_test::{console_log, wasm_bindgen_test, wasm_bindgen_test_configure};

wasm_bindgen_test_configure!(run_in_browser);

async fn context() -> GpuContext {
    match GpuContext::new().await {
        Ok(gpu) => gpu,
        Err(error) => panic!("this browser gave no WebGPU adapter: {error}"),
    }
}

#[wasm_bindgen_test]
async fn every_standard_kernel_check_passes_on_webgpu() {
    let gpu = context().await;
    let all = checks::standard_checks();
    let mut failures = Vec::new();
    for check in &all {
        if let Err(error) = checks::run(&gpu, check).await {
            failures.push(error.to_string());
        }
    }
    console_log!(
        "{}: {} kernel checks, {} failed, {} pipelines",
        gpu.adapter_description(),
        all.len(),
        failures.len(),
        gpu.cached_pipelines()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[wasm_bindgen_test]
async fn a_wrong_kernel_fails_its_check_on_webgpu() {
    let gpu = context().await;
    let mut check = checks::unary(Unary::Relu, 100, 3);
    check.steps[0].0 = Unary::Identity.forward(100);
    assert!(checks::run(&gpu, &check).await.is_err());
}
