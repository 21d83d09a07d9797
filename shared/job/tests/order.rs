//! Data order: epoch permutations are seeded permutations, fixed across
//! platforms; cluster batches within a step are disjoint and together are
//! exactly the batch a single-process reference of batch C·B takes; micro-batch
//! ranges cut a batch as `torch.chunk` does.
// Helpers outside #[test] fns panic on purpose too: a panic is a test failure.
#![allow(clippy::unwrap_used)]

use std::collections::HashSet;

use proptest::prelude::*;
use rookery_job::{JobError, Schedule, epoch_permutation, micro_batch_ranges};

fn is_permutation(p: &[usize]) -> bool {
    let mut seen = vec![false; p.len()];
    p.iter()
        .all(|&i| i < seen.len() && !std::mem::replace(&mut seen[i], true))
}

#[test]
fn permutation_is_a_seeded_permutation_that_changes_every_epoch() {
    for len in [0, 1, 2, 3, 10, 1000] {
        for seed in [0, 42, u64::MAX] {
            let p = epoch_permutation(len, seed, 0, true);
            assert!(is_permutation(&p), "{len} {seed}");
            assert_eq!(p, epoch_permutation(len, seed, 0, true), "deterministic");
        }
    }
    let e0 = epoch_permutation(100, 7, 0, true);
    let e1 = epoch_permutation(100, 7, 1, true);
    let other_seed = epoch_permutation(100, 8, 0, true);
    assert_ne!(e0, e1, "epochs differ");
    assert_ne!(e0, other_seed, "seeds differ");
    assert_ne!(e0, (0..100).collect::<Vec<_>>(), "shuffled");
    assert_eq!(
        epoch_permutation(5, 7, 3, false),
        [0, 1, 2, 3, 4],
        "identity without shuffle"
    );
}

#[test]
fn permutation_is_pinned_so_every_platform_and_release_agrees() {
    // Regenerate only on purpose: a change here changes every job's data order.
    assert_eq!(epoch_permutation(10, 42, 0, true), PINNED_42_0);
    assert_eq!(epoch_permutation(10, 42, 1, true), PINNED_42_1);
}

const PINNED_42_0: [usize; 10] = [5, 2, 7, 3, 0, 8, 4, 9, 6, 1];
const PINNED_42_1: [usize; 10] = [9, 0, 3, 6, 2, 4, 8, 7, 5, 1];

#[test]
fn permutation_places_each_sample_uniformly() {
    // Where sample 0 lands over 4000 epochs of 4 samples: about 1000 each.
    let mut at = [0usize; 4];
    for epoch in 0..4000 {
        let p = epoch_permutation(4, 1, epoch, true);
        at[p.iter().position(|&i| i == 0).unwrap()] += 1;
    }
    assert!(at.iter().all(|&n| (850..1150).contains(&n)), "{at:?}");
}

#[test]
fn schedule_drops_the_incomplete_tail_and_needs_one_full_step() {
    let s = Schedule::new(1000, 3, 64).unwrap();
    assert_eq!((s.steps_per_epoch, s.samples_per_step()), (5, 192));
    assert_eq!(Schedule::new(192, 3, 64).unwrap().steps_per_epoch, 1);
    let e = Schedule::new(191, 3, 64).unwrap_err();
    assert!(matches!(e, JobError::Mismatch(_)));
    let e = e.to_string();
    assert!(
        e.contains("191") && e.contains("3 clusters") && e.contains("64") && e.contains("192"),
        "{e}"
    );
    assert!(Schedule::new(10, 0, 1).is_err());
    assert!(Schedule::new(10, 1, 0).is_err());
}

/// Cluster batches at a step are disjoint, in cluster order they are the
/// reference's batch of C·B, and over an epoch no sample repeats.
fn check_sharding(len: usize, clusters: usize, batch: usize, seed: u64, epoch: u64) {
    let s = Schedule::new(len, clusters, batch).unwrap();
    let perm = epoch_permutation(len, seed, epoch, true);
    let mut epoch_seen = HashSet::new();
    for t in 0..s.steps_per_epoch {
        let reference = &perm[t * clusters * batch..][..clusters * batch];
        assert_eq!(s.step_samples(&perm, t), reference);
        let mut union = Vec::new();
        for c in 0..clusters {
            let b = s.batch(&perm, t, c);
            assert_eq!(b.len(), batch);
            union.extend_from_slice(b);
        }
        assert_eq!(
            union, reference,
            "step {t}: clusters' batches are the reference batch"
        );
        for i in union {
            assert!(epoch_seen.insert(i), "sample {i} twice in an epoch");
        }
    }
    assert_eq!(epoch_seen.len(), s.steps_per_epoch * clusters * batch);
}

#[test]
fn cluster_batches_are_disjoint_and_union_to_the_reference_batch() {
    check_sharding(1000, 3, 64, 42, 0);
    check_sharding(8000, 2, 64, 42, 1);
    check_sharding(7, 1, 7, 0, 0);
    // The formula, spelled out.
    let s = Schedule::new(20, 2, 3).unwrap();
    let perm: Vec<usize> = (100..120).collect();
    assert_eq!(s.batch(&perm, 1, 1), [109, 110, 111]);
    assert_eq!(s.step_samples(&perm, 1), [106, 107, 108, 109, 110, 111]);
}

#[test]
fn micro_batch_ranges_cut_like_torch_chunk() {
    // (batch, micro_batches) -> torch.chunk(torch.arange(batch), micro_batches) sizes
    let cases: &[(usize, usize, &[usize])] = &[
        (10, 4, &[3, 3, 3, 1]),
        (5, 4, &[2, 2, 1]),
        (6, 4, &[2, 2, 2]),
        (4, 4, &[1, 1, 1, 1]),
        (3, 4, &[1, 1, 1]),
        (64, 4, &[16, 16, 16, 16]),
        (65, 4, &[17, 17, 17, 14]),
        (7, 1, &[7]),
        (7, 7, &[1, 1, 1, 1, 1, 1, 1]),
        (9, 2, &[5, 4]),
        (1, 3, &[1]),
        (0, 3, &[]),
        (5, 0, &[5]),
    ];
    for &(batch, m, sizes) in cases {
        let r = micro_batch_ranges(batch, m);
        assert_eq!(
            r.iter().map(|r| r.len()).collect::<Vec<_>>(),
            sizes,
            "({batch}, {m})"
        );
        let mut next = 0;
        for range in &r {
            assert_eq!(range.start, next, "contiguous");
            next = range.end;
        }
        assert_eq!(next, batch, "covers the batch");
    }
}

proptest! {
    #[test]
    fn sharding_property_holds_for_random_shapes(
        clusters in 1usize..5,
        batch in 1usize..9,
        extra in 0usize..40,
        seed in any::<u64>(),
        epoch in 0u64..5,
    ) {
        check_sharding(clusters * batch + extra, clusters, batch, seed, epoch);
    }

    #[test]
    fn micro_batches_are_torch_chunks(batch in 1usize..200, m in 1usize..20) {
        let r = micro_batch_ranges(batch, m);
        let chunk = batch.div_ceil(m);
        prop_assert!(r.len() <= m);
        prop_assert_eq!(r.len(), batch.div_ceil(chunk));
        prop_assert!(r.iter().rev().skip(1).all(|r| r.len() == chunk));
        prop_assert_eq!(r.last().map(|r| r.end), Some(batch));
    }
}
