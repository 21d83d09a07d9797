//! Tensors between libtorch and the wire: what the worker decodes from the
//! server's messages and encodes into its replies, and why a message could
//! not be carried out.

use rookery_proto::{WireDType, WireTensor};
use tch::{Device, Kind, Tensor};

use rookery_proto::TensorError;

use crate::exec::{ExecError, is_float};

/// Why a message could not be carried out; its text goes into `JobFailed`.
#[derive(Debug, thiserror::Error)]
pub enum TorchWorkerError {
    #[error(transparent)]
    Exec(#[from] ExecError),
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// The message does not fit the assignment or the stage's state.
    #[error("{0}")]
    Protocol(String),
}

impl From<tch::TchError> for TorchWorkerError {
    fn from(error: tch::TchError) -> Self {
        // Through ExecError, which trims libtorch's C++ backtrace.
        TorchWorkerError::Exec(ExecError::from(error))
    }
}

pub(crate) fn protocol(message: impl Into<String>) -> TorchWorkerError {
    TorchWorkerError::Protocol(message.into())
}

/// A CPU tensor from wire bytes: f32, f16, bf16 and int8 (dequantized in
/// Rust) become f32 (`Kind::Float`), i64 stays i64; shaped as declared. Byte
/// counts that do not match the shape, non-finite floats and invalid int8
/// scales or values are refused.
pub fn tensor_from_wire(t: &WireTensor) -> Result<Tensor, TorchWorkerError> {
    let shape: Vec<i64> = t.shape.iter().map(|&d| i64::from(d)).collect();
    if t.dtype == WireDType::F32 && cfg!(target_endian = "little") {
        // Checked on the bytes and copied once: activations and gradients
        // arrive for every micro-batch, and a pass over them costs as much as
        // a small layer.
        t.check()?;
        return Ok(Tensor::f_from_data_size(&t.data, &shape, Kind::Float)?);
    }
    let flat = match t.dtype {
        WireDType::I64 => Tensor::f_from_slice(&t.to_i64()?)?,
        WireDType::F32 | WireDType::F16 | WireDType::Bf16 | WireDType::I8Block => {
            t.check()?;
            Tensor::f_from_slice(&t.to_f32()?)?
        }
    };
    Ok(flat.f_reshape(shape.as_slice())?)
}

/// Wire bytes of a tensor on any device: floating-point tensors as `dtype`
/// (f32, f16, bf16, or int8, quantized in Rust from the f32 values after the
/// copy to the CPU), integer tensors as i64 whatever `dtype` says.
pub fn tensor_to_wire(
    name: &str,
    t: &Tensor,
    dtype: WireDType,
) -> Result<WireTensor, TorchWorkerError> {
    let t = t.f_detach()?.f_to_device(Device::Cpu)?;
    let shape: Vec<usize> = t.size().iter().map(|&d| d.max(0) as usize).collect();
    let numel = shape.iter().product::<usize>();
    if is_float(t.kind()) {
        if !dtype.is_float() {
            return Err(protocol(format!(
                "tensor `{name}` is floating point and cannot travel as {}",
                dtype.as_str()
            )));
        }
        let t = t.f_to_kind(Kind::Float)?.f_contiguous()?;
        if dtype == WireDType::F32 && cfg!(target_endian = "little") {
            // Straight into the wire bytes, one copy.
            let mut bytes = vec![0u8; numel * 4];
            t.f_copy_data_u8(&mut bytes, numel)?;
            return Ok(WireTensor::from_le_bytes(name, &shape, dtype, bytes));
        }
        let mut values = vec![0f32; numel];
        t.f_copy_data(&mut values, numel)?;
        Ok(WireTensor::from_f32(name, &shape, &values, dtype))
    } else {
        let t = t.f_to_kind(Kind::Int64)?.f_contiguous()?;
        let mut values = vec![0i64; numel];
        t.f_copy_data(&mut values, numel)?;
        Ok(WireTensor::from_i64(name, &shape, &values))
    }
}
