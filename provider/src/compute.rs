//! The devices a provider can compute on, measured so the provider can
//! describe itself in `Hello` (the stages themselves run through
//! `rookery_stage::worker::ComputeDevice`s). libtorch sits behind the `torch`
//! feature so a plain `cargo check --workspace` needs no libtorch.

use std::time::{Duration, Instant};

/// Which device the user asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceChoice {
    /// CUDA when libtorch sees a GPU, else CPU.
    Auto,
    Cpu,
    Cuda,
}

pub use rookery_stage::session::DeviceOffer;

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("CUDA was requested but {0}")]
    CudaUnavailable(String),
    #[error("the benchmark measured no throughput (elapsed {0:?})")]
    NoThroughput(Duration),
}

/// A device of this machine that runs tensor maths.
pub trait ComputeDevice: Send {
    /// Measures the device: matmul throughput and usable memory.
    fn profile(&self) -> Result<DeviceOffer, ProfileError>;
}

/// Picks the best device this build has for `choice`.
pub fn select(choice: DeviceChoice) -> Result<Box<dyn ComputeDevice>, ProfileError> {
    #[cfg(feature = "torch")]
    {
        Ok(Box::new(torch::TorchCompute::new(choice)?))
    }
    #[cfg(not(feature = "torch"))]
    {
        match choice {
            DeviceChoice::Cuda => Err(ProfileError::CudaUnavailable(
                "this build has no libtorch (rebuild with `--features torch`)".into(),
            )),
            DeviceChoice::Auto | DeviceChoice::Cpu => Ok(Box::new(ReferenceCompute)),
        }
    }
}

/// Times `run` (one `flops_per_run` operation) for at least `budget`, after
/// one warm-up call, and returns GFLOP/s of the fastest run.
///
/// The fastest, not the mean: whatever else runs on the machine (other
/// providers measuring themselves at the same moment, as `rookery train`'s
/// do) only ever slows a run down, and the planner wants the device's own
/// speed. Means measured side by side differed by 2x between identical
/// local providers and sent the whole model to whichever measured fastest.
pub fn measure_gflops(
    flops_per_run: f64,
    budget: Duration,
    mut run: impl FnMut(),
) -> Result<f64, ProfileError> {
    run();
    let started = Instant::now();
    let mut runs = 0u32;
    let mut fastest = Duration::MAX;
    while runs < 2 || started.elapsed() < budget {
        let this = Instant::now();
        run();
        fastest = fastest.min(this.elapsed());
        runs += 1;
    }
    let elapsed = started.elapsed();
    let gflops = flops_per_run / fastest.as_secs_f64() / 1e9;
    if gflops.is_finite() && gflops > 0.0 {
        Ok(gflops)
    } else {
        Err(ProfileError::NoThroughput(elapsed))
    }
}

/// Total RAM, or 0 when the OS will not say (the server then refuses the
/// provider with a clear reason rather than planning with a guess).
pub fn host_memory_bytes() -> u64 {
    sysinfo::System::new()
        .map(|mut system| {
            system.refresh_memory();
            system.total_memory()
        })
        .unwrap_or(0)
}

/// The plain-Rust CPU reference kernels from `rookery-kernels`: slow, but
/// available everywhere, so a build without libtorch still runs.
#[derive(Debug)]
pub struct ReferenceCompute;

impl ComputeDevice for ReferenceCompute {
    fn profile(&self) -> Result<DeviceOffer, ProfileError> {
        let n = 128;
        let a: Vec<f32> = (0..n * n).map(|i| (i % 7) as f32).collect();
        let b: Vec<f32> = (0..n * n).map(|i| (i % 5) as f32).collect();
        let gflops = measure_gflops(
            rookery_kernels::matmul_flops(n, n, n),
            Duration::from_millis(200),
            || {
                std::hint::black_box(rookery_kernels::matmul_reference(&a, &b, n, n, n));
            },
        )?;
        Ok(DeviceOffer {
            device: "plain-Rust CPU reference (built without libtorch)".into(),
            memory_bytes: host_memory_bytes(),
            gflops,
            max_buffer_bytes: None,
        })
    }
}

#[cfg(feature = "torch")]
pub mod torch {
    //! libtorch through `tch`, on CPU or CUDA.

    use super::*;
    use tch::{Device, Kind, Tensor};

