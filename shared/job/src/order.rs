//! Data order. The server owns it, so a Root's inputs and a Leaf's labels
//! always match, and the single-process reference trainer uses the very same
//! batches.
//!
//! Each epoch visits the training samples in the order of
//! [`epoch_permutation`]. A step takes `clusters * batch_size` consecutive
//! entries of it, and cluster `c`'s batch at step `t` is
//! `perm[(t * clusters + c) * batch_size ..][..batch_size]`. So the union of
//! the clusters' batches at step `t` (in cluster order) is exactly
//! `perm[t * clusters * batch_size ..][..clusters * batch_size]`
//! ([`Schedule::step_samples`]): with parameters averaged every step, C
//! clusters of batch B see what one process with batch C·B sees. A tail of
//! fewer than `clusters * batch_size` samples is dropped each epoch (as
//! `drop_last=True`); with shuffling it is a different tail each epoch.

use std::ops::Range;

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{RngCore, SeedableRng};

use crate::error::JobError;

/// The order of an epoch's samples: the identity when `shuffle` is false,
/// else a Fisher-Yates shuffle driven by ChaCha8 seeded from `(seed, epoch)`.
///
/// Platform-independent and fixed: the 32-byte ChaCha seed is `seed` (u64
/// little-endian), `epoch` (u64 little-endian), then `b"rookery-order\0\0\0"`;
/// for `i` from `len - 1` down to 1, `j` is uniform in `0..=i` by rejection
/// (draw `x = next_u64()` until `x >= 2^64 mod (i+1)`, then `j = x % (i+1)`),
/// and entries `i` and `j` swap.
pub fn epoch_permutation(len: usize, seed: u64, epoch: u64, shuffle: bool) -> Vec<usize> {
    let mut perm: Vec<usize> = (0..len).collect();
    if !shuffle {
        return perm;
    }
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8..16].copy_from_slice(&epoch.to_le_bytes());
    key[16..].copy_from_slice(b"rookery-order\0\0\0");
    let mut rng = ChaCha8Rng::from_seed(key);
    for i in (1..len).rev() {
        let n = i as u64 + 1;
        let threshold = n.wrapping_neg() % n; // 2^64 mod n
        let j = loop {
            let x = rng.next_u64();
            if x >= threshold {
                break (x % n) as usize;
            }
        };
        perm.swap(i, j);
    }
    perm
}

/// How an epoch's samples are cut into steps and shared among clusters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Schedule {
    pub clusters: usize,
    /// Samples per cluster per step.
    pub batch_size: usize,
    /// `train_len / (clusters * batch_size)`: the incomplete tail is dropped.
    pub steps_per_epoch: usize,
}

impl Schedule {
    /// Errors when there is not one full step of data, or a count is zero.
    pub fn new(train_len: usize, clusters: usize, batch_size: usize) -> Result<Self, JobError> {
        if clusters == 0 || batch_size == 0 {
            return Err(JobError::Mismatch(format!(
                "a schedule needs at least one cluster and a batch size of at least 1 (got {clusters} clusters, batch size {batch_size})"
            )));
        }
        let per_step = clusters.saturating_mul(batch_size);
        if train_len < per_step {
            return Err(JobError::Mismatch(format!(
                "the training data has {train_len} samples, fewer than one step needs: {clusters} clusters x training.batch_size {batch_size} = {per_step}"
            )));
        }
        Ok(Schedule {
            clusters,
            batch_size,
            steps_per_epoch: train_len / per_step,
        })
    }

    /// Samples all clusters together take per step.
    pub fn samples_per_step(&self) -> usize {
        self.clusters * self.batch_size
    }

    /// Cluster `cluster`'s batch at step `step_in_epoch`: sample indices into
    /// the dataset, `perm[(step * clusters + cluster) * batch_size ..][..batch_size]`.
    /// Panics if the step, the cluster or `perm` is out of range.
    pub fn batch<'p>(
        &self,
        perm: &'p [usize],
        step_in_epoch: usize,
        cluster: usize,
    ) -> &'p [usize] {
        assert!(
            step_in_epoch < self.steps_per_epoch && cluster < self.clusters,
            "step {step_in_epoch} / cluster {cluster} out of range ({} steps, {} clusters)",
            self.steps_per_epoch,
            self.clusters
        );
        let start = (step_in_epoch * self.clusters + cluster) * self.batch_size;
        &perm[start..start + self.batch_size]
    }

    /// Every cluster's samples at one step, in cluster order: the batch a
    /// single-process reference of batch size `clusters * batch_size` takes.
    pub fn step_samples<'p>(&self, perm: &'p [usize], step_in_epoch: usize) -> &'p [usize] {
        assert!(
            step_in_epoch < self.steps_per_epoch,
            "step {step_in_epoch} out of range ({} steps)",
            self.steps_per_epoch
        );
        let n = self.samples_per_step();
        &perm[step_in_epoch * n..(step_in_epoch + 1) * n]
    }
}

/// How `torch.chunk(batch, micro_batches)` cuts a batch: chunks of
/// `ceil(batch / micro_batches)` samples, the last possibly smaller, and
/// possibly fewer than `micro_batches` chunks (10 in 4: 3, 3, 3, 1; 5 in 4:
/// 2, 2, 1). `micro_batches` 0 counts as 1; an empty batch has no chunks.
pub fn micro_batch_ranges(batch: usize, micro_batches: usize) -> Vec<Range<usize>> {
    if batch == 0 {
        return Vec::new();
    }
    let chunk = batch.div_ceil(micro_batches.max(1));
    (0..batch)
        .step_by(chunk)
        .map(|start| start..(start + chunk).min(batch))
        .collect()
}
