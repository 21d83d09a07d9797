//! Aggregation at a sync: the mean, and robust rules that outvote a far-off cluster.

use super::*;

#[test]
fn robust_aggregation_outvotes_a_far_off_cluster_and_counts_it_against_its_providers() {
    // (rule, expected aggregate, far-off cluster's providers faulted)
    let cases = [
        (Aggregation::Mean, (1.0 + 1.2 + 1.1 + 1e4) / 4.0, false),
        (Aggregation::Median, 1.15, true),
        (Aggregation::CenteredClip, 1.15, true),
    ];
    for (rule, want, counted) in cases {
        let (mut run, _) = started_with(4, rule);
        syncing(&mut run);
        let values = [1.0, 1.2, 1.1, 1e4];
        let effects = upload_all(&mut run, |c| values[c]);
        for (name, p) in &run.params {
            let worst = p
                .values
                .iter()
                .map(|v| ((v - want) / want).abs())
                .fold(0.0f32, f32::max);
            assert!(worst < 0.05, "{rule:?}: {name} is {:?}", &p.values[..2]);
        }
        let found = faults(&effects);
        if counted {
            let outlier: Vec<u64> = run.clusters[3].stages.iter().map(|s| s.provider).collect();
            let blamed: Vec<u64> = found.iter().map(|f| f.0).collect();
            assert_eq!(blamed, outlier, "{rule:?}");
            assert!(found.iter().all(|f| !f.2 && f.1.contains("cluster 3")));
        } else {
            assert!(found.is_empty(), "{rule:?}: {found:?}");
        }
        // The sync finishes either way: everyone gets the aggregate.
        assert_eq!(
            sends(&effects)
                .iter()
                .filter(|(_, m)| matches!(m, ToProvider::SetParams(_)))
                .count(),
            8,
            "{rule:?}"
        );
    }
}

#[test]
fn honest_clusters_under_robust_aggregation_are_not_counted() {
    for rule in [Aggregation::Median, Aggregation::CenteredClip] {
        let (mut run, _) = started_with(3, rule);
        syncing(&mut run);
        let effects = upload_all(&mut run, |c| 1.0 + 0.01 * c as f32);
        assert!(faults(&effects).is_empty(), "{rule:?}");
    }
}
