//! What the GPU test binaries share.

use std::sync::OnceLock;

use rookery_kernels::GpuContext;

/// The process's adapter (lavapipe natively), opened once; without one the
/// test fails, it does not skip.
pub fn gpu() -> &'static GpuContext {
    static GPU: OnceLock<GpuContext> = OnceLock::new();
    GPU.get_or_init(|| match pollster::block_on(GpuContext::new()) {
        Ok(context) => context,
        Err(error) => panic!(
            "no usable GPU adapter ({error}); install a Vulkan driver such as \
             mesa-vulkan-drivers (lavapipe) to run these tests"
        ),
    })
}
