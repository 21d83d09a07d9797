//! Browser tests: the matmul kernel of `rookery-kernels` on real WebGPU
//! (headless Chromium, SwiftShader) against the CPU reference, and the
//! donation flow up to the WebSocket. They fail, not skip, without a WebGPU
//! adapter. Run from `web-provider/` with
//! `CHROMEDRIVER=/usr/bin/chromedriver \
//!  CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUNNER=<wasm-bindgen-test-runner> \
//!  cargo test -p rookery-web-provider --target wasm32-unknown-unknown`;
//! `webdriver.json` there gives Chromium the flags WebGPU needs.
#![cfg(target_arch = "wasm32")]
// Clippy's test exemption only knows `#[test]`, not `#[wasm_bindgen_test]`.
#![allow(clippy::unwrap_used)]

use std::cell::RefCell;
use std::rc::Rc;

use futures_util::future::{Either, select};
use gloo_timers::future::TimeoutFuture;
use rookery_kernels::{
    GpuContext, MATMUL_CHECK_SHAPES, MATMUL_REL_TOLERANCE, MatmulKernel, check_matmul,
    sample_matrix,
};
use rookery_web_provider::{DonateStatus, default_server_url, donate};
use wasm_bindgen_test::{console_log, wasm_bindgen_test, wasm_bindgen_test_configure};

wasm_bindgen_test_configure!(run_in_browser);

async fn context(kernel: MatmulKernel) -> GpuContext {
    match GpuContext::with_kernel(kernel).await {
        Ok(gpu) => gpu,
        Err(error) => panic!("this browser gave no WebGPU adapter: {error}"),
    }
}

async fn assert_matches_reference(gpu: &GpuContext, m: usize, k: usize, n: usize, seed: u64) {
    let a = sample_matrix(m * k, seed);
    let b = sample_matrix(k * n, seed + 1);
    let got = match gpu.matmul(&a, &b, m, k, n).await {
        Ok(c) => c,
        Err(error) => panic!("{m}x{k}x{n}, tile {}: {error}", gpu.kernel().tile()),
    };
    if let Err(error) = check_matmul(&a, &b, m, k, n, &got, MATMUL_REL_TOLERANCE) {
        panic!("{m}x{k}x{n}, tile {}: {error}", gpu.kernel().tile());
    }
}

#[wasm_bindgen_test]
async fn webgpu_matmul_equals_the_cpu_reference() {
    let gpu = context(MatmulKernel::default()).await;
    console_log!(
        "adapter: {}; max buffer {} B, max storage binding {} B",
        gpu.adapter_description(),
        gpu.max_buffer_size(),
        gpu.max_storage_buffer_binding_size()
    );
    // wgpu is not a direct dependency here, so compare the backend by name.
    assert_eq!(format!("{:?}", gpu.adapter_info().backend), "BrowserWebGpu");
    for (i, &(m, k, n)) in MATMUL_CHECK_SHAPES.iter().enumerate() {
        assert_matches_reference(&gpu, m, k, n, i as u64).await;
    }
}

#[wasm_bindgen_test]
async fn webgpu_matmul_is_right_for_other_tile_sizes() {
    for tile in [1, 5, 8] {
        let gpu = context(MatmulKernel::new(tile).unwrap()).await;
        for (i, &(m, k, n)) in MATMUL_CHECK_SHAPES.iter().enumerate() {
            assert_matches_reference(&gpu, m, k, n, 50 + i as u64).await;
        }
    }
}

#[wasm_bindgen_test]
async fn webgpu_benchmark_reports_finite_positive_gflops() {
    let gpu = context(MatmulKernel::default()).await;
    let gflops = gpu.benchmark_matmul_gflops(128, 4).await.unwrap();
    console_log!(
        "{}: {gflops:.2} GFLOP/s at n = 128",
        gpu.adapter_description()
    );
    assert!(gflops.is_finite() && gflops > 0.0, "{gflops}");
}

