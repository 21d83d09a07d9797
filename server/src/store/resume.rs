//! The resume file: a sync point's whole state ([`ResumePoint`]: averaged
//! parameters, each cluster's optimizer state, steps done) in one
//! safetensors file next to the job's checkpoint, written atomically (a
//! temporary file, fsynced, renamed over the old one), so a server killed at
//! any moment finds either the previous sync point or the new one, whole.
//!
//! Tensor names: `param/NAME`, `optim/CLUSTER/NAME/SLOT`, `steps/CLUSTER/NAME`
//! and `meta/step`, `meta/clusters`. Counters are stored as two 24-bit halves
//! (safetensors I64 values pass through f32 here, exact to 2^24 only).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rookery_job::weights::{WeightTensor, read_safetensors, write_safetensors};
use rookery_model::DType;
use rookery_proto::{ParamOptimState, WireDType, WireTensor};

use crate::run::ResumePoint;

/// Where a job's resume file lives.
pub fn path(job_dir: &Path) -> PathBuf {
    job_dir.join("resume.safetensors")
}

const HALF: u64 = 1 << 24;

fn counter(name: String, value: u64) -> WeightTensor {
    let (hi, lo) = (value / HALF, value % HALF);
    WeightTensor::i64(name, vec![2], vec![hi as f32, lo as f32])
}

fn read_counter(t: &WeightTensor) -> Result<u64, String> {
    match t.values[..] {
        [hi, lo] if hi >= 0.0 && (0.0..HALF as f32).contains(&lo) => {
            Ok(hi as u64 * HALF + lo as u64)
        }
        _ => Err(format!("`{}` is not a counter", t.name)),
    }
}

/// The resume point as named tensors.
pub fn to_tensors(point: &ResumePoint) -> Result<Vec<WeightTensor>, String> {
    let mut out = vec![
        counter("meta/step".into(), point.step),
        counter("meta/clusters".into(), point.optimizer.len() as u64),
    ];
    for p in &point.params {
        out.push(WeightTensor {
            name: format!("param/{}", p.name),
            ..p.clone()
        });
    }
    for (c, states) in point.optimizer.iter().enumerate() {
        for state in states {
            out.push(counter(format!("steps/{c}/{}", state.name), state.steps));
            for slot in &state.slots {
                let values = slot.to_f32().map_err(|e| e.to_string())?;
                out.push(WeightTensor::f32(
                    format!("optim/{c}/{}/{}", state.name, slot.name),
                    slot.shape_usize(),
                    values,
                ));
            }
        }
    }
    Ok(out)
}

/// The inverse of [`to_tensors`]; any tensor it does not know is an error.
pub fn from_tensors(tensors: Vec<WeightTensor>) -> Result<ResumePoint, String> {
    let by_name: BTreeMap<String, WeightTensor> =
        tensors.into_iter().map(|t| (t.name.clone(), t)).collect();
    let meta = |name: &str| {
        by_name
            .get(name)
            .ok_or_else(|| format!("`{name}` is missing"))
            .and_then(read_counter)
    };
    let step = meta("meta/step")?;
    let clusters = meta("meta/clusters")? as usize;
    let mut params = Vec::new();
    let mut optimizer: Vec<BTreeMap<String, ParamOptimState>> = vec![BTreeMap::new(); clusters];
    let cluster_of = |text: &str| -> Result<usize, String> {
        text.parse::<usize>()
            .ok()
            .filter(|c| *c < clusters)
            .ok_or_else(|| format!("cluster `{text}` is not one of {clusters}"))
    };
    for (name, t) in &by_name {
        if let Some(param) = name.strip_prefix("param/") {
            params.push(WeightTensor {
                name: param.to_string(),
                ..t.clone()
            });
        } else if let Some(rest) = name.strip_prefix("steps/") {
            let (c, param) = rest
                .split_once('/')
                .ok_or_else(|| format!("`{name}` names no parameter"))?;
            let entry = optimizer[cluster_of(c)?]
                .entry(param.to_string())
                .or_insert_with(|| ParamOptimState {
                    name: param.to_string(),
                    steps: 0,
                    slots: Vec::new(),
                });
            entry.steps = read_counter(t)?;
        } else if let Some(rest) = name.strip_prefix("optim/") {
            let (c, rest) = rest
                .split_once('/')
                .ok_or_else(|| format!("`{name}` names no parameter"))?;
            let (param, slot) = rest
                .rsplit_once('/')
                .ok_or_else(|| format!("`{name}` names no slot"))?;
            if t.dtype != DType::F32 {
                return Err(format!("`{name}` is not f32"));
            }
            let entry = optimizer[cluster_of(c)?]
                .entry(param.to_string())
                .or_insert_with(|| ParamOptimState {
                    name: param.to_string(),
                    steps: 0,
                    slots: Vec::new(),
                });
            entry.slots.push(WireTensor::from_f32(
                slot,
                &t.shape,
                &t.values,
                WireDType::F32,
            ));
        } else if !name.starts_with("meta/") {
            return Err(format!("unknown tensor `{name}`"));
        }
    }
    Ok(ResumePoint {
        step,
        params,
        optimizer: optimizer
            .into_iter()
            .map(|m| m.into_values().collect())
            .collect(),
    })
}

