//! The wgpu runtime for the kernels: one [`GpuContext`] per device, holding
//! the compiled pipelines, running on WebGPU in a browser and on
//! Vulkan/Metal/DX12 natively (lavapipe, a software Vulkan, in tests).
//!
//! Everything is `async` so the same code runs in a browser, where nothing may
//! block; natively the waits are `Device::poll` calls, which block the calling
//! thread until the GPU is done, so callers there can drive the futures with
//! any executor, `pollster` included.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use futures_channel::oneshot;

use super::matmul::check_shape;
use super::spec::{Binding, KernelSpec};
use super::{KernelError, MatmulKernel, matmul_flops, sample_matrix};

/// Side of the largest product [`GpuContext::benchmark_gflops`] times: 48
/// MiB of operands, a few milliseconds on the fastest GPUs.
pub const BENCHMARK_MAX_N: u32 = 2048;

/// Everything that can go wrong running a kernel on a GPU.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GpuError {
    /// No GPU adapter: no WebGPU in this browser, or no GPU driver natively.
    #[error("no GPU adapter is available: {reason}")]
    NoAdapter { reason: String },
    #[error("the GPU adapter refused to open a device: {0}")]
    RequestDevice(String),
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// An operand or the result is larger than one buffer binding may be.
    #[error("{what} needs {bytes} bytes but this GPU binds at most {limit} bytes")]
    BufferTooLarge {
        what: &'static str,
        bytes: u64,
        limit: u64,
    },
    #[error("a kernel needs {needed} workgroups along one axis but this GPU allows {limit}")]
    TooManyWorkgroups { needed: u64, limit: u32 },
    #[error("a benchmark needs n >= 1 and iterations >= 1, got n = {n}, iterations = {iterations}")]
    InvalidBenchmark { n: u32, iterations: u32 },
    /// wgpu reported a validation or out-of-memory error.
    #[error("the GPU rejected the work: {0}")]
    Wgpu(String),
    #[error("reading the result back from the GPU failed: {0}")]
    Readback(String),
    #[error("waiting for the GPU failed: {0}")]
    Poll(String),
    /// The device dropped a completion callback without calling it, which
    /// happens when the device is lost.
    #[error("the GPU device went away before the work finished")]
    DeviceLost,
    #[error("the benchmark ran too fast for the clock to measure ({seconds} s)")]
    ClockTooCoarse { seconds: f64 },
}

/// A GPU device and the pipelines compiled on it so far, one per generated
/// kernel source, ready to run any number of times.
#[derive(Debug)]
pub struct GpuContext {
    adapter_info: wgpu::AdapterInfo,
    adapter_limits: wgpu::Limits,
    device: wgpu::Device,
    queue: wgpu::Queue,
    kernel: MatmulKernel,
    pipelines: Mutex<HashMap<PipelineKey, Arc<CachedPipeline>>>,
    /// Readback buffers by size, reused: a stage reads the same few sizes
    /// every micro-batch, and a fresh mappable buffer costs the driver an
    /// allocation and the host its first touch of every page.
    staging: Mutex<HashMap<u64, Vec<wgpu::Buffer>>>,
}

/// Readback buffers kept per size, and the largest kept.
const STAGING_PER_SIZE: usize = 4;
const STAGING_MAX_BYTES: u64 = 256 << 20;

/// Pipelines are cached by what determines them: the source, the entry
/// point, and the binding kinds.
type PipelineKey = (String, &'static str, Vec<Binding>);

#[derive(Debug)]
struct CachedPipeline {
    layout: wgpu::BindGroupLayout,
    pipeline: wgpu::ComputePipeline,
}

/// A buffer that lives on the GPU: upload once, bind to any number of
/// dispatches, read back when needed. Elements are 32-bit words (f32, u32 or
/// i32, as the kernel declares them).
#[derive(Debug)]
pub struct GpuBuffer {
    buffer: wgpu::Buffer,
    words: usize,
}

impl GpuBuffer {
    /// Its length in 32-bit words.
    pub fn len(&self) -> usize {
        self.words
    }

    pub fn is_empty(&self) -> bool {
        self.words == 0
    }
}

/// The layout of the `Dims` uniform of the generated WGSL.
#[repr(C)]
#[derive(Debug, Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Dims {
    m: u32,
    k: u32,
    n: u32,
    pad: u32,
}

