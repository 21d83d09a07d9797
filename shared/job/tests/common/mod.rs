//! Builders for small data files, written byte by byte as the formats specify
//! (or with the format's own crate), so the readers are checked against the
//! formats rather than against themselves.
#![allow(dead_code, clippy::unwrap_used)]

pub mod example;

use std::io::Write;
use std::path::{Path, PathBuf};

use rookery_job::{DataFormat, DataRef, DataSpec};

/// An IDX file: `00 00 type ndim`, big-endian u32 dims, then `payload`.
pub fn idx(type_code: u8, dims: &[u32], payload: &[u8]) -> Vec<u8> {
    let mut out = vec![0, 0, type_code, dims.len() as u8];
    for d in dims {
        out.extend(d.to_be_bytes());
    }
    out.extend(payload);
    out
}

/// A `.npy` file of version `major`, header padded to 64 bytes as NumPy does.
pub fn npy_v(major: u8, descr: &str, fortran: bool, shape: &str, payload: &[u8]) -> Vec<u8> {
    let fortran = if fortran { "True" } else { "False" };
    let mut header =
        format!("{{'descr': '{descr}', 'fortran_order': {fortran}, 'shape': {shape}, }}");
    let len_bytes = if major == 1 { 2 } else { 4 };
    while (8 + len_bytes + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY".to_vec();
    out.extend([major, 0]);
    if major == 1 {
        out.extend((header.len() as u16).to_le_bytes());
    } else {
        out.extend((header.len() as u32).to_le_bytes());
    }
    out.extend(header.as_bytes());
    out.extend(payload);
    out
}

pub fn npy(descr: &str, shape: &str, payload: &[u8]) -> Vec<u8> {
    npy_v(1, descr, false, shape, payload)
}

pub fn f32_le(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

pub fn i64_le(values: &[i64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// A zip of `(name, bytes)` entries, stored or deflated, as `np.savez` /
/// `np.savez_compressed` write.
pub fn npz(entries: &[(&str, Vec<u8>)], deflate: bool) -> Vec<u8> {
    let mut w = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let method = if deflate {
        zip::CompressionMethod::Deflated
    } else {
        zip::CompressionMethod::Stored
    };
    let opts = zip::write::FileOptions::default().compression_method(method);
    for (name, bytes) in entries {
        w.start_file(*name, opts).unwrap();
        w.write_all(bytes).unwrap();
    }
    w.finish().unwrap().into_inner()
}

/// A safetensors file written by the `safetensors` crate.
pub fn safetensors(entries: &[(&str, safetensors::Dtype, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = entries
        .iter()
        .map(|(name, dtype, shape, data)| {
            (
                name.to_string(),
                safetensors::tensor::TensorView::new(*dtype, shape.clone(), data).unwrap(),
            )
        })
        .collect();
    safetensors::serialize(views, &None).unwrap()
}

pub fn gz(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

pub fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

pub fn data_spec(format: DataFormat, inputs: DataRef, labels: DataRef) -> DataSpec {
    DataSpec {
        format,
        train_inputs: inputs,
        train_labels: Some(labels),
        test_inputs: None,
        test_labels: None,
        scale: None,
        mean: None,
        std: None,
        seq_len: None,
        token_dtype: None,
    }
}