/// Writes the resume point atomically (blocking).
pub fn write(job_dir: &Path, point: &ResumePoint) -> std::io::Result<()> {
    let tensors = to_tensors(point).map_err(std::io::Error::other)?;
    std::fs::create_dir_all(job_dir)?;
    write_safetensors(&path(job_dir), &tensors)
}

/// The job's last resume point, `None` if it never synced (blocking).
pub fn read(job_dir: &Path) -> Result<Option<ResumePoint>, String> {
    let path = path(job_dir);
    if !path.exists() {
        return Ok(None);
    }
    let tensors = read_safetensors(&path).map_err(|e| e.to_string())?;
    from_tensors(tensors).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point() -> ResumePoint {
        let slot = |name: &str, v: f32| WireTensor::from_f32(name, &[2], &[v, -v], WireDType::F32);
        ResumePoint {
            // Past 2^24, where a single f32 would round.
            step: (1 << 30) + 3,
            // In name order, as the file gives them back.
            params: vec![
                WeightTensor::i64("bn.num_batches_tracked", vec![], vec![7.0]),
                WeightTensor::f32("fc/0.weight", vec![2], vec![0.5, 1.5]),
            ],
            optimizer: vec![
                vec![ParamOptimState {
                    name: "fc/0.weight".into(),
                    steps: 12,
                    slots: vec![slot("exp_avg", 0.25), slot("exp_avg_sq", 0.125)],
                }],
                Vec::new(),
                vec![ParamOptimState {
                    name: "fc/0.weight".into(),
                    steps: 12,
                    slots: vec![slot("momentum_buffer", 3.0)],
                }],
            ],
        }
    }

    #[test]
    fn a_resume_point_survives_the_file_exactly_even_with_slashes_in_names() {
        let dir = tempfile::tempdir().unwrap();
        let p = point();
        write(dir.path(), &p).unwrap();
        assert_eq!(read(dir.path()).unwrap(), Some(p));
        assert!(
            !dir.path().join("resume.safetensors.tmp").exists(),
            "the temporary file was renamed"
        );
    }

    #[test]
    fn no_file_is_no_resume_point_and_a_foreign_tensor_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read(dir.path()).unwrap(), None);
        let mut tensors = to_tensors(&point()).unwrap();
        tensors.push(WeightTensor::f32("stray", vec![1], vec![0.0]));
        assert!(from_tensors(tensors).unwrap_err().contains("stray"));
        let mut tensors = to_tensors(&point()).unwrap();
        tensors.push(WeightTensor::f32("optim/9/w/exp_avg", vec![1], vec![0.0]));
        assert!(from_tensors(tensors).unwrap_err().contains("cluster `9`"));
    }
}