/// An opened GPU: what every [`GpuContext`] of a process shares.
#[derive(Clone)]
struct Opened {
    adapter_info: wgpu::AdapterInfo,
    adapter_limits: wgpu::Limits,
    device: wgpu::Device,
    queue: wgpu::Queue,
}

/// Natively, the device every context of this process shares: drivers limit
/// how many instances and devices one process may open (NVIDIA's Vulkan
/// driver refused the eleventh context of one test process on an H200), and
/// one device per process is what a provider needs anyway.
#[cfg(not(target_arch = "wasm32"))]
static OPENED: Mutex<Option<Opened>> = Mutex::new(None);

impl Opened {
    /// The process's opened GPU, opening it on first use. A failure is not
    /// remembered, so a later call tries again.
    #[cfg(not(target_arch = "wasm32"))]
    async fn shared() -> Result<Self, GpuError> {
        if let Some(opened) = OPENED.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            return Ok(opened);
        }
        let opened = Self::open().await?;
        let mut slot = OPENED.lock().unwrap_or_else(|e| e.into_inner());
        // Two first uses may race; the first one stored wins.
        Ok(slot.get_or_insert(opened).clone())
    }

    /// A browser tab opens its GPU once anyway.
    #[cfg(target_arch = "wasm32")]
    async fn shared() -> Result<Self, GpuError> {
        Self::open().await
    }

    /// Opens the best GPU adapter with everything it offers.
    async fn open() -> Result<Self, GpuError> {
        // `from_env` lets WGPU_BACKEND / WGPU_ADAPTER_NAME pick an adapter on
        // machines with several; in a browser there is no environment.
        let instance =
            wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
        let adapter = instance
            .request_adapter(&wgpu::RequestAdapterOptions {
                power_preference: wgpu::PowerPreference::HighPerformance,
                ..Default::default()
            })
            .await
            .map_err(|e| GpuError::NoAdapter {
                reason: e.to_string(),
            })?;
        #[cfg_attr(not(target_arch = "wasm32"), allow(unused_mut))]
        let mut adapter_info = adapter.get_info();
        #[cfg(target_arch = "wasm32")]
        if adapter_info.name.trim().is_empty()
            && let Some(name) = browser_adapter_name().await
        {
            adapter_info.name = name;
        }
        let adapter_limits = adapter.limits();
        let tensor = tensor_cores_of(&adapter, &adapter_info, &adapter_limits);
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("rookery"),
                required_features: if tensor {
                    TENSOR_FEATURES
                } else {
                    wgpu::Features::empty()
                },
                // Everything the adapter offers, so the largest matmul it can
                // hold is also the largest we accept.
                required_limits: adapter_limits.clone(),
                experimental_features: experimental(tensor),
                ..Default::default()
            })
            .await
            .map_err(|e| GpuError::RequestDevice(e.to_string()))?;
        crate::gemm::precision::set_tensor_cores(tensor);
        // A software adapter (lavapipe) runs one workgroup per CPU thread
        // at a time, and large blocks fastest.
        #[cfg(not(target_arch = "wasm32"))]
        if adapter_info.device_type == wgpu::DeviceType::Cpu {
            let threads = std::thread::available_parallelism().map_or(2, usize::from);
            crate::gemm::set_busy_blocks(threads);
        }
        Ok(Self {
            adapter_info,
            adapter_limits,
            device,
            queue,
        })
    }
}

/// wgpu's consent token for experimental features, given only when the
/// tensor-core kernels will run.
#[allow(unsafe_code)]
fn experimental(tensor: bool) -> wgpu::ExperimentalFeatures {
    if tensor {
        // SAFETY: cooperative matrices are the only experimental feature
        // requested, and only where the adapter reports the exact
        // configuration the tensor-core kernels are generated for; the GPU
        // kit's checks run those kernels on such GPUs.
        unsafe { wgpu::ExperimentalFeatures::enabled() }
    } else {
        wgpu::ExperimentalFeatures::disabled()
    }
}

/// What the tensor-core form of mixed-precision GEMMs needs of a device.
const TENSOR_FEATURES: wgpu::Features = wgpu::Features::SHADER_F16
    .union(wgpu::Features::SUBGROUP)
    .union(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX);

