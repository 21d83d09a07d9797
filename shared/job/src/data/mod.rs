//! Datasets: reading a job's data files into preprocessed f32 inputs and
//! labels, and checking them against the model.
//!
//! Formats ([`DataFormat`]): IDX (MNIST; element types u8, i8, i16, i32, f32,
//! f64), `.npy` (versions 1 to 3; `<f2 <f4 <f8 |u1 <u2 <u4 <u8 |i1 <i2 <i4 <i8
//! |b1` and their big-endian forms; C order), `.npz` (`file.npz:array`),
//! safetensors (`file.safetensors:tensor`), CSV (one sample a row, one
//! column of labels; a non-numeric first row is a header) and token files
//! ([`tokens`]: a language model's token ids, cut into next-token windows).
//! IDX, `.npy`, CSV and token files may be gzipped: gzip is recognised by its
//! magic bytes, not the name.
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
pub mod tokens;

use rookery_model::{ClassAxis, DType, Graph, Loss, Op, ParamKind};

pub use npy::{NpyData, read as read_npy, write as write_npy};
pub use raw::{ElemType, RawArray};
pub use tokens::{TokenDType, TokenIds, TokenWindows};

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
    /// One sample's labels' shape: `[]` for one class a sample, the targets'
    /// shape for `mse`, `[seq_len]` for token windows (fitted to the model's
    /// output by [`validate_against_model`]).
    pub label_shape: Vec<usize>,
    pub samples: Samples,
}

/// Where a dataset's samples come from.
#[derive(Debug, Clone, PartialEq)]
pub enum Samples {
    /// Inputs and labels read from arrays, one row a sample. `inputs` is
    /// row-major, `len() * prod(sample_shape)` values, already scaled and
    /// normalised: `(x * scale - mean) / std` in f32.
    Arrays { inputs: Vec<f32>, labels: Labels },
    /// A token file: each sample is a window, its labels the next tokens.
    Tokens(TokenWindows),
}

