//! The training objective: job configuration, not a graph node. One type
//! from the job file to every backend (`Assign.loss` carries it as is).

use serde::{Deserialize, Serialize};

/// `nn.CrossEntropyLoss`'s default `ignore_index`.
pub const TORCH_IGNORE_INDEX: i64 = -100;

/// Where the classes are in cross-entropy's logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClassAxis {
    /// Dimension 1, torch's own layout: `[N, C]`, `[N, C, d1, d2, ..]`
    /// (a language model's `[N, V, T]`). Job file: `class_axis = 1`.
    Second,
    /// The last dimension: `[N, .., C]` (a language model's `[N, T, V]`, as
    /// users write `logits.view(-1, V)`). Job file: `class_axis = -1`.
    Last,
}

impl ClassAxis {
    /// From the job file's `class_axis` (torch's dimension index): 1 or -1.
    pub fn from_index(index: i64) -> Option<Self> {
        match index {
            1 => Some(Self::Second),
            -1 => Some(Self::Last),
            _ => None,
        }
    }

    /// The job file's `class_axis`.
    pub fn index(self) -> i64 {
        match self {
            Self::Second => 1,
            Self::Last => -1,
        }
    }

    /// Logits of `shape` viewed as `[outer, classes, inner]` (row-major, so
    /// class `k` of row `r` is at `(r / inner) * classes * inner + k * inner
    /// + r % inner`); `None` below rank 2. Rows (`outer * inner`) are the
    /// targets, in the row-major order of [`ClassAxis::label_shape`].
    pub fn split(self, shape: &[usize]) -> Option<(usize, usize, usize)> {
        if shape.len() < 2 {
            return None;
        }
        Some(match self {
            Self::Second => (shape[0], shape[1], shape[2..].iter().product()),
            Self::Last => {
                let (&classes, outer) = shape.split_last()?;
                (outer.iter().product(), classes, 1)
            }
        })
    }

    /// Which dimension of logits of rank `rank` holds the classes.
    pub fn dim(self, rank: usize) -> usize {
        match self {
            Self::Second => 1,
            Self::Last => rank.saturating_sub(1),
        }
    }

    /// The labels' shape for logits of `shape`: the shape without its class
    /// dimension; `None` below rank 2.
    pub fn label_shape(self, shape: &[usize]) -> Option<Vec<usize>> {
        if shape.len() < 2 {
            return None;
        }
        let mut labels = shape.to_vec();
        labels.remove(self.dim(shape.len()));
        Some(labels)
    }
}

/// The training objective, with `reduction="mean"` as torch's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Loss {
    /// `nn.CrossEntropyLoss(ignore_index=..)` over logits whose classes are
    /// at `class_axis`, with integer class labels shaped like the logits
    /// without that axis. Targets equal to `ignore_index` add neither loss
    /// nor gradient, nor count in the mean's denominator.
    CrossEntropy {
        class_axis: ClassAxis,
        ignore_index: i64,
    },
    /// `nn.MSELoss()`: targets shaped like the output.
    Mse,
}

impl Loss {
    /// `nn.CrossEntropyLoss()` with torch's defaults: classes at dimension 1,
    /// `ignore_index = -100`.
    pub const fn cross_entropy() -> Self {
        Self::CrossEntropy {
            class_axis: ClassAxis::Second,
            ignore_index: TORCH_IGNORE_INDEX,
        }
    }

    /// The job file's name of the loss.
    pub fn name(&self) -> &'static str {
        match self {
            Self::CrossEntropy { .. } => "cross_entropy",
            Self::Mse => "mse",
        }
    }

    pub fn is_cross_entropy(&self) -> bool {
        matches!(self, Self::CrossEntropy { .. })
    }

    /// Whether a class label counts (in the loss, its mean's denominator and
    /// accuracy): every label but cross-entropy's `ignore_index`.
    pub fn counts(&self, class: i64) -> bool {
        match self {
            Self::CrossEntropy { ignore_index, .. } => class != *ignore_index,
            Self::Mse => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn class_axis_views_both_layouts_as_outer_classes_inner() {
        assert_eq!(ClassAxis::Second.split(&[2, 5, 3, 4]), Some((2, 5, 12)));
        assert_eq!(ClassAxis::Last.split(&[2, 3, 5]), Some((6, 5, 1)));
        assert_eq!(
            ClassAxis::Last.split(&[4, 7]),
            ClassAxis::Second.split(&[4, 7])
        );
        assert_eq!(ClassAxis::Second.split(&[4]), None);
        assert_eq!(ClassAxis::Second.label_shape(&[2, 5, 3]), Some(vec![2, 3]));
        assert_eq!(ClassAxis::Last.label_shape(&[2, 3, 5]), Some(vec![2, 3]));
        assert_eq!(ClassAxis::from_index(-1), Some(ClassAxis::Last));
        assert_eq!(ClassAxis::from_index(0), None);
    }

    #[test]
    fn only_the_ignore_index_does_not_count() {
        let ce = Loss::cross_entropy();
        assert!(ce.counts(0) && ce.counts(-1) && !ce.counts(-100));
        assert!(Loss::Mse.counts(-100));
    }
}