/// Whether `adapter` runs the tensor-core GEMMs ([`crate::gemm::tensor`]):
/// f16 shaders, subgroups, cooperative matrices of 16 x 16 x 16 with f16
/// operands and f32 accumulators, subgroups of exactly the size the kernels
/// are generated for, and their workgroup memory. `ROOKERY_TENSOR_CORES=off`
/// turns them off natively (the plain form computes the same).
fn tensor_cores_of(
    adapter: &wgpu::Adapter,
    info: &wgpu::AdapterInfo,
    limits: &wgpu::Limits,
) -> bool {
    use crate::gemm::tensor::{FRAGMENT, SUBGROUP, TENSOR_WORKGROUP_BYTES};
    #[cfg(not(target_arch = "wasm32"))]
    if std::env::var("ROOKERY_TENSOR_CORES").is_ok_and(|v| v == "off") {
        return false;
    }
    adapter.features().contains(TENSOR_FEATURES)
        && info.subgroup_min_size == SUBGROUP
        && info.subgroup_max_size == SUBGROUP
        && limits.max_compute_workgroup_storage_size >= TENSOR_WORKGROUP_BYTES
        && limits.max_compute_invocations_per_workgroup >= 256
        && adapter.cooperative_matrix_properties().iter().any(|p| {
            [p.m_size, p.n_size, p.k_size] == [FRAGMENT; 3]
                && p.ab_type == wgpu::CooperativeScalarType::F16
                && p.cr_type == wgpu::CooperativeScalarType::F32
        })
}

impl GpuContext {
    /// Opens the best GPU adapter with the default [`MatmulKernel`].
    pub async fn new() -> Result<Self, GpuError> {
        Self::with_kernel(MatmulKernel::default()).await
    }

    /// Opens the best GPU adapter and compiles `kernel` for it, as the kernel
    /// [`Self::matmul`] runs.
    pub async fn with_kernel(kernel: MatmulKernel) -> Result<Self, GpuError> {
        let Opened {
            adapter_info,
            adapter_limits,
            device,
            queue,
        } = Opened::shared().await?;
        let context = Self {
            adapter_info,
            adapter_limits,
            device,
            queue,
            kernel,
            pipelines: Mutex::new(HashMap::new()),
            staging: Mutex::new(HashMap::new()),
        };
        // Compiles the matmul now, so a broken kernel fails here, not later.
        context.pipeline(&context.matmul_spec(1, 1)).await?;
        Ok(context)
    }

    /// The adapter in words for people: name, backend, whether it is a
    /// software renderer, and driver, e.g. `llvmpipe (LLVM 15.0.6, 256 bits)
    /// (vulkan, software, llvmpipe: Mesa 22.3.6 (LLVM 15.0.6))` natively or
    /// `google swiftshader (webgpu, software)` in a browser, where only the
    /// vendor and architecture are revealed.
    pub fn adapter_description(&self) -> String {
        let info = &self.adapter_info;
        let name = if info.name.trim().is_empty() {
            "unnamed adapter"
        } else {
            info.name.trim()
        };
        let backend = info.backend.to_string();
        // A software rasteriser donates CPU time, not a GPU: say so.
        let software = if info.device_type == wgpu::DeviceType::Cpu {
            "software"
        } else {
            ""
        };
        let driver = [info.driver.trim(), info.driver_info.trim()]
            .into_iter()
            .filter(|part| !part.is_empty())
            .collect::<Vec<_>>()
            .join(": ");
        let details = [backend.as_str(), software, driver.as_str()]
            .into_iter()
            .filter(|part| !part.is_empty())
            .collect::<Vec<_>>()
            .join(", ");
        format!("{name} ({details})")
    }

    /// Whether mixed-precision GEMMs run on this adapter's tensor cores
    /// (cooperative matrices) rather than in their plain form.
    pub fn tensor_cores(&self) -> bool {
        crate::gemm::precision::tensor_cores()
    }

    /// Everything wgpu knows about the adapter.
    pub fn adapter_info(&self) -> &wgpu::AdapterInfo {
        &self.adapter_info
    }

    /// The kernel [`Self::matmul`] runs.
    pub fn kernel(&self) -> MatmulKernel {
        self.kernel
    }

    /// The largest buffer the adapter can create, in bytes.
    pub fn max_buffer_size(&self) -> u64 {
        self.adapter_limits.max_buffer_size
    }

    /// The largest storage buffer one binding can see, in bytes: this bounds
    /// each of A, B and C.
    pub fn max_storage_buffer_binding_size(&self) -> u64 {
        self.adapter_limits.max_storage_buffer_binding_size
    }

