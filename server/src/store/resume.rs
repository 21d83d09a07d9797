//! The resume file: a sync point's whole state ([`ResumePoint`]: averaged
//! parameters, each cluster's optimizer state, steps done) in one
//! safetensors file next to the job's checkpoint, written atomically (a
//! temporary file, fsynced, renamed over the old one), so a server killed at
//! any moment finds either the previous sync point or the new one, whole.
//!
//! Tensor names: `param/NAME`, `optim/CLUSTER/NAME/SLOT`, `steps/CLUSTER/NAME`,
//! `outer/NAME` (DiLoCo's outer momentum) and `meta/step`, `meta/clusters`. Counters are stored as two 24-bit halves
//! (safetensors I64 values pass through f32 here, exact to 2^24 only).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rookery_job::weights::{read_wire_safetensors, write_wire_safetensors};
use rookery_proto::{ParamOptimState, WireDType, WireTensor};

use crate::run::ResumePoint;

/// Where a job's resume file lives.
pub fn path(job_dir: &Path) -> PathBuf {
    job_dir.join("resume.safetensors")
}

const HALF: u64 = 1 << 24;

/// Most clusters a resume point may claim: a plan has no more clusters than
/// providers, and no server holds this many connections. A damaged file's
/// count is refused before anything is sized by it.
pub const MAX_CLUSTERS: u64 = 65_536;

fn checked_clusters(clusters: u64) -> Result<usize, String> {
    if clusters > MAX_CLUSTERS {
        return Err(format!(
            "`meta/clusters` claims {clusters} clusters, more than the {MAX_CLUSTERS} any run has"
        ));
    }
    Ok(clusters as usize)
}

fn counter(name: String, value: u64) -> WireTensor {
    let (hi, lo) = (value / HALF, value % HALF);
    WireTensor::from_i64(name, &[2], &[hi as i64, lo as i64])
}

fn read_counter(t: &WireTensor) -> Result<u64, String> {
    match t.to_i64().ok().as_deref() {
        Some(&[hi, lo]) if hi >= 0 && (0..HALF as i64).contains(&lo) => {
            Ok(hi as u64 * HALF + lo as u64)
        }
        _ => Err(format!("`{}` is not a counter", t.name)),
    }
}

/// The resume point as named tensors, sharing its buffers.
pub fn to_tensors(point: &ResumePoint) -> Vec<WireTensor> {
    let mut out = vec![
        counter("meta/step".into(), point.step),
        counter("meta/clusters".into(), point.optimizer.len() as u64),
    ];
    for p in &point.params {
        out.push(WireTensor {
            name: format!("param/{}", p.name),
            ..p.clone()
        });
    }
    for m in &point.outer_momentum {
        out.push(WireTensor {
            name: format!("outer/{}", m.name),
            ..m.clone()
        });
    }
    for (c, states) in point.optimizer.iter().enumerate() {
        for state in states {
            out.push(counter(format!("steps/{c}/{}", state.name), state.steps));
            for slot in &state.slots {
                out.push(WireTensor {
                    name: format!("optim/{c}/{}/{}", state.name, slot.name),
                    ..slot.clone()
                });
            }
        }
    }
    out
}

