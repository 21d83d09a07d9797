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

use rookery_model::{ClassAxis, Graph, Loss};

pub use raw::{ElemType, RawArray};

use crate::error::JobError;
use crate::spec::{DataFormat, DataRef, DataSpec};

/// Which half of the data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Split {
    Train,
    Test,
}

/// Labels of every sample, row-major; one sample's labels have the
/// dataset's [`Dataset::label_shape`].
#[derive(Debug, Clone, PartialEq)]
pub enum Labels {
    /// Class indices, for `cross_entropy` (`ignore_index` among them).
    Classes(Vec<i64>),
    /// Regression targets, for `mse`.
    Targets(Vec<f32>),
}

impl Labels {
    /// Number of values (samples times one sample's labels).
    pub fn numel(&self) -> usize {
        match self {
            Labels::Classes(c) => c.len(),
            Labels::Targets(t) => t.len(),
        }
    }

    /// What a step's mean loss divides by, for labels of `samples` samples:
    /// the class labels `loss` counts (all but `ignore_index`), or the samples
    /// for regression targets (MSE's per-sample mean counts once per sample).
    pub fn targets(&self, loss: Loss, samples: usize) -> u64 {
        match self {
            Labels::Classes(c) => c.iter().filter(|&&v| loss.counts(v)).count() as u64,
            Labels::Targets(_) => samples as u64,
        }
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
    /// One sample's labels' shape: `[]` for one class per sample, `[T]` for a
    /// language model's next tokens, the output's per-sample shape for MSE.
    pub label_shape: Vec<usize>,
}

impl Dataset {
    /// Number of samples.
    pub fn len(&self) -> usize {
        match self.label_numel() {
            0 => 0,
            k => self.labels.numel() / k,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Values in one sample.
    pub fn sample_numel(&self) -> usize {
        self.sample_shape.iter().product()
    }

    /// Labels of one sample.
    pub fn label_numel(&self) -> usize {
        self.label_shape.iter().product()
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

    /// What the mean loss of samples `idx` divides by: [`Labels::targets`]
    /// without gathering them. Panics if an index is out of range.
    pub fn targets(&self, idx: &[usize], loss: Loss) -> u64 {
        let k = self.label_numel();
        match &self.labels {
            Labels::Classes(c) => idx
                .iter()
                .map(|&i| {
                    c[i * k..(i + 1) * k]
                        .iter()
                        .filter(|&&v| loss.counts(v))
                        .count() as u64
                })
                .sum(),
            Labels::Targets(_) => idx.len() as u64,
        }
    }

    /// The labels of samples `idx`, in that order, as one batch of shape
    /// `[idx.len(), label_shape..]` (row-major). Panics if an index is out
    /// of range.
    pub fn gather_labels(&self, idx: &[usize]) -> Labels {
        fn gather<T: Copy>(values: &[T], k: usize, idx: &[usize]) -> Vec<T> {
            let mut out = Vec::with_capacity(idx.len() * k);
            for &i in idx {
                out.extend_from_slice(&values[i * k..(i + 1) * k]);
            }
            out
        }
        let k = self.label_numel();
        match &self.labels {
            Labels::Classes(c) => Labels::Classes(gather(c, k, idx)),
            Labels::Targets(t) => Labels::Targets(gather(t, k, idx)),
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
/// sample's shape. For `cross_entropy` the labels are integer classes of any
/// per-sample shape (integer dtypes, or integral floats) and become
/// [`Labels::Classes`]; for `mse` they become [`Labels::Targets`] (f32).
/// [`validate_against_model`] checks their shape against the model's output.
/// Scale and normalisation apply to the inputs only.
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
    if label_shape.contains(&0) {
        return Err(JobError::file(
            y.source(),
            format!("its labels are empty (shape {:?})", y.shape()),
        ));
    }
    let labels = match loss {
        Loss::CrossEntropy { .. } => Labels::Classes(y.to_classes()?),
        Loss::Mse => Labels::Targets(y.to_f32()),
    };
    drop(y);
    let (scale, mean, std) = spec.normalisation();
    let inputs = x.map_f32(|v| (v * scale - mean) / std);
    Ok(Some(Dataset {
        sample_shape,
        inputs,
        labels,
        label_shape,
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
/// - the model must have one output; for `cross_entropy` one sample's labels
///   must be shaped like one sample of the output without its class
///   dimension (`class_axis`): `[]` for `[batch, C]`, `[T]` for `[batch, C,
///   T]` or, classes last, `[batch, T, C]`; a label shape of `[1]` for `[]`
///   is fitted. Every label is in `0..C` or the `ignore_index`
///   ([`JobError::Labels`] names the first that is not, by sample and
///   position); for `mse` the targets' per-sample shape must be the
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
    match (loss, &data.labels) {
        (
            Loss::CrossEntropy {
                class_axis,
                ignore_index,
            },
            Labels::Classes(classes),
        ) => {
            let (Some((_, c, _)), Some(label_shape)) =
                (class_axis.split(shape), class_axis.label_shape(shape))
            else {
                return Err(JobError::Mismatch(format!(
                    "cross_entropy needs the model's output to have a batch and a class dimension; it is {shape:?}"
                )));
            };
            let want = &label_shape[1..];
            // A column of classes (`[n, 1]`) is one class per sample.
            let fits = data.label_shape == want || (want.is_empty() && data.label_shape == [1]);
            if !fits {
                return Err(JobError::Labels(format!(
                    "one sample's labels have shape {:?}, but cross_entropy with class_axis = {} over the model's output {shape:?} needs {want:?} (the output's shape without the batch and class dimensions){}",
                    data.label_shape,
                    class_axis.index(),
                    other_axis_hint(shape, class_axis, &data.label_shape)
                )));
            }
            data.label_shape = want.to_vec();
            if let Some((i, v)) = classes
                .iter()
                .enumerate()
                .find(|&(_, &v)| v != ignore_index && !(0..c as i64).contains(&v))
            {
                let k = data.label_numel().max(1);
                let at = if want.is_empty() {
                    format!("sample {i}")
                } else {
                    format!("sample {}, position {}", i / k, i % k)
                };
                return Err(JobError::Labels(format!(
                    "label {v} at {at} is not a class of the model's output {shape:?} (expected 0..={}, or the ignore_index {ignore_index})",
                    c.saturating_sub(1)
                )));
            }
            Ok(())
        }
        (Loss::Mse, Labels::Targets(_)) => {
            let squeeze = |s: &[usize]| s.iter().copied().filter(|&d| d != 1).collect::<Vec<_>>();
            if squeeze(&data.label_shape) != squeeze(per_sample) {
                return Err(JobError::Labels(format!(
                    "mse needs targets shaped like one sample of the model's output {per_sample:?}; they are {:?}",
                    data.label_shape
                )));
            }
            data.label_shape = per_sample.to_vec();
            Ok(())
        }
        (loss, _) => Err(JobError::Mismatch(format!(
            "the labels were not loaded for the {} loss",
            loss.name()
        ))),
    }
}

/// When the labels would fit with the other `class_axis`, says so.
fn other_axis_hint(shape: &[usize], axis: ClassAxis, labels: &[usize]) -> String {
    let other = match axis {
        ClassAxis::Second => ClassAxis::Last,
        ClassAxis::Last => ClassAxis::Second,
    };
    match other.label_shape(shape) {
        Some(l) if l[1..] == *labels => format!(
            "; they fit class_axis = {}: write loss = {{ name = \"cross_entropy\", class_axis = {} }}",
            other.index(),
            other.index()
        ),
        _ => String::new(),
    }
}