    /// Pipelines compiled so far (one per distinct generated kernel).
    pub fn cached_pipelines(&self) -> usize {
        self.pipelines.lock().map_or(0, |p| p.len())
    }

    /// A zeroed buffer of `words` 32-bit words. Zero-sized bindings are not
    /// allowed, so an empty buffer still takes one word (and reports 0).
    pub fn create_buffer(&self, words: usize) -> Result<GpuBuffer, GpuError> {
        let bytes = self.buffer_bytes(words)?;
        let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("rookery buffer"),
            size: bytes,
            usage: BUFFER_USAGES,
            mapped_at_creation: false,
        });
        Ok(GpuBuffer { buffer, words })
    }

    /// A buffer holding `data`.
    pub fn upload_f32(&self, data: &[f32]) -> Result<GpuBuffer, GpuError> {
        self.upload_words(bytemuck::cast_slice(data), data.len())
    }

    /// A buffer holding `data` (indices, seeds, uniforms).
    pub fn upload_u32(&self, data: &[u32]) -> Result<GpuBuffer, GpuError> {
        self.upload_words(bytemuck::cast_slice(data), data.len())
    }

    /// Overwrites the start of `buffer` with `data` (queued: it happens before
    /// any dispatch submitted later), e.g. the next micro-batch's input.
    pub fn write_f32(&self, buffer: &GpuBuffer, data: &[f32]) -> Result<(), GpuError> {
        self.write_words(buffer, bytemuck::cast_slice(data), data.len())
    }

    pub fn write_u32(&self, buffer: &GpuBuffer, data: &[u32]) -> Result<(), GpuError> {
        self.write_words(buffer, bytemuck::cast_slice(data), data.len())
    }

    fn write_words(&self, buffer: &GpuBuffer, bytes: &[u8], words: usize) -> Result<(), GpuError> {
        if words > buffer.words.max(1) {
            return Err(GpuError::Kernel(KernelError::ShapeMismatch {
                operand: "written data",
                expected: buffer.words,
                actual: words,
            }));
        }
        if !bytes.is_empty() {
            self.queue.write_buffer(&buffer.buffer, 0, bytes);
        }
        Ok(())
    }

    fn upload_words(&self, bytes: &[u8], words: usize) -> Result<GpuBuffer, GpuError> {
        let buffer = self.create_buffer(words)?;
        self.write_words(&buffer, bytes, words)?;
        Ok(buffer)
    }

    /// Bytes of a buffer of `words` words: at least one word, rounded up to
    /// 16 bytes (what uniforms need), and within the binding limit.
    fn buffer_bytes(&self, words: usize) -> Result<u64, GpuError> {
        let limit = self
            .max_storage_buffer_binding_size()
            .min(self.max_buffer_size());
        let bytes = (words.max(1) as u64)
            .checked_mul(4)
            .map(|b| b.div_ceil(16) * 16)
            .unwrap_or(u64::MAX);
        if bytes > limit {
            return Err(GpuError::BufferTooLarge {
                what: "a buffer",
                bytes,
                limit,
            });
        }
        Ok(bytes)
    }

    /// The pipeline of `spec`, compiled on first use.
    async fn pipeline(&self, spec: &KernelSpec) -> Result<Arc<CachedPipeline>, GpuError> {
        let key: PipelineKey = (spec.wgsl.clone(), spec.entry, spec.bindings.clone());
        if let Some(found) = self
            .pipelines
            .lock()
            .ok()
            .and_then(|p| p.get(&key).cloned())
        {
            return Ok(found);
        }
        let scope = ErrorScopes::push(&self.device);
        let entries: Vec<_> = spec
            .bindings
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let ty = match b {
                    Binding::Uniform => wgpu::BufferBindingType::Uniform,
                    Binding::Read => wgpu::BufferBindingType::Storage { read_only: true },
                    Binding::ReadWrite => wgpu::BufferBindingType::Storage { read_only: false },
                };
                buffer_entry(i as u32, ty)
            })
            .collect();
        let layout = self
            .device
            .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                label: Some(&spec.label),
                entries: &entries,
            });
        let pipeline_layout = self
            .device
            .create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                label: Some(&spec.label),
                bind_group_layouts: &[Some(&layout)],
                immediate_size: 0,
            });
        let module = self
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(&spec.label),
                source: wgpu::ShaderSource::Wgsl(Cow::Owned(spec.wgsl.clone())),
            });
        let pipeline = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(&spec.label),
                layout: Some(&pipeline_layout),
                module: &module,
                entry_point: Some(spec.entry),
                compilation_options: Default::default(),
                cache: None,
            });
        scope.check().await?;
        let cached = Arc::new(CachedPipeline { layout, pipeline });
        if let Ok(mut pipelines) = self.pipelines.lock() {
            pipelines.insert(key, cached.clone());
        }
        Ok(cached)
    }

    /// Runs `spec` once with `buffers` bound in order (binding `i` is
    /// `buffers[i]`). The work is queued; results stay on the GPU until read.
    pub async fn dispatch(
        &self,
        spec: &KernelSpec,
        buffers: &[&GpuBuffer],
    ) -> Result<(), GpuError> {
        self.dispatch_all(&[(spec, buffers)]).await
    }

    /// Runs kernels one after another in a single submission, each seeing
    /// the writes of those before it: a chain of ops with one round trip.
    pub async fn dispatch_all(
        &self,
        steps: &[(&KernelSpec, &[&GpuBuffer])],
    ) -> Result<(), GpuError> {
        let mut compiled = Vec::with_capacity(steps.len());
        for (spec, buffers) in steps {
            if buffers.len() != spec.bindings.len() {
                return Err(GpuError::Kernel(KernelError::ShapeMismatch {
                    operand: "bindings",
                    expected: spec.bindings.len(),
                    actual: buffers.len(),
                }));
            }
            let max_groups = self.adapter_limits.max_compute_workgroups_per_dimension;
            let needed = spec.workgroups.iter().copied().max().unwrap_or(0);
            if needed > max_groups {
                return Err(GpuError::TooManyWorkgroups {
                    needed: u64::from(needed),
                    limit: max_groups,
                });
            }
            compiled.push(self.pipeline(spec).await?);
        }
        let scope = ErrorScopes::push(&self.device);
        let mut encoder = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        {
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: None,
                timestamp_writes: None,
            });
            for ((spec, buffers), cached) in steps.iter().zip(&compiled) {
                let entries: Vec<_> = buffers
                    .iter()
                    .enumerate()
                    .map(|(i, b)| wgpu::BindGroupEntry {
                        binding: i as u32,
                        resource: b.buffer.as_entire_binding(),
                    })
                    .collect();
                let bind_group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                    label: Some(&spec.label),
                    layout: &cached.layout,
                    entries: &entries,
                });
                pass.set_pipeline(&cached.pipeline);
                pass.set_bind_group(0, &bind_group, &[]);
                let [x, y, z] = spec.workgroups;
                pass.dispatch_workgroups(x, y, z);
            }
        }
        self.queue.submit([encoder.finish()]);
        scope.check().await
    }

    /// Reads `buffer` back as f32.
    pub async fn read_f32(&self, buffer: &GpuBuffer) -> Result<Vec<f32>, GpuError> {
        Ok(self
            .read_words(&buffer.buffer, buffer.words)
            .await?
            .into_iter()
            .map(f32::from_bits)
            .collect())
    }

    /// Reads `buffer` back as u32.
    pub async fn read_u32(&self, buffer: &GpuBuffer) -> Result<Vec<u32>, GpuError> {
        self.read_words(&buffer.buffer, buffer.words).await
    }

    async fn read_words(&self, source: &wgpu::Buffer, words: usize) -> Result<Vec<u32>, GpuError> {
        if words == 0 {
            return Ok(Vec::new());
        }
        let bytes = words as u64 * 4;
        let size = bytes.div_ceil(16) * 16;
        let scope = ErrorScopes::push(&self.device);
        let pooled = self
            .staging
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(&size)
            .and_then(Vec::pop);
        let staging = pooled.unwrap_or_else(|| {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("readback"),
                size,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        });
        let mut encoder = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("readback"),
            });
        encoder.copy_buffer_to_buffer(source, 0, &staging, 0, size);
        self.queue.submit([encoder.finish()]);
        let (sender, receiver) = oneshot::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |result| {
            // The receiver is gone only if the caller dropped the future.
            let _ = sender.send(result);
        });
        scope.check().await?;
        self.wait(receiver)
            .await?
            .map_err(|e| GpuError::Readback(e.to_string()))?;
        let out = {
            let view = staging
                .get_mapped_range(..)
                .map_err(|e| GpuError::Readback(e.to_string()))?;
            // A copy that needs no u32 alignment of the mapped range, which
            // not every backend guarantees.
            bytemuck::pod_collect_to_vec::<u8, u32>(&view[..bytes as usize])
        };
        staging.unmap();
        if size <= STAGING_MAX_BYTES {
            let mut pool = self.staging.lock().unwrap_or_else(|e| e.into_inner());
            let kept = pool.entry(size).or_default();
            if kept.len() < STAGING_PER_SIZE {
                kept.push(staging);
            }
        }
        Ok(out)
    }

    /// The matmul as a generic kernel for an `m x n` result.
    fn matmul_spec(&self, m: u32, n: u32) -> KernelSpec {
        let (x, y) = self.kernel.workgroups(m, n);
        KernelSpec {
            label: "matmul".into(),
            wgsl: self.kernel.wgsl(),
            entry: MatmulKernel::ENTRY_POINT,
            bindings: vec![
                Binding::Uniform,
                Binding::Read,
                Binding::Read,
                Binding::ReadWrite,
            ],
            workgroups: [x, y, 1],
        }
    }

    /// Uploads a matmul's operands: the spec and the buffers to bind.
    fn matmul_buffers(
        &self,
        a: &[f32],
        b: &[f32],
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<(KernelSpec, [GpuBuffer; 4]), GpuError> {
        let too_large = || KernelError::TooLarge { m, k, n };
        let dim = |value: usize| u32::try_from(value).map_err(|_| too_large());
        let (m32, k32, n32) = (dim(m)?, dim(k)?, dim(n)?);
        let limit = self
            .max_storage_buffer_binding_size()
            .min(self.max_buffer_size());
        let bytes = |what: &'static str, elements: usize| -> Result<u64, GpuError> {
            let bytes = (elements as u64).checked_mul(4).ok_or_else(too_large)?;
            if bytes > limit {
                return Err(GpuError::BufferTooLarge { what, bytes, limit });
            }
            Ok(bytes)
        };
        bytes("A", a.len())?;
        bytes("B", b.len())?;
        bytes("C", m * n)?;
        let dims = Dims {
            m: m32,
            k: k32,
            n: n32,
            pad: 0,
        };
        let buffers = [
            self.upload_u32(bytemuck::cast_slice(bytemuck::bytes_of(&dims)))?,
            self.upload_f32(a)?,
            self.upload_f32(b)?,
            self.create_buffer(m * n)?,
        ];
        Ok((self.matmul_spec(m32, n32), buffers))
    }

    /// `A * B` on the GPU: `a` is `m x k`, `b` is `k x n`, both row-major; the
    /// result is `m x n`. Uploads both, dispatches once, reads back once.
    pub async fn matmul(
        &self,
        a: &[f32],
        b: &[f32],
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<Vec<f32>, GpuError> {
        let c_len = check_shape(a.len(), b.len(), m, k, n)?;
        if c_len == 0 {
            return Ok(Vec::new());
        }
        if k == 0 {
            // An empty sum; also, zero-sized bindings are not allowed.
            return Ok(vec![0.0; c_len]);
        }
        let (spec, buffers) = self.matmul_buffers(a, b, m, k, n)?;
        let [dims, a, b, c] = &buffers;
        self.dispatch(&spec, &[dims, a, b, c]).await?;
        self.read_f32(c).await
    }

    /// Measured GFLOP/s of `iterations` back-to-back `n x n x n` matmuls on
    /// pseudo-random data, with the GEMM kernel stages run (its tiling
    /// chosen for the shape), after one untimed warm-up dispatch (which
    /// absorbs lazy pipeline compilation). Times submission to completion,
    /// so it includes dispatch overhead, as real work would.
    pub async fn benchmark_matmul_gflops(&self, n: u32, iterations: u32) -> Result<f64, GpuError> {
        if n == 0 || iterations == 0 {
            return Err(GpuError::InvalidBenchmark { n, iterations });
        }
        let size = n as usize;
        // The result first: a size over this GPU's buffer limit is refused
        // before the operands are drawn.
        let c = self.create_buffer(size * size)?;
        let spec = crate::gemm::MatMul::new(&[size, size], &[size, size])
            .ok_or(KernelError::TooLarge {
                m: size,
                k: size,
                n: size,
            })?
            .forward();
        let a = self.upload_f32(&sample_matrix(size * size, 1))?;
        let b = self.upload_f32(&sample_matrix(size * size, 2))?;
        let seconds = self
            .time_dispatches(&spec, &[&a, &b, &c], iterations)
            .await?;
        Ok(matmul_flops(size, size, size) * f64::from(iterations) / seconds / 1e9)
    }

    /// GFLOP/s this GPU gives a stage, in about `budget_s` seconds: the GEMM
    /// kernel on the smallest square product from 256 up that keeps the GPU
    /// busy for a measurable time (up to [`BENCHMARK_MAX_N`]), since a small
    /// one rates a large GPU at a fraction of its speed.
    pub async fn benchmark_gflops(&self, budget_s: f64) -> Result<f64, GpuError> {
        let mut n = 256u32;
        loop {
            let seconds_each = match self.benchmark_matmul_gflops(n, 1).await {
                Ok(gflops) => matmul_flops(n as usize, n as usize, n as usize) / (gflops * 1e9),
                Err(GpuError::ClockTooCoarse { .. }) => 0.0,
                Err(error) => return Err(error),
            };
            let busy = seconds_each * 16.0 >= budget_s;
            if busy || n >= BENCHMARK_MAX_N {
                let iterations = if seconds_each > 0.0 {
                    ((budget_s / 2.0 / seconds_each) as u32).clamp(1, 64)
                } else {
                    64
                };
                return self.benchmark_matmul_gflops(n, iterations).await;
            }
            n *= 2;
        }
    }

    /// Seconds `iterations` back-to-back dispatches of `spec` take, submission
    /// to completion, after one untimed warm-up dispatch.
    pub async fn time_dispatches(
        &self,
        spec: &KernelSpec,
        buffers: &[&GpuBuffer],
        iterations: u32,
    ) -> Result<f64, GpuError> {
        self.dispatch(spec, buffers).await?;
        self.wait_for_queue().await?;
        let steps: Vec<(&KernelSpec, &[&GpuBuffer])> =
            (0..iterations).map(|_| (spec, buffers)).collect();
        let clock = Clock::start();
        self.dispatch_all(&steps).await?;
        self.wait_for_queue().await?;
        let seconds = clock.elapsed_seconds();
        if !seconds.is_finite() || seconds <= 0.0 {
            return Err(GpuError::ClockTooCoarse { seconds });
        }
        Ok(seconds)
    }

    /// Resolves once everything submitted so far has finished on the GPU.
    pub async fn wait_for_queue(&self) -> Result<(), GpuError> {
        let (sender, receiver) = oneshot::channel();
        self.queue.on_submitted_work_done(move || {
            let _ = sender.send(());
        });
        self.wait(receiver).await
    }

    /// Awaits a completion callback. Natively callbacks only run inside
    /// `Device::poll`, so poll until the queue is idle first; in a browser the
    /// event loop runs them and polling is neither needed nor possible.
    async fn wait<T>(&self, receiver: oneshot::Receiver<T>) -> Result<T, GpuError> {
        #[cfg(not(target_arch = "wasm32"))]
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| GpuError::Poll(e.to_string()))?;
        receiver.await.map_err(|_| GpuError::DeviceLost)
    }
}