/// The inverse of [`to_tensors`]; any tensor it does not know is an error.
pub fn from_tensors(tensors: Vec<WireTensor>) -> Result<ResumePoint, String> {
    let by_name: BTreeMap<String, WireTensor> =
        tensors.into_iter().map(|t| (t.name.clone(), t)).collect();
    let meta = |name: &str| {
        by_name
            .get(name)
            .ok_or_else(|| format!("`{name}` is missing"))
            .and_then(read_counter)
    };
    let step = meta("meta/step")?;
    let clusters = meta("meta/clusters")?;
    let clusters = checked_clusters(clusters)?;
    let mut params = Vec::new();
    let mut outer_momentum = Vec::new();
    let mut optimizer: Vec<BTreeMap<String, ParamOptimState>> = vec![BTreeMap::new(); clusters];
    let cluster_of = |text: &str| -> Result<usize, String> {
        text.parse::<usize>()
            .ok()
            .filter(|c| *c < clusters)
            .ok_or_else(|| format!("cluster `{text}` is not one of {clusters}"))
    };
    for (name, t) in by_name.iter() {
        if let Some(param) = name.strip_prefix("param/") {
            params.push(WireTensor {
                name: param.to_string(),
                ..t.clone()
            });
        } else if let Some(param) = name.strip_prefix("outer/") {
            if t.dtype != WireDType::F32 {
                return Err(format!("`{name}` is not f32"));
            }
            outer_momentum.push(WireTensor {
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
            if t.dtype != WireDType::F32 {
                return Err(format!("`{name}` is not f32"));
            }
            let entry = optimizer[cluster_of(c)?]
                .entry(param.to_string())
                .or_insert_with(|| ParamOptimState {
                    name: param.to_string(),
                    steps: 0,
                    slots: Vec::new(),
                });
            entry.slots.push(WireTensor {
                name: slot.to_string(),
                ..t.clone()
            });
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
        outer_momentum,
    })
}

/// Writes the resume point atomically (blocking), tensor by tensor from
/// the buffers it shares with the run.
pub fn write(job_dir: &Path, point: &ResumePoint) -> std::io::Result<()> {
    std::fs::create_dir_all(job_dir)?;
    write_wire_safetensors(&path(job_dir), &to_tensors(point))
}

/// The job's last resume point, `None` if it never synced (blocking). Its
/// tensors are views into the one buffer holding the file.
pub fn read(job_dir: &Path) -> Result<Option<ResumePoint>, String> {
    let path = path(job_dir);
    if !path.exists() {
        return Ok(None);
    }
    let tensors = read_wire_safetensors(&path).map_err(|e| e.to_string())?;
    from_tensors(tensors).map(Some)
}

/// How many clusters the job's last resume point has, `None` if it never
/// synced, reading only the file's header and that counter (blocking): a
/// queued job is planned with the count before its parameters are read.
pub fn clusters(job_dir: &Path) -> Result<Option<usize>, String> {
    use std::io::{Read, Seek, SeekFrom};
    let path = path(job_dir);
    let shown = path.display();
    let mut file = match std::fs::File::open(&path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("{shown}: {e}")),
    };
    let size = file.metadata().map_err(|e| format!("{shown}: {e}"))?.len();
    let mut len = [0u8; 8];
    file.read_exact(&mut len)
        .map_err(|e| format!("{shown}: {e}"))?;
    let n = u64::from_le_bytes(len);
    if n > size.saturating_sub(8) {
        return Err(format!("{shown}: the header claims {n} bytes"));
    }
    let mut head = vec![0u8; n as usize];
    file.read_exact(&mut head)
        .map_err(|e| format!("{shown}: {e}"))?;
    let header: serde_json::Value =
        serde_json::from_slice(&head).map_err(|e| format!("{shown}: header: {e}"))?;
    let offsets = header
        .get("meta/clusters")
        .and_then(|t| t.get("data_offsets"))
        .and_then(|o| o.as_array())
        .and_then(|o| Some((o.first()?.as_u64()?, o.get(1)?.as_u64()?)))
        .ok_or_else(|| format!("{shown}: `meta/clusters` is missing"))?;
    if offsets.1 != offsets.0 + 16 || 8 + n + offsets.1 > size {
        return Err(format!("{shown}: `meta/clusters` is not a counter"));
    }
    file.seek(SeekFrom::Start(8 + n + offsets.0))
        .map_err(|e| format!("{shown}: {e}"))?;
    let mut data = vec![0u8; 16];
    file.read_exact(&mut data)
        .map_err(|e| format!("{shown}: {e}"))?;
    let t = WireTensor::from_le_bytes("meta/clusters", &[2], WireDType::I64, data);
    checked_clusters(read_counter(&t)?)
        .map(Some)
        .map_err(|e| format!("{shown}: {e}"))
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
                WireTensor::from_i64("bn.num_batches_tracked", &[], &[7]),
                WireTensor::from_f32("fc/0.weight", &[2], &[0.5, 1.5], WireDType::F32),
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
            outer_momentum: vec![WireTensor::from_f32(
                "fc/0.weight",
                &[2],
                &[0.75, -0.5],
                WireDType::F32,
            )],
        }
    }

    #[test]
    fn a_resume_point_survives_the_file_exactly_even_with_slashes_in_names() {
        let dir = tempfile::tempdir().unwrap();
        let p = point();
        write(dir.path(), &p).unwrap();
        assert_eq!(clusters(dir.path()).unwrap(), Some(3));
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
        assert_eq!(clusters(dir.path()).unwrap(), None);
        let mut tensors = to_tensors(&point());
        tensors.push(WireTensor::from_f32("stray", &[1], &[0.0], WireDType::F32));
        assert!(from_tensors(tensors).unwrap_err().contains("stray"));
        let mut tensors = to_tensors(&point());
        tensors.push(WireTensor::from_f32(
            "optim/9/w/exp_avg",
            &[1],
            &[0.0],
            WireDType::F32,
        ));
        assert!(from_tensors(tensors).unwrap_err().contains("cluster `9`"));
    }

    #[test]
    fn a_huge_cluster_count_is_refused_before_anything_is_sized_by_it() {
        let dir = tempfile::tempdir().unwrap();
        let mut tensors = to_tensors(&point());
        tensors[1] = counter("meta/clusters".into(), (1 << 47) + 5);
        write_wire_safetensors(&path(dir.path()), &tensors).unwrap();
        let e = clusters(dir.path()).unwrap_err();
        assert!(e.contains("more than the 65536"), "{e}");
        let e = read(dir.path()).unwrap_err();
        assert!(e.contains("more than the 65536"), "{e}");
    }
}
