//! What is known of one tensor without its values: element type and shape.
//! Both the graph and the ops' shape inference speak in these, so they sit
//! below both.

use serde::{Deserialize, Serialize};

/// Element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    I64,
}

impl DType {
    pub fn size(self) -> u64 {
        match self {
            DType::F32 => 4,
            DType::I64 => 8,
        }
    }
}

/// Shape and element type of one tensor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorInfo {
    pub shape: Vec<usize>,
    pub dtype: DType,
}

impl TensorInfo {
    pub fn bytes(&self) -> u64 {
        self.shape
            .iter()
            .fold(self.dtype.size(), |acc, &d| acc.saturating_mul(d as u64))
    }
}
