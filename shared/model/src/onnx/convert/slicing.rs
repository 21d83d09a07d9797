//! Taking parts of run-time tensors: `Split`, `SplitToSequence` with
//! `SequenceAt`, `Slice` and `Gather` with constant indices. Each becomes
//! [`Op::Slice`] (plus a `Reshape` where an axis is dropped) when the part is
//! a contiguous range, which is how attention takes q, k and v from one
//! projection and how a position embedding takes its first `T` rows.

use super::{Here, Importer, Parts, Val, keep_batch};
use crate::error::OnnxError;
use crate::onnx::shapes::norm_axis;
use crate::ops::Op;

impl Importer<'_> {
    /// `[start, end)` ranges cutting a dimension of `dim` by ONNX's `split`
    /// sizes, or into `count` near-equal parts (the last one smaller).
    fn split_ranges(
        &self,
        here: &Here,
        dim: usize,
        sizes: Option<Vec<i64>>,
        count: usize,
    ) -> Result<Vec<(usize, usize)>, OnnxError> {
        let sizes: Vec<usize> = match sizes {
            Some(s) => s
                .iter()
                .map(|&v| usize::try_from(v).map_err(|_| self.node_err(here, "negative split")))
                .collect::<Result<_, _>>()?,
            None => {
                if count == 0 {
                    return Err(self.node_err(here, "no outputs to split into"));
                }
                let each = dim.div_ceil(count);
                (0..count)
                    .map(|i| each.min(dim.saturating_sub(i * each)))
                    .collect()
            }
        };
        if sizes.iter().sum::<usize>() == dim && sizes.contains(&0) {
            return Err(self.unsupported(
                here,
                format!("empty parts (split sizes {sizes:?}): Rookery's tensors are never empty"),
            ));
        }
        if sizes.iter().sum::<usize>() != dim {
            return Err(self.node_err(
                here,
                format!(
                    "split sizes {sizes:?} do not cut a dimension of {dim} into non-empty parts"
                ),
            ));
        }
        let mut start = 0;
        Ok(sizes
            .iter()
            .map(|&s| {
                start += s;
                (start - s, start)
            })
            .collect())
    }

    /// Emits `name` as elements `[start, end)` of `axis` of graph tensor
    /// `source`, dropping the axis if `squeeze`.
    fn emit_part(
        &mut self,
        here: &Here,
        name: &str,
        source: &str,
        axis: usize,
        (start, end): (usize, usize),
        squeeze: bool,
    ) -> Result<(), OnnxError> {
        let op = Op::Slice {
            axis: axis as i64,
            start,
            end,
        };
        if !squeeze {
            return self.emit(here, name, op, vec![source.to_string()]);
        }
        let sliced = format!("{name}/slice");
        self.emit(here, &sliced, op, vec![source.to_string()])?;
        let shape = self
            .graph_info(&sliced)
            .ok_or_else(|| self.node_err(here, "a slice's shape is unknown"))?
            .shape;
        let mut target: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        target.remove(axis);
        let target = if axis == 0 {
            target
        } else {
            keep_batch(target, &shape, self.batch, self.exported_batch)
        };
        self.emit(here, name, Op::Reshape { shape: target }, vec![sliced])
    }

    /// ONNX `Split` of a run-time tensor: one [`Op::Slice`] per output.
    pub(super) fn split(&mut self, here: &Here) -> Result<(), OnnxError> {
        let x = self.input_info(here, 0)?;
        let axis = here.attrs.int("axis").unwrap_or(0);
        let a = norm_axis(axis, x.shape.len()).map_err(|e| self.node_err(here, e))?;
        let sizes = match self.known(here, 1) {
            Some(t) => Some(t.as_i64()),
            None if here.present(1) => {
                return Err(self.dynamic(here, "the split sizes are computed at run time"));
            }
            None => here.attrs.ints("split"),
        };
        let outputs = here.proto.output.clone();
        let ranges = self.split_ranges(here, x.shape[a], sizes, outputs.len())?;
        if ranges.len() != outputs.len() {
            return Err(self.node_err(
                here,
                format!("{} split sizes for {} outputs", ranges.len(), outputs.len()),
            ));
        }
        let source = self.tensor_input(here, 0)?;
        for (name, range) in outputs.iter().zip(ranges) {
            if !name.is_empty() {
                self.emit_part(here, name, &source, a, range, false)?;
            }
        }
        Ok(())
    }

    /// ONNX `SplitToSequence` of a run-time tensor: the parts, emitted when a
    /// `SequenceAt` reads one.
    pub(super) fn split_to_sequence(&mut self, here: &Here) -> Result<(), OnnxError> {
        let x = self.input_info(here, 0)?;
        let axis = here.attrs.int("axis").unwrap_or(0);
        let a = norm_axis(axis, x.shape.len()).map_err(|e| self.node_err(here, e))?;
        let dim = x.shape[a];
        let (ranges, squeeze) = match self.known(here, 1) {
            // A scalar: parts of that size, the last one smaller.
            Some(t) if t.shape.is_empty() => {
                let size = usize::try_from(t.as_i64()[0])
                    .ok()
                    .filter(|&s| s > 0)
                    .ok_or_else(|| self.node_err(here, "the split size must be positive"))?;
                (
                    self.split_ranges(here, dim, None, dim.div_ceil(size))?,
                    false,
                )
            }
            Some(t) => (self.split_ranges(here, dim, Some(t.as_i64()), 0)?, false),
            None if here.present(1) => {
                return Err(self.dynamic(here, "the split sizes are computed at run time"));
            }
            None => (
                (0..dim).map(|i| (i, i + 1)).collect(),
                here.attrs.int("keepdims").unwrap_or(1) == 0,
            ),
        };
        let source = self.tensor_input(here, 0)?;
        self.vals.insert(
            here.out.clone(),
            Val::Sequence(Parts {
                source,
                axis: a,
                ranges,
                squeeze,
            }),
        );
        Ok(())
    }

    /// ONNX `SequenceAt` of a split sequence with a constant position.
    pub(super) fn sequence_at(&mut self, here: &Here) -> Result<(), OnnxError> {
        let Some(Some(Val::Sequence(parts))) = here.ins.first() else {
            return Err(self.unsupported(here, "a sequence that is not a SplitToSequence's"));
        };
        let parts = parts.clone();
        let at = self
            .known(here, 1)
            .filter(|t| t.len() == 1)
            .ok_or_else(|| self.dynamic(here, "the position is computed at run time"))?
            .as_i64()[0];
        let n = parts.ranges.len() as i64;
        let i = if at < 0 { at + n } else { at };
        let range = usize::try_from(i)
            .ok()
            .and_then(|i| parts.ranges.get(i).copied())
            .ok_or_else(|| self.node_err(here, format!("position {at} of a {n}-part sequence")))?;
        let out = here.out.clone();
        self.emit_part(here, &out, &parts.source, parts.axis, range, parts.squeeze)
    }

    /// ONNX `Slice` of a run-time tensor with constant bounds and step 1:
    /// one [`Op::Slice`] per axis it narrows.
    pub(super) fn slice(&mut self, here: &Here) -> Result<(), OnnxError> {
        let x = self.input_info(here, 0)?;
        let known = |i: usize, attr: &str| -> Result<Option<Vec<i64>>, OnnxError> {
            if self.opset < 10 {
                return Ok(here.attrs.ints(attr));
            }
            match self.known(here, i) {
                Some(t) => Ok(Some(t.as_i64())),
                None if here.present(i) => Err(self.dynamic(
                    here,
                    format!("its {attr} are computed from the model's input at run time"),
                )),
                None => Ok(None),
            }
        };
        let starts = known(1, "starts")?.ok_or_else(|| self.node_err(here, "missing starts"))?;
        let ends = known(2, "ends")?.ok_or_else(|| self.node_err(here, "missing ends"))?;
        let axes = known(3, "axes")?.unwrap_or_else(|| (0..starts.len() as i64).collect());
        let steps = known(4, "steps")?.unwrap_or_else(|| vec![1; starts.len()]);
        if ends.len() != starts.len() || axes.len() != starts.len() || steps.len() != starts.len() {
            return Err(self.node_err(here, "starts, ends, axes and steps differ in length"));
        }
        let mut cuts = Vec::new();
        for i in 0..starts.len() {
            let a = norm_axis(axes[i], x.shape.len()).map_err(|e| self.node_err(here, e))?;
            let dim = x.shape[a] as i64;
            let fix = |v: i64| (if v < 0 { v.saturating_add(dim) } else { v }).clamp(0, dim);
            let (s, e) = (fix(starts[i]), fix(ends[i]));
            if steps[i] != 1 {
                return Err(self.unsupported(
                    here,
                    format!("step {} on a run-time tensor (only step 1)", steps[i]),
                ));
            }
            if s >= e {
                return Err(self.unsupported(here, "an empty slice"));
            }
            if (s, e) != (0, dim) {
                cuts.push((a, (s as usize, e as usize)));
            }
        }
        let mut source = self.tensor_input(here, 0)?;
        if cuts.is_empty() {
            return self.emit(here, &here.out, Op::Identity, vec![source]);
        }
        let last = cuts.len() - 1;
        for (i, (a, range)) in cuts.into_iter().enumerate() {
            let name = if i == last {
                here.out.clone()
            } else {
                format!("{}/axis{a}", here.out)
            };
            self.emit_part(here, &name, &source, a, range, false)?;
            source = name;
        }
        Ok(())
    }

    /// A `Gather` of a run-time tensor (or a weight) at constant indices:
    /// one slice for consecutive indices (attention's q, k, v), else one
    /// slice per index joined by a `Concat` and shaped by a `Reshape`
    /// (`x[:, [2, 0]]`), for up to [`MAX_GATHERED`] indices.
    pub(super) fn gather_as_slice(&mut self, here: &Here) -> Result<bool, OnnxError> {
        let Some(Some(Val::Const(idx, _))) = here.ins.get(1) else {
            return Ok(false);
        };
        if idx.elem.is_float() {
            return Ok(false);
        }
        let data = self.input_info(here, 0)?;
        let a = norm_axis(here.attrs.int("axis").unwrap_or(0), data.shape.len())
            .map_err(|e| self.node_err(here, e))?;
        let dim = data.shape[a] as i64;
        let values: Vec<i64> = idx
            .as_i64()
            .into_iter()
            .map(|v| if v < 0 { v + dim } else { v })
            .collect();
        if values.is_empty() || values.iter().any(|v| !(0..dim).contains(v)) {
            return Ok(false);
        }
        let source = self.tensor_input(here, 0)?;
        let out = here.out.clone();
        let contiguous = values.windows(2).all(|w| w[1] == w[0] + 1);
        if contiguous && idx.shape.len() <= 1 {
            let range = (values[0] as usize, values[values.len() - 1] as usize + 1);
            self.emit_part(here, &out, &source, a, range, idx.shape.is_empty())?;
            return Ok(true);
        }
        if values.len() > MAX_GATHERED {
            return Err(self.unsupported(
                here,
                format!(
                    "{} scattered constant indices (at most {MAX_GATHERED})",
                    values.len()
                ),
            ));
        }
        let mut parts = Vec::with_capacity(values.len());
        for (k, &v) in values.iter().enumerate() {
            let part = format!("{out}/index{k}");
            self.emit_part(here, &part, &source, a, (v as usize, v as usize + 1), false)?;
            parts.push(part);
        }
        let joined = format!("{out}/joined");
        match parts.as_slice() {
            [one] => self.emit(here, &joined, Op::Identity, vec![one.clone()])?,
            _ => self.emit(here, &joined, Op::Concat { axis: a as i64 }, parts)?,
        }
        let mut shape: Vec<usize> = data.shape[..a].to_vec();
        shape.extend(&idx.shape);
        shape.extend(&data.shape[a + 1..]);
        let target: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        let target = if a == 0 {
            target
        } else {
            keep_batch(target, &data.shape, self.batch, self.exported_batch)
        };
        self.emit(here, &out, Op::Reshape { shape: target }, vec![joined])?;
        Ok(true)
    }
}

/// Most indices a constant `Gather` becomes slices for: beyond, a graph of
/// slices is no way to compute it.
const MAX_GATHERED: usize = 64;
