//! The wgpu runtime for the kernels: one [`GpuContext`] per device, holding
//! the compiled pipelines, running on WebGPU in a browser and on
//! Vulkan/Metal/DX12 natively (lavapipe, a software Vulkan, in tests).
//!
//! Everything is `async` so the same code runs in a browser, where nothing may
//! block; natively the waits are `Device::poll` calls, which block the calling
//! thread until the GPU is done, so callers there can drive the futures with
//! any executor, `pollster` included.

use std::borrow::Cow;

use futures_channel::oneshot;
use wgpu::util::DeviceExt;

use super::matmul::check_shape;
use super::{KernelError, MatmulKernel, matmul_flops, sample_matrix};

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
    #[error("the matmul needs {needed} workgroups along one axis but this GPU allows {limit}")]
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

/// A GPU device with the matmul pipeline compiled, ready to run it any number
/// of times.
#[derive(Debug)]
pub struct GpuContext {
    adapter_info: wgpu::AdapterInfo,
    adapter_limits: wgpu::Limits,
    device: wgpu::Device,
    queue: wgpu::Queue,
    kernel: MatmulKernel,
    layout: wgpu::BindGroupLayout,
    pipeline: wgpu::ComputePipeline,
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

/// The buffers and bind group of one matmul shape, with A and B uploaded.
struct MatmulBuffers {
    c: wgpu::Buffer,
    c_bytes: u64,
    bind_group: wgpu::BindGroup,
    workgroups: (u32, u32),
}

impl GpuContext {
    /// Opens the best GPU adapter with the default [`MatmulKernel`].
    pub async fn new() -> Result<Self, GpuError> {
        Self::with_kernel(MatmulKernel::default()).await
    }

    /// Opens the best GPU adapter and compiles `kernel` for it.
    pub async fn with_kernel(kernel: MatmulKernel) -> Result<Self, GpuError> {
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
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("rookery"),
                // Everything the adapter offers, so the largest matmul it can
                // hold is also the largest we accept.
                required_limits: adapter_limits.clone(),
                ..Default::default()
            })
            .await
            .map_err(|e| GpuError::RequestDevice(e.to_string()))?;

