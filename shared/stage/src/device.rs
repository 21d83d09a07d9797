//! Where a stage's kernels run: the [`Device`] trait and its two devices,
//! [`CpuDevice`] (the kernels' plain-Rust references: the fallback for
//! browsers without WebGPU, and an oracle) and, behind the `gpu` feature,
//! [`GpuDevice`] (the generated WGSL through wgpu: WebGPU in browsers,
//! Vulkan/Metal/DX12 natively).

use std::future::Future;
use std::sync::Mutex;

use crate::StageError;
use crate::kernel::Kernel;

/// A kernel with what its device prepared for it and its buffers, in binding
/// order: one entry of [`Device::run`].
pub type BoundCall<'a, P, B> = (&'a Kernel, &'a P, Vec<&'a B>);

/// A place to keep tensors and run [`Kernel`]s on them. Buffers hold 32-bit
/// words (f32 values, u32 labels and uniforms).
pub trait Device {
    type Buffer;
    /// What the device needs of a kernel before running it (compiled once per
    /// kernel and reused every micro-batch).
    type Prepared;

    /// For people: the adapter or "CPU".
    fn describe(&self) -> String;

    /// A zeroed buffer of `words` words.
    fn alloc(&self, words: usize) -> Result<Self::Buffer, StageError>;

    fn write_f32(&self, buffer: &Self::Buffer, data: &[f32]) -> Result<(), StageError>;

    fn write_u32(&self, buffer: &Self::Buffer, data: &[u32]) -> Result<(), StageError>;

    fn prepare(&self, kernel: &Kernel) -> Self::Prepared;

    /// Runs `calls` in order, each seeing the writes of those before it.
    fn run(
        &self,
        calls: &[BoundCall<'_, Self::Prepared, Self::Buffer>],
    ) -> impl Future<Output = Result<(), StageError>>;

    fn read_f32(&self, buffer: &Self::Buffer)
    -> impl Future<Output = Result<Vec<f32>, StageError>>;

    /// The buffer's words as they are (packed int8 payloads).
    fn read_u32(&self, buffer: &Self::Buffer)
    -> impl Future<Output = Result<Vec<u32>, StageError>>;
}

/// Runs every kernel's CPU reference. Slow, exact to the references'
/// precision, and available everywhere.
#[derive(Debug, Default, Clone, Copy)]
pub struct CpuDevice;

/// A [`CpuDevice`] buffer.
#[derive(Debug)]
pub struct CpuBuffer(Mutex<Vec<u32>>);

impl CpuBuffer {
    fn words(&self) -> Vec<u32> {
        self.0.lock().map(|w| w.clone()).unwrap_or_default()
    }

    fn set(&self, words: Vec<u32>) {
        if let Ok(mut w) = self.0.lock() {
            *w = words;
        }
    }
}

impl CpuDevice {
    /// Overwrites the start of `buffer`, as a GPU queue write does.
    fn write_words(buffer: &CpuBuffer, data: impl Iterator<Item = u32>) -> Result<(), StageError> {
        let mut words = buffer.words();
        for (slot, w) in words.iter_mut().zip(data) {
            *slot = w;
        }
        buffer.set(words);
        Ok(())
    }
}

impl Device for CpuDevice {
    type Buffer = CpuBuffer;
    type Prepared = ();

    fn describe(&self) -> String {
        "CPU (reference kernels)".into()
    }

    fn alloc(&self, words: usize) -> Result<CpuBuffer, StageError> {
        Ok(CpuBuffer(Mutex::new(vec![0; words])))
    }

    fn write_f32(&self, buffer: &CpuBuffer, data: &[f32]) -> Result<(), StageError> {
        Self::write_words(buffer, data.iter().map(|v| v.to_bits()))
    }

    fn write_u32(&self, buffer: &CpuBuffer, data: &[u32]) -> Result<(), StageError> {
        Self::write_words(buffer, data.iter().copied())
    }

    fn prepare(&self, _kernel: &Kernel) {}

    async fn run(&self, calls: &[BoundCall<'_, (), CpuBuffer>]) -> Result<(), StageError> {
        for (kernel, (), buffers) in calls {
            let mut words: Vec<Vec<u32>> = buffers.iter().map(|b| b.words()).collect();
            kernel.cpu(&mut words);
            for (buffer, w) in buffers.iter().zip(words) {
                buffer.set(w);
            }
        }
        Ok(())
    }

    async fn read_f32(&self, buffer: &CpuBuffer) -> Result<Vec<f32>, StageError> {
        Ok(buffer.words().into_iter().map(f32::from_bits).collect())
    }

    async fn read_u32(&self, buffer: &CpuBuffer) -> Result<Vec<u32>, StageError> {
        Ok(buffer.words())
    }
}

#[cfg(feature = "gpu")]
pub use gpu::GpuDevice;

#[cfg(feature = "gpu")]
mod gpu {
    use rookery_kernels::{GpuBuffer, GpuContext, KernelSpec};

    use super::{BoundCall, Device};
    use crate::StageError;
    use crate::kernel::Kernel;

    /// Runs the generated WGSL on a GPU through wgpu.
    #[derive(Debug)]
    pub struct GpuDevice {
        context: GpuContext,
    }

    impl GpuDevice {
        pub fn new(context: GpuContext) -> Self {
            Self { context }
        }

        /// Opens the best adapter there is.
        pub async fn open() -> Result<Self, StageError> {
            Ok(Self::new(GpuContext::new().await.map_err(gpu_error)?))
        }

        pub fn context(&self) -> &GpuContext {
            &self.context
        }
    }

    fn gpu_error(e: rookery_kernels::GpuError) -> StageError {
        StageError::Device(e.to_string())
    }

    impl Device for GpuDevice {
        type Buffer = GpuBuffer;
        type Prepared = KernelSpec;

        fn describe(&self) -> String {
            self.context.adapter_description()
        }

        fn alloc(&self, words: usize) -> Result<GpuBuffer, StageError> {
            self.context.create_buffer(words).map_err(gpu_error)
        }

        fn write_f32(&self, buffer: &GpuBuffer, data: &[f32]) -> Result<(), StageError> {
            self.context.write_f32(buffer, data).map_err(gpu_error)
        }

        fn write_u32(&self, buffer: &GpuBuffer, data: &[u32]) -> Result<(), StageError> {
            self.context.write_u32(buffer, data).map_err(gpu_error)
        }

        fn prepare(&self, kernel: &Kernel) -> KernelSpec {
            kernel.spec()
        }

        async fn run(
            &self,
            calls: &[BoundCall<'_, KernelSpec, GpuBuffer>],
        ) -> Result<(), StageError> {
            if calls.is_empty() {
                return Ok(());
            }
            let steps: Vec<(&KernelSpec, &[&GpuBuffer])> = calls
                .iter()
                .map(|(_, spec, buffers)| (*spec, buffers.as_slice()))
                .collect();
            self.context.dispatch_all(&steps).await.map_err(gpu_error)
        }

        async fn read_f32(&self, buffer: &GpuBuffer) -> Result<Vec<f32>, StageError> {
            self.context.read_f32(buffer).await.map_err(gpu_error)
        }

        async fn read_u32(&self, buffer: &GpuBuffer) -> Result<Vec<u32>, StageError> {
            self.context.read_u32(buffer).await.map_err(gpu_error)
        }
    }
}
