//! How many data-parallel clusters a job asks for: a training setting the
//! job file carries and the planner (`rookery-plan`) honours.

use serde::{Deserialize, Serialize};

/// How many data-parallel clusters to form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClusterCount {
    Fixed(usize),
    /// As many as possible whose bottleneck stays within the planner's
    /// `auto_factor` of the best single cluster.
    Auto,
}