/// Every buffer can be bound as storage or uniform and copied both ways, so
/// one type serves inputs, outputs, state and uniforms.
const BUFFER_USAGES: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE
    .union(wgpu::BufferUsages::UNIFORM)
    .union(wgpu::BufferUsages::COPY_SRC)
    .union(wgpu::BufferUsages::COPY_DST);

fn buffer_entry(binding: u32, ty: wgpu::BufferBindingType) -> wgpu::BindGroupLayoutEntry {
    wgpu::BindGroupLayoutEntry {
        binding,
        visibility: wgpu::ShaderStages::COMPUTE,
        ty: wgpu::BindingType::Buffer {
            ty,
            has_dynamic_offset: false,
            min_binding_size: None,
        },
        count: None,
    }
}

/// Validation and out-of-memory error scopes around a batch of wgpu calls,
/// so that a mistake becomes a [`GpuError`] instead of wgpu's default
/// handler, which panics natively.
struct ErrorScopes {
    out_of_memory: wgpu::ErrorScopeGuard,
    validation: wgpu::ErrorScopeGuard,
}

impl ErrorScopes {
    fn push(device: &wgpu::Device) -> Self {
        let validation = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let out_of_memory = device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        Self {
            out_of_memory,
            validation,
        }
    }

    /// Pops both scopes at once, before any await: the guards are not
    /// `Send` and are bound to this thread, the future they leave is neither.
    fn check(self) -> impl Future<Output = Result<(), GpuError>> + use<> {
        let out_of_memory = self.out_of_memory.pop();
        let validation = self.validation.pop();
        async move {
            let out_of_memory = out_of_memory.await;
            let validation = validation.await;
            match out_of_memory.or(validation) {
                Some(error) => Err(GpuError::Wgpu(error.to_string())),
                None => Ok(()),
            }
        }
    }
}