        let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("matmul"),
            entries: &[
                buffer_entry(MatmulKernel::BINDING_DIMS, wgpu::BufferBindingType::Uniform),
                buffer_entry(
                    MatmulKernel::BINDING_A,
                    wgpu::BufferBindingType::Storage { read_only: true },
                ),
                buffer_entry(
                    MatmulKernel::BINDING_B,
                    wgpu::BufferBindingType::Storage { read_only: true },
                ),
                buffer_entry(
                    MatmulKernel::BINDING_C,
                    wgpu::BufferBindingType::Storage { read_only: false },
                ),
            ],
        });
        let pipeline_layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some("matmul"),
            bind_group_layouts: &[Some(&layout)],
            immediate_size: 0,
        });
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("matmul"),
            source: wgpu::ShaderSource::Wgsl(Cow::Owned(kernel.wgsl())),
        });
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some("matmul"),
            layout: Some(&pipeline_layout),
            module: &module,
            entry_point: Some(MatmulKernel::ENTRY_POINT),
            compilation_options: Default::default(),
            cache: None,
        });
        // The guard is consumed before the await, so the future stays Send
        // natively.
        if let Some(error) = scope.pop().await {
            return Err(GpuError::Wgpu(error.to_string()));
        }

        Ok(Self {
            adapter_info,
            adapter_limits,
            device,
            queue,
            kernel,
            layout,
            pipeline,
        })
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

    /// Everything wgpu knows about the adapter.
    pub fn adapter_info(&self) -> &wgpu::AdapterInfo {
        &self.adapter_info
    }

    /// The kernel this context runs.
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
        let scope = ErrorScopes::push(&self.device);
        let buffers = self.upload(a, b, m, k, n)?;
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("matmul readback"),
            size: buffers.c_bytes,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut encoder = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("matmul"),
            });
        self.encode_dispatch(&mut encoder, &buffers, 1);
        encoder.copy_buffer_to_buffer(&buffers.c, 0, &staging, 0, buffers.c_bytes);
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
        let c = {
            let view = staging
                .get_mapped_range(..)
                .map_err(|e| GpuError::Readback(e.to_string()))?;
            // Decoded bytewise: the mapped range carries no f32 alignment
            // guarantee on every backend.
            view.chunks_exact(4)
                .map(|bytes| f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
                .collect::<Vec<f32>>()
        };
        staging.unmap();
        Ok(c)
    }

    /// Measured GFLOP/s of `iterations` back-to-back `n x n x n` matmuls on
    /// pseudo-random data, after one untimed warm-up dispatch (which absorbs
    /// lazy pipeline compilation). Times submission to completion, so it
    /// includes dispatch overhead, as real work would.
    pub async fn benchmark_matmul_gflops(&self, n: u32, iterations: u32) -> Result<f64, GpuError> {
        if n == 0 || iterations == 0 {
            return Err(GpuError::InvalidBenchmark { n, iterations });
        }
        let size = n as usize;
        let a = sample_matrix(size * size, 1);
        let b = sample_matrix(size * size, 2);
        let scope = ErrorScopes::push(&self.device);
        let buffers = self.upload(&a, &b, size, size, size)?;
        let mut warm_up = self.device.create_command_encoder(&Default::default());
        self.encode_dispatch(&mut warm_up, &buffers, 1);
        self.queue.submit([warm_up.finish()]);
        scope.check().await?;
        self.wait_for_queue().await?;

        let mut timed = self.device.create_command_encoder(&Default::default());
        self.encode_dispatch(&mut timed, &buffers, iterations);
        let command_buffer = timed.finish();
        let clock = Clock::start();
        self.queue.submit([command_buffer]);
        self.wait_for_queue().await?;
        let seconds = clock.elapsed_seconds();
        if !seconds.is_finite() || seconds <= 0.0 {
            return Err(GpuError::ClockTooCoarse { seconds });
        }
        Ok(matmul_flops(size, size, size) * f64::from(iterations) / seconds / 1e9)
    }

    /// Checks the shape against the device limits, uploads A and B, and
    /// binds them with a fresh C.
    fn upload(
        &self,
        a: &[f32],
        b: &[f32],
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<MatmulBuffers, GpuError> {
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
        let c_bytes = bytes("C", m * n)?;
        let workgroups = self.kernel.workgroups(m32, n32);
        let max_groups = self.adapter_limits.max_compute_workgroups_per_dimension;
        let needed = workgroups.0.max(workgroups.1);
        if needed > max_groups {
            return Err(GpuError::TooManyWorkgroups {
                needed: u64::from(needed),
                limit: max_groups,
            });
        }

        let dims = self
            .device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("matmul dims"),
                contents: bytemuck::bytes_of(&Dims {
                    m: m32,
                    k: k32,
                    n: n32,
                    pad: 0,
                }),
                usage: wgpu::BufferUsages::UNIFORM,
            });
        let storage = |label, data: &[f32]| {
            self.device
                .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some(label),
                    contents: bytemuck::cast_slice(data),
                    usage: wgpu::BufferUsages::STORAGE,
                })
        };
        let a_buffer = storage("matmul A", a);
        let b_buffer = storage("matmul B", b);
        let c = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("matmul C"),
            size: c_bytes,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let bind_group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("matmul"),
            layout: &self.layout,
            entries: &[
                wgpu::BindGroupEntry {
                    binding: MatmulKernel::BINDING_DIMS,
                    resource: dims.as_entire_binding(),
                },
                wgpu::BindGroupEntry {
                    binding: MatmulKernel::BINDING_A,
                    resource: a_buffer.as_entire_binding(),
                },
                wgpu::BindGroupEntry {
                    binding: MatmulKernel::BINDING_B,
                    resource: b_buffer.as_entire_binding(),
                },
                wgpu::BindGroupEntry {
                    binding: MatmulKernel::BINDING_C,
                    resource: c.as_entire_binding(),
                },
            ],
        });
        Ok(MatmulBuffers {
            c,
            c_bytes,
            bind_group,
            workgroups,
        })
    }

    /// Records `times` dispatches of the matmul in one compute pass.
    fn encode_dispatch(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        buffers: &MatmulBuffers,
        times: u32,
    ) {
        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some("matmul"),
            timestamp_writes: None,
        });
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, &buffers.bind_group, &[]);
        for _ in 0..times {
            pass.dispatch_workgroups(buffers.workgroups.0, buffers.workgroups.1, 1);
        }
    }

    /// Resolves once everything submitted so far has finished on the GPU.
    async fn wait_for_queue(&self) -> Result<(), GpuError> {
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
struct Clock(std::time::Instant);

#[cfg(not(target_arch = "wasm32"))]
impl Clock {
    fn start() -> Self {
        Self(std::time::Instant::now())
    }

    fn elapsed_seconds(&self) -> f64 {
        self.0.elapsed().as_secs_f64()
    }
}

/// Wall-clock time for the benchmark: `performance.now()` where there is one
/// (windows and workers), otherwise `Date.now()`, whose millisecond steps are
/// coarse but still measure a run of a few hundred milliseconds.
#[cfg(target_arch = "wasm32")]
struct Clock(f64);

#[cfg(target_arch = "wasm32")]
impl Clock {
    fn start() -> Self {
        Self(Self::now_ms())
    }

    fn elapsed_seconds(&self) -> f64 {
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