#[wasm_bindgen_test]
fn default_server_url_points_at_the_page_host() {
    let host = web_sys_host();
    assert_eq!(
        default_server_url(),
        Some(format!("ws://{host}/ws/provider"))
    );
}

fn web_sys_host() -> String {
    let location = js_sys::Reflect::get(&js_sys::global(), &"location".into()).unwrap();
    js_sys::Reflect::get(&location, &"host".into())
        .unwrap()
        .as_string()
        .unwrap()
}

/// Runs `donate` until `done` says the statuses so far are enough, or fails
/// after `timeout_ms`. Returns the statuses.
async fn donate_until(
    url: &str,
    timeout_ms: u32,
    done: impl Fn(&[DonateStatus]) -> bool,
) -> Vec<DonateStatus> {
    let statuses = Rc::new(RefCell::new(Vec::new()));
    let sink = Rc::clone(&statuses);
    let donation = Box::pin(donate(url.to_owned(), move |status| {
        console_log!("status: {status:?}");
        sink.borrow_mut().push(status);
    }));
    let watch = Box::pin(async {
        let mut waited = 0;
        while !done(&statuses.borrow()) {
            assert!(
                waited < timeout_ms,
                "timed out; statuses so far: {:?}",
                statuses.borrow()
            );
            TimeoutFuture::new(50).await;
            waited += 50;
        }
    });
    match select(donation, watch).await {
        Either::Left(((), _)) | Either::Right(((), _)) => {}
    }
    statuses.take()
}

#[wasm_bindgen_test]
async fn donation_benchmarks_then_retries_an_unreachable_server() {
    // Port 9 (discard) has no listener: the socket fails to open.
    let statuses = donate_until("ws://127.0.0.1:9/ws/provider", 30_000, |s| {
        s.iter()
            .any(|status| matches!(status, DonateStatus::Reconnecting { .. }))
    })
    .await;
    assert_eq!(statuses[0], DonateStatus::Probing);
    let DonateStatus::Benchmarking { adapter } = &statuses[1] else {
        panic!("{statuses:?}");
    };
    // The self-check's kernel lines, for the Donate page: the kit's
    // kernels timed on this tab's GPU, mixed precision among them.
    let DonateStatus::KernelSpeeds { lines } = &statuses[2] else {
        panic!("{statuses:?}");
    };
    // Within its budget a software renderer gets through the first lines
    // at least; a GPU, all five.
    assert!((2..=5).contains(&lines.len()), "{lines:?}");
    assert!(
        lines.iter().all(|l| l.gflops.is_finite() && l.gflops > 0.0),
        "{lines:?}"
    );
    assert!(lines[0].name.starts_with("matmul 256x256x256"), "{lines:?}");
    assert!(lines[1].name.contains("mixed"), "{lines:?}");
    let DonateStatus::Connecting {
        adapter: connecting_adapter,
        gflops,
    } = &statuses[3]
    else {
        panic!("{statuses:?}");
    };
    assert_eq!(adapter, connecting_adapter);
    assert!(gflops.is_finite() && *gflops > 0.0);
    let DonateStatus::Reconnecting { reason } = &statuses[4] else {
        panic!("{statuses:?}");
    };
    assert!(reason.contains("cannot reach the server"), "{reason}");
    assert!(reason.contains("trying again in 1 s"), "{reason}");
}

#[wasm_bindgen_test]
async fn donation_to_a_malformed_address_fails_for_good() {
    // Browsers resolve relative and http(s) addresses for WebSockets, but no
    // other scheme: the constructor throws, and retrying cannot help.
    let statuses = donate_until("ftp://example.org/ws/provider", 30_000, |s| {
        s.iter()
            .any(|status| matches!(status, DonateStatus::Failed { .. }))
    })
    .await;
    let Some(DonateStatus::Failed { reason }) = statuses.last() else {
        panic!("{statuses:?}");
    };
    assert!(reason.contains("not a usable server address"), "{reason}");
}