/// The adapter's name as the browser states it, which wgpu 30 leaves empty
/// unless the browser fills `GPUAdapterInfo.description` (Chromium does not):
/// the description, else vendor, architecture and device. Asks for a second
/// adapter of the same preference, since wgpu does not expose its own.
#[cfg(target_arch = "wasm32")]
async fn browser_adapter_name() -> Option<String> {
    use js_sys::Reflect;
    use js_sys::wasm_bindgen::{JsCast, JsValue};

    let navigator = Reflect::get(&js_sys::global(), &"navigator".into()).ok()?;
    let gpu = Reflect::get(&navigator, &"gpu".into())
        .ok()
        .filter(JsValue::is_object)?;
    let request_adapter = Reflect::get(&gpu, &"requestAdapter".into())
        .ok()?
        .dyn_into::<js_sys::Function>()
        .ok()?;
    let options = js_sys::Object::new();
    Reflect::set(
        &options,
        &"powerPreference".into(),
        &"high-performance".into(),
    )
    .ok()?;
    let promise = request_adapter
        .call1(&gpu, &options)
        .ok()?
        .dyn_into::<js_sys::Promise>()
        .ok()?;
    let adapter = wasm_bindgen_futures::JsFuture::from(promise)
        .await
        .ok()
        .filter(JsValue::is_object)?;
    let info = Reflect::get(&adapter, &"info".into())
        .ok()
        .filter(JsValue::is_object)?;
    let field = |name: &str| {
        Reflect::get(&info, &name.into())
            .ok()
            .and_then(|value| value.as_string())
            .map(|text| text.trim().to_owned())
            .unwrap_or_default()
    };
    let description = field("description");
    if !description.is_empty() {
        return Some(description);
    }
    let parts: Vec<String> = ["vendor", "architecture", "device"]
        .into_iter()
        .map(field)
        .filter(|part| !part.is_empty())
        .collect();
    (!parts.is_empty()).then(|| parts.join(" "))
}

