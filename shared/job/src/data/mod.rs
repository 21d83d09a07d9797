//! Datasets: reading a job's data files into preprocessed f32 inputs and
//! labels, and checking them against the model.
//!
//! Formats ([`DataFormat`]): IDX (MNIST; element types u8, i8, i16, i32, f32,
//! f64), `.npy` (versions 1 to 3; `<f2 <f4 <f8 |u1 <u2 <u4 <u8 |i1 <i2 <i4 <i8
//! |b1` and their big-endian forms; C order), `.npz` (`file.npz:array`),
//! safetensors (`file.safetensors:tensor`) and CSV (one sample a row, one
//! column of labels; a non-numeric first row is a header). IDX, `.npy` and CSV
//! files may be gzipped: gzip is recognised by its magic bytes, not the name.
//!
//! Every file is bounds-checked: a corrupt, truncated or oversized-claiming
//! file is an error naming it, never a panic, and the size a header claims is
//! checked against the file before it is allocated (a gzip or zip stream
//! grows its buffer only as data actually arrives).

mod csv;
mod idx;
mod npy;
mod npz;
pub mod raw;
mod st;

use rookery_model::{Graph, Loss};

pub use raw::{ElemType, RawArray};

use crate::error::JobError;
use crate::spec::{DataFormat, DataRef, DataSpec};

/// Which half of the data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Split {
    Train,
    Test,
}

/// Labels, one per sample.
#[derive(Debug, Clone, PartialEq)]
pub enum Labels {
    /// Class indices, for `cross_entropy`.
    Classes(Vec<i64>),
    /// Regression targets, for `mse`: `values` holds `shape`-shaped samples, row-major.
    Targets { shape: Vec<usize>, values: Vec<f32> },
}