    #[derive(Debug)]
    pub struct TorchCompute {
        device: Device,
    }

    impl TorchCompute {
        pub fn new(choice: DeviceChoice) -> Result<Self, ProfileError> {
            let cuda = tch::Cuda::is_available();
            let device = match choice {
                DeviceChoice::Cpu => Device::Cpu,
                DeviceChoice::Auto if cuda => Device::Cuda(0),
                DeviceChoice::Auto => Device::Cpu,
                DeviceChoice::Cuda if cuda => Device::Cuda(0),
                DeviceChoice::Cuda => {
                    return Err(ProfileError::CudaUnavailable(
                        "libtorch sees no CUDA device".into(),
                    ));
                }
            };
            Ok(Self { device })
        }

        pub fn device(&self) -> Device {
            self.device
        }

        fn describe(&self) -> String {
            match self.device {
                Device::Cuda(index) => format!(
                    "libtorch CUDA device {index} of {}",
                    tch::Cuda::device_count()
                ),
                _ => format!(
                    "libtorch CPU, {} threads{}",
                    tch::get_num_threads(),
                    cpu_brand().map(|b| format!(" ({b})")).unwrap_or_default()
                ),
            }
        }

        fn memory_bytes(&self) -> u64 {
            match self.device {
                Device::Cuda(index) => cuda_memory_bytes(index).unwrap_or_else(host_memory_bytes),
                _ => host_memory_bytes(),
            }
        }
    }

    impl ComputeDevice for TorchCompute {
        fn profile(&self) -> Result<DeviceOffer, ProfileError> {
            let n: i64 = if self.device.is_cuda() { 2048 } else { 512 };
            let options = (Kind::Float, self.device);
            let a = Tensor::randn([n, n], options);
            let b = Tensor::randn([n, n], options);
            let device = self.device;
            let gflops = measure_gflops(
                rookery_kernels::matmul_flops(n as usize, n as usize, n as usize),
                Duration::from_millis(300),
                || {
                    let c = a.matmul(&b);
                    if let Device::Cuda(index) = device {
                        tch::Cuda::synchronize(index as i64);
                    }
                    drop(std::hint::black_box(c));
                },
            )?;
            Ok(DeviceOffer {
                device: self.describe(),
                memory_bytes: self.memory_bytes(),
                gflops,
                max_buffer_bytes: None,
            })
        }
    }

    fn cpu_brand() -> Option<String> {
        let mut system = sysinfo::System::new().ok()?;
        system.refresh_cpu_list(sysinfo::CpuRefreshKind::nothing());
        system
            .cpus()
            .first()
            .map(|cpu| cpu.brand().trim().to_owned())
            .filter(|brand| !brand.is_empty())
    }

    /// libtorch's C API has no memory query, so ask the NVIDIA driver's tool.
    fn cuda_memory_bytes(index: usize) -> Option<u64> {
        let output = std::process::Command::new("nvidia-smi")
            .args([
                "--query-gpu=memory.total",
                "--format=csv,noheader,nounits",
                &format!("--id={index}"),
            ])
            .output()
            .ok()?;
        let mib: u64 = String::from_utf8(output.stdout).ok()?.trim().parse().ok()?;
        Some(mib * 1024 * 1024)
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn libtorch_cpu_profile_is_measured_not_made_up() {
            let device = TorchCompute::new(DeviceChoice::Cpu).unwrap();
            let profile = device.profile().unwrap();
            assert!(
                profile.device.starts_with("libtorch CPU"),
                "{}",
                profile.device
            );
            assert!(profile.gflops > 0.1, "{}", profile.gflops);
            assert_eq!(profile.memory_bytes, host_memory_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measured_throughput_follows_the_work_done() {
        let gflops = measure_gflops(1e9, Duration::from_millis(30), || {
            std::thread::sleep(Duration::from_millis(10));
        })
        .unwrap();
        // One GFLOP per ~10 ms is ~100 GFLOP/s; sleeping can only overshoot.
        assert!(gflops > 20.0 && gflops <= 100.5, "{gflops}");
    }

    #[test]
    fn reference_device_profile_is_positive() {
        let profile = ReferenceCompute.profile().unwrap();
        assert!(profile.gflops > 0.0);
        assert!(profile.memory_bytes > 0);
    }
}