/// Wall-clock time for the benchmark.
#[cfg(not(target_arch = "wasm32"))]
pub(crate) struct Clock(std::time::Instant);

#[cfg(not(target_arch = "wasm32"))]
impl Clock {
    pub(crate) fn start() -> Self {
        Self(std::time::Instant::now())
    }

    pub(crate) fn elapsed_seconds(&self) -> f64 {
        self.0.elapsed().as_secs_f64()
    }
}

/// Wall-clock time for the benchmark: `performance.now()` where there is one
/// (windows and workers), otherwise `Date.now()`, whose millisecond steps are
/// coarse but still measure a run of a few hundred milliseconds.
#[cfg(target_arch = "wasm32")]
pub(crate) struct Clock(f64);

#[cfg(target_arch = "wasm32")]
impl Clock {
    pub(crate) fn start() -> Self {
        Self(Self::now_ms())
    }

    pub(crate) fn elapsed_seconds(&self) -> f64 {
        (Self::now_ms() - self.0) / 1000.0
    }

    fn now_ms() -> f64 {
        use js_sys::wasm_bindgen::JsCast;
        let performance = js_sys::Reflect::get(&js_sys::global(), &"performance".into())
            .ok()
            .filter(|p| p.is_object());
        if let Some(performance) = performance {
            let now = js_sys::Reflect::get(&performance, &"now".into())
                .ok()
                .and_then(|f| f.dyn_into::<js_sys::Function>().ok())
                .and_then(|f| f.call0(&performance).ok())
                .and_then(|v| v.as_f64());
            if let Some(ms) = now {
                return ms;
            }
        }
        js_sys::Date::now()
    }
}