impl Labels {
    /// Number of samples.
    pub fn len(&self) -> usize {
        match self {
            Labels::Classes(c) => c.len(),
            Labels::Targets { shape, values } => match shape.iter().product::<usize>() {
                0 => 0,
                k => values.len() / k,
            },
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One split of a job's data, preprocessed.
#[derive(Debug, Clone, PartialEq)]
pub struct Dataset {
    /// One sample's shape, without the batch dimension.
    pub sample_shape: Vec<usize>,
    /// Row-major, `len() * prod(sample_shape)` values, already scaled and
    /// normalised: `(x * scale - mean) / std` in f32.
    pub inputs: Vec<f32>,
    pub labels: Labels,
}

impl Dataset {
    /// Number of samples.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Values in one sample.
    pub fn sample_numel(&self) -> usize {
        self.sample_shape.iter().product()
    }

    /// The inputs of samples `idx`, in that order, as one batch (row-major).
    /// Panics if an index is out of range.
    pub fn gather_inputs(&self, idx: &[usize]) -> Vec<f32> {
        let k = self.sample_numel();
        let mut out = Vec::with_capacity(idx.len() * k);
        for &i in idx {
            out.extend_from_slice(&self.inputs[i * k..(i + 1) * k]);
        }
        out
    }

    /// The labels of samples `idx`, in that order. Panics if an index is out of range.
    pub fn gather_labels(&self, idx: &[usize]) -> Labels {
        match &self.labels {
            Labels::Classes(c) => Labels::Classes(idx.iter().map(|&i| c[i]).collect()),
            Labels::Targets { shape, values } => {
                let k: usize = shape.iter().product();
                let mut out = Vec::with_capacity(idx.len() * k);
                for &i in idx {
                    out.extend_from_slice(&values[i * k..(i + 1) * k]);
                }
                Labels::Targets {
                    shape: shape.clone(),
                    values: out,
                }
            }
        }
    }
}

/// Reads one array of a data file, as stored.
pub fn read_array(format: DataFormat, r: &DataRef) -> Result<RawArray, JobError> {
    if r.member.is_some() && !format.has_members() {
        return Err(JobError::file(
            r,
            "only npz and safetensors files hold named arrays",
        ));
    }
    match format {
        DataFormat::Idx => idx::read(&r.path),
        DataFormat::Npy => npy::read(&r.path),
        DataFormat::Npz => npz::read(r),
        DataFormat::Safetensors => st::read(r),
        DataFormat::Csv => csv::read(&r.path),
    }
}

/// Reads a split's inputs and labels. `Ok(None)` when the job gives no test split.
///
/// The first dimension of each array is the sample index and the rest one
/// sample's shape. For `cross_entropy` the labels must be one integer per
/// sample (integer dtypes, or integral floats) and become [`Labels::Classes`];
/// for `mse` they become [`Labels::Targets`] (f32). Scale and normalisation
/// apply to the inputs only.
pub fn load_split(spec: &DataSpec, split: Split, loss: Loss) -> Result<Option<Dataset>, JobError> {
    let (inputs, labels, fields) = match split {
        Split::Train => (
            Some(&spec.train_inputs),
            Some(&spec.train_labels),
            ("data.train_inputs", "data.train_labels"),
        ),
        Split::Test => (
            spec.test_inputs.as_ref(),
            spec.test_labels.as_ref(),
            ("data.test_inputs", "data.test_labels"),
        ),
    };
    let (inputs, labels) = match (inputs, labels) {
        (Some(i), Some(l)) => (i, l),
        (None, None) => return Ok(None),
        (None, Some(_)) => return Err(JobError::field(fields.0, "missing")),
        (Some(_), None) => return Err(JobError::field(fields.1, "missing")),
    };
    let x = read_array(spec.format, inputs)?;
    let (n, sample_shape) = split_samples(&x)?;
    if sample_shape.contains(&0) {
        return Err(JobError::file(
            x.source(),
            format!("its samples are empty (shape {:?})", x.shape()),
        ));
    }
    let y = read_array(spec.format, labels)?;
    let (n_labels, label_shape) = split_samples(&y)?;
    if n != n_labels {
        return Err(JobError::Mismatch(format!(
            "{} ({}) has {n} samples but {} ({}) has {n_labels}",
            fields.0,
            x.source(),
            fields.1,
            y.source()
        )));
    }
    let labels = match loss {
        Loss::CrossEntropy => {
            if label_shape.iter().product::<usize>() != 1 {
                return Err(JobError::file(
                    y.source(),
                    format!(
                        "cross_entropy needs one integer class per sample; these labels have shape {label_shape:?} per sample"
                    ),
                ));
            }
            Labels::Classes(y.to_classes()?)
        }
        Loss::Mse => {
            if label_shape.contains(&0) {
                return Err(JobError::file(
                    y.source(),
                    format!("its targets are empty (shape {:?})", y.shape()),
                ));
            }
            Labels::Targets {
                shape: label_shape,
                values: y.to_f32(),
            }
        }
    };
    drop(y);
    let (scale, mean, std) = spec.normalisation();
    let inputs = x.map_f32(|v| (v * scale - mean) / std);
    Ok(Some(Dataset {
        sample_shape,
        inputs,
        labels,
    }))
}

/// `(samples, one sample's shape)`.
fn split_samples(a: &RawArray) -> Result<(usize, Vec<usize>), JobError> {
    match a.shape().split_first() {
        Some((&0, _)) => Err(JobError::file(a.source(), "holds no samples")),
        Some((&n, rest)) => Ok((n, rest.to_vec())),
        None => Err(JobError::file(
            a.source(),
            "holds a single number; expected one sample per index of the first dimension",
        )),
    }
}

/// Checks a split against the model and the job, and fits its shapes to them:
///
/// - one sample's shape must be the job's `input_shape`, or hold as many
///   values (IDX's `[28, 28]` for `[1, 28, 28]`): `sample_shape` becomes `input_shape`;
/// - the model must have one output; for `cross_entropy` it must be
///   `[batch, C]` and every label in `0..C` (the error names the first bad
///   label and its index); for `mse` the targets' per-sample shape must be the
///   output's, up to dimensions of size 1 (`[]` or `[1]` for `[batch, 1]`):
///   the targets take the output's per-sample shape.
///
/// Call it for the test split too.
pub fn validate_against_model(
    graph: &Graph,
    input_shape: &[usize],
    data: &mut Dataset,
    loss: Loss,
) -> Result<(), JobError> {
    let want: usize = input_shape.iter().product();
    let have = data.sample_numel();
    if want != have {
        return Err(JobError::Mismatch(format!(
            "the data's samples have shape {:?} ({have} values) but model.input_shape is {input_shape:?} ({want} values)",
            data.sample_shape
        )));
    }
    data.sample_shape = input_shape.to_vec();
    let analysis = graph
        .analyze()
        .map_err(|e| JobError::Mismatch(format!("model: {e}")))?;
    let [output] = graph.outputs.as_slice() else {
        return Err(JobError::Mismatch(format!(
            "model: it has {} outputs; training needs exactly one",
            graph.outputs.len()
        )));
    };
    let shape = analysis
        .shape(output)
        .ok_or_else(|| JobError::Mismatch(format!("model: output `{output}` has no shape")))?;
    let per_sample = shape.get(1..).unwrap_or_default();
    match (loss, &mut data.labels) {
        (Loss::CrossEntropy, Labels::Classes(classes)) => {
            let &[c] = per_sample else {
                return Err(JobError::Mismatch(format!(
                    "cross_entropy needs the model's output to be [batch, classes]; it is {shape:?}"
                )));
            };
            if let Some((i, v)) = classes
                .iter()
                .enumerate()
                .find(|(_, v)| !(0..c as i64).contains(v))
            {
                return Err(JobError::Mismatch(format!(
                    "label {v} at index {i} is not a class of the model's output {shape:?} (expected 0..={})",
                    c.saturating_sub(1)
                )));
            }
            Ok(())
        }
        (Loss::Mse, Labels::Targets { shape: target, .. }) => {
            let squeeze = |s: &[usize]| s.iter().copied().filter(|&d| d != 1).collect::<Vec<_>>();
            if squeeze(target) != squeeze(per_sample) {
                return Err(JobError::Mismatch(format!(
                    "mse needs targets shaped like one sample of the model's output {per_sample:?}; they are {target:?}"
                )));
            }
            *target = per_sample.to_vec();
            Ok(())
        }
        (loss, _) => Err(JobError::Mismatch(format!(
            "the labels were not loaded for the {loss:?} loss"
        ))),
    }
}