impl Dataset {
    /// Number of samples.
    pub fn len(&self) -> usize {
        match &self.samples {
            Samples::Arrays { labels, .. } => match self.label_numel() {
                0 => 0,
                k => labels.numel() / k,
            },
            Samples::Tokens(t) => t.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Values in one sample.
    pub fn sample_numel(&self) -> usize {
        self.sample_shape.iter().product()
    }

    /// The inputs of samples `idx`, in that order, as one batch (row-major);
    /// token ids as f32. Panics if an index is out of range.
    pub fn gather_inputs(&self, idx: &[usize]) -> Vec<f32> {
        match &self.samples {
            Samples::Arrays { inputs, .. } => {
                let k = self.sample_numel();
                let mut out = Vec::with_capacity(idx.len() * k);
                for &i in idx {
                    out.extend_from_slice(&inputs[i * k..(i + 1) * k]);
                }
                out
            }
            Samples::Tokens(t) => t.gather_inputs(idx).into_iter().map(|v| v as f32).collect(),
        }
    }

    /// The inputs of samples `idx` as integers, for a model whose input is
    /// i64 (token ids, indices): token windows exactly, arrays' values
    /// rounded toward zero ([`validate_against_model`] checks they are
    /// integers). Panics if an index is out of range.
    pub fn gather_input_ids(&self, idx: &[usize]) -> Vec<i64> {
        match &self.samples {
            Samples::Arrays { .. } => self
                .gather_inputs(idx)
                .into_iter()
                .map(|v| v as i64)
                .collect(),
            Samples::Tokens(t) => t.gather_inputs(idx),
        }
    }

    /// Labels of one sample.
    pub fn label_numel(&self) -> usize {
        self.label_shape.iter().product()
    }

    /// What the mean loss of samples `idx` divides by: [`Labels::targets`]
    /// of their labels. Panics if an index is out of range.
    pub fn targets(&self, idx: &[usize], loss: Loss) -> u64 {
        self.gather_labels(idx).targets(loss, idx.len())
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
        match &self.samples {
            Samples::Arrays { labels, .. } => match labels {
                Labels::Classes(c) => Labels::Classes(gather(c, k, idx)),
                Labels::Targets(t) => Labels::Targets(gather(t, k, idx)),
            },
            Samples::Tokens(t) => Labels::Classes(t.gather_labels(idx)),
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
        DataFormat::Tokens => Err(JobError::file(
            r,
            "a token file is one sequence of ids, not an array of samples; read it with TokenWindows::read",
        )),
    }
}

/// Reads a split's inputs and labels. `Ok(None)` when the job gives no test split.
///
/// The first dimension of each array is the sample index and the rest one
/// sample's shape. For `cross_entropy` the labels are integer classes of any
/// per-sample shape (integer dtypes, or integral floats) and become
/// [`Labels::Classes`]; for `mse` they become [`Labels::Targets`] (f32).
/// [`validate_against_model`] checks their shape against the model's output.
/// Scale and normalisation apply to the inputs only. A token file (`format =
/// "tokens"`) has no labels file: its windows' next tokens are the labels.
pub fn load_split(spec: &DataSpec, split: Split, loss: Loss) -> Result<Option<Dataset>, JobError> {
    if spec.format == DataFormat::Tokens {
        return load_tokens(spec, split);
    }
    let (inputs, labels, fields) = match split {
        Split::Train => (
            Some(&spec.train_inputs),
            spec.train_labels.as_ref(),
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
        label_shape,
        samples: Samples::Arrays { inputs, labels },
    }))
}

/// A token file's split: `[seq_len]` windows with `[seq_len]` next-token labels.
fn load_tokens(spec: &DataSpec, split: Split) -> Result<Option<Dataset>, JobError> {
    let file = match split {
        Split::Train => &spec.train_inputs,
        Split::Test => match &spec.test_inputs {
            Some(f) => f,
            None => return Ok(None),
        },
    };
    let seq_len = spec.seq_len.ok_or_else(|| {
        JobError::field(
            "data.seq_len",
            "missing: format = \"tokens\" needs the window length",
        )
    })?;
    let windows = TokenWindows::read(file, spec.token_dtype, seq_len)?;
    Ok(Some(Dataset {
        sample_shape: vec![seq_len],
        label_shape: vec![seq_len],
        samples: Samples::Tokens(windows),
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
///   the targets take the output's per-sample shape;
/// - for a model whose input is i64 (token ids), the inputs must be integers,
///   below the vocabulary (the rows of the embedding table the input
///   indexes, [`input_embedding`]) when there is one;
/// - token windows need `cross_entropy`, ids below the vocabulary and the
///   output's classes, and an output of `[batch, classes, seq_len]`
///   (`[batch, classes]` when `seq_len` is 1); `label_shape` becomes the
///   output's per-sample shape without the classes.
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
    let embedding = input_embedding(graph);
    let (inputs, labels) = match &mut data.samples {
        Samples::Tokens(t) => {
            return validate_tokens(t, embedding, loss, shape, &mut data.label_shape);
        }
        Samples::Arrays { inputs, labels } => (inputs, labels),
    };
    if graph.inputs.first().map(|i| i.dtype) == Some(DType::I64) {
        check_input_ids(inputs, embedding)?;
    }
    match (loss, labels) {
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
                let k = data.label_shape.iter().product::<usize>().max(1);
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

/// The embedding table the model's first input indexes, and its rows (the
/// vocabulary): a `Gather` along axis 0 of a parameter by that input,
/// directly or through `Identity` nodes. `nn.Embedding` exports and the
/// layer spec's `Embedding` are such a `Gather`.
pub fn input_embedding(graph: &Graph) -> Option<(&str, usize)> {
    let mut names = vec![graph.inputs.first()?.name.as_str()];
    // Nodes are not necessarily in order: follow Identity chains to a fixpoint.
    loop {
        let before = names.len();
        for n in &graph.nodes {
            if matches!(n.op, Op::Identity)
                && n.inputs
                    .first()
                    .is_some_and(|i| names.contains(&i.as_str()))
                && !names.contains(&n.name.as_str())
            {
                names.push(&n.name);
            }
        }
        if names.len() == before {
            break;
        }
    }
    graph.nodes.iter().find_map(|n| match n.op {
        Op::Gather { axis: 0 } if n.inputs.get(1).is_some_and(|i| names.contains(&i.as_str())) => {
            let table = graph
                .params
                .iter()
                .find(|p| Some(&p.name) == n.inputs.first())?;
            Some((table.name.as_str(), *table.shape.first()?))
        }
        _ => None,
    })
}

/// Position tables: parameters gathered along axis 0 by indices that do not
/// depend on any graph input (an `arange` over the sequence, folded at
/// import, usually into a slice of the table's first rows), with their rows,
/// the most positions the model has.
pub fn position_tables(graph: &Graph) -> Vec<(&str, usize)> {
    let mut dependent: Vec<&str> = graph.inputs.iter().map(|i| i.name.as_str()).collect();
    loop {
        let before = dependent.len();
        for n in &graph.nodes {
            if !dependent.contains(&n.name.as_str())
                && n.inputs.iter().any(|i| dependent.contains(&i.as_str()))
            {
                dependent.push(&n.name);
            }
        }
        if dependent.len() == before {
            break;
        }
    }
    graph
        .nodes
        .iter()
        .filter_map(|n| match n.op {
            // Import turns a gather of a constant range into a slice.
            Op::Slice { axis: 0, .. } => {
                let table = graph
                    .params
                    .iter()
                    .find(|p| Some(&p.name) == n.inputs.first() && p.kind != ParamKind::Constant)?;
                Some((table.name.as_str(), *table.shape.first()?))
            }
            Op::Gather { axis: 0 }
                if n.inputs
                    .get(1)
                    .is_some_and(|i| !dependent.contains(&i.as_str())) =>
            {
                let table = graph
                    .params
                    .iter()
                    .find(|p| Some(&p.name) == n.inputs.first() && p.kind != ParamKind::Constant)?;
                Some((table.name.as_str(), *table.shape.first()?))
            }
            _ => None,
        })
        .collect()
}

/// An i64 model input's values from an array: integers, and token ids below
/// the vocabulary when the input indexes an embedding.
fn check_input_ids(inputs: &[f32], embedding: Option<(&str, usize)>) -> Result<(), JobError> {
    if let Some((i, v)) = inputs
        .iter()
        .enumerate()
        .find(|(_, v)| !v.is_finite() || v.fract() != 0.0)
    {
        return Err(JobError::Mismatch(format!(
            "the model's input is i64 (token ids or indices), but input value {v} at index {i} is not an integer"
        )));
    }
    if let Some((table, rows)) = embedding
        && let Some((i, v)) = inputs
            .iter()
            .enumerate()
            .find(|(_, v)| !(0.0..rows as f32).contains(*v))
    {
        return Err(JobError::Mismatch(format!(
            "token id {v} at index {i} of the inputs is not below the vocabulary size {rows} \
             (the rows of `{table}`, the embedding table the model's input indexes)"
        )));
    }
    Ok(())
}

/// Token windows against the model: ids below the vocabulary, and an output
/// with the classes at `class_axis` and one row per position
/// (`[batch, classes, seq_len]` or, classes last, `[batch, seq_len,
/// classes]`; `[batch, classes]` for windows of one), whose per-sample shape
/// without the classes becomes `label_shape`.
fn validate_tokens(
    t: &TokenWindows,
    embedding: Option<(&str, usize)>,
    loss: Loss,
    shape: &[usize],
    label_shape: &mut Vec<usize>,
) -> Result<(), JobError> {
    let Loss::CrossEntropy { class_axis, .. } = loss else {
        return Err(JobError::field(
            "training.loss",
            format!(
                "format = \"tokens\" labels every position with its next token, a class: use \
                 loss = \"cross_entropy\" (not {})",
                loss.name()
            ),
        ));
    };
    if let Some((table, rows)) = embedding
        && let Some((i, v)) = t.ids().first_at_or_above(rows as u64)
    {
        return Err(JobError::file(
            t.source(),
            format!(
                "token id {v} at position {i} is not below the vocabulary size {rows} \
                 (the rows of `{table}`, the embedding table the model's input indexes)"
            ),
        ));
    }
    let seq_len = t.seq_len();
    let squeeze = |s: &[usize]| s.iter().copied().filter(|&d| d != 1).collect::<Vec<_>>();
    let fits = |inner: &[usize]| squeeze(inner) == squeeze(&[seq_len]);
    let layout = |axis: ClassAxis| {
        let (_, classes, _) = axis.split(shape)?;
        let inner = axis.label_shape(shape)?;
        fits(&inner[1..]).then(|| (classes, inner[1..].to_vec()))
    };
    let Some((classes, inner)) = layout(class_axis) else {
        let other = match class_axis {
            ClassAxis::Second => ClassAxis::Last,
            ClassAxis::Last => ClassAxis::Second,
        };
        let hint = if layout(other).is_some() {
            format!(
                "; it fits class_axis = {0}: write loss = {{ name = \"cross_entropy\", class_axis = {0} }}",
                other.index()
            )
        } else {
            String::new()
        };
        return Err(JobError::Mismatch(format!(
            "cross_entropy with class_axis = {} over token windows of data.seq_len {seq_len} needs \
             the model's output to be {} ([batch, vocabulary] when seq_len is 1); it is {shape:?}{hint}",
            class_axis.index(),
            match class_axis {
                ClassAxis::Second => format!("[batch, vocabulary, {seq_len}]"),
                ClassAxis::Last => format!("[batch, {seq_len}, vocabulary]"),
            }
        )));
    };
    if let Some((i, v)) = t.ids().first_at_or_above(classes as u64) {
        return Err(JobError::file(
            t.source(),
            format!(
                "token id {v} at position {i} is not a class of the model's output {shape:?} \
                 (expected 0..={})",
                classes.saturating_sub(1)
            ),
        ));
    }
    *label_shape = inner;
    Ok(())
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
