//! Weights files: written atomically, read back exactly, named and typed as a
//! PyTorch `state_dict` (with int64 `num_batches_tracked`), and readable by the
//! `safetensors` crate itself; bad input is an error, not a bad file.
// Helpers outside #[test] fns panic on purpose too: a panic is a test failure.
#![allow(clippy::unwrap_used)]

use rookery_job::{WeightTensor, read_safetensors, to_safetensors_bytes, write_safetensors};
use rookery_model::DType;
use safetensors::{Dtype, SafeTensors};

fn state_dict() -> Vec<WeightTensor> {
    vec![
        WeightTensor::f32(
            "0.weight",
            vec![2, 3],
            vec![1.0, -2.0, 3.5, 0.0, -0.25, 1e-8],
        ),
        WeightTensor::f32("0.bias", vec![2], vec![0.5, -0.5]),
        WeightTensor::f32("1.running_mean", vec![2], vec![0.0, 1.0]),
        WeightTensor::i64("1.num_batches_tracked", vec![], vec![1200.0]),
        ("2.weight".to_string(), vec![1, 1], vec![f32::MIN_POSITIVE]).into(),
    ]
}

#[test]
fn write_then_read_round_trips_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    write_safetensors(&path, &state_dict()).unwrap();
    let mut want = state_dict();
    want.sort_by(|a, b| a.name.cmp(&b.name));
    assert_eq!(read_safetensors(&path).unwrap(), want);
    assert_eq!(
        std::fs::read(&path).unwrap(),
        to_safetensors_bytes(&state_dict()).unwrap()
    );
    // Nothing left beside it; writing again replaces it.
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["model.safetensors"]);
    let smaller = vec![WeightTensor::f32("w", vec![1], vec![7.0])];
    write_safetensors(&path, &smaller).unwrap();
    assert_eq!(read_safetensors(&path).unwrap(), smaller);
}

#[test]
fn header_names_every_tensor_with_its_dtype_shape_and_offsets() {
    let bytes = to_safetensors_bytes(&state_dict()).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    assert_eq!((8 + n) % 8, 0, "data 8-byte aligned");
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    assert_eq!(header["__metadata__"]["format"], "pt");
    assert_eq!(header["0.weight"]["dtype"], "F32");
    assert_eq!(header["0.weight"]["shape"], serde_json::json!([2, 3]));
    assert_eq!(
        header["0.weight"]["data_offsets"],
        serde_json::json!([0, 24])
    );
    assert_eq!(header["1.num_batches_tracked"]["dtype"], "I64");
    assert_eq!(
        header["1.num_batches_tracked"]["shape"],
        serde_json::json!([])
    );
    assert_eq!(bytes.len(), 8 + n + 24 + 8 + 8 + 8 + 4);
}

#[test]
fn the_safetensors_crate_reads_what_we_write() {
    let bytes = to_safetensors_bytes(&state_dict()).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.len(), 5);
    let w = st.tensor("0.weight").unwrap();
    assert_eq!((w.dtype(), w.shape().to_vec()), (Dtype::F32, vec![2, 3]));
    let values: Vec<f32> = w
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(values, [1.0, -2.0, 3.5, 0.0, -0.25, 1e-8]);
    let t = st.tensor("1.num_batches_tracked").unwrap();
    assert_eq!(t.dtype(), Dtype::I64);
    assert_eq!(i64::from_le_bytes(t.data().try_into().unwrap()), 1200);
}

#[test]
fn bad_tensors_and_files_are_errors() {
    let mismatch = [WeightTensor::f32("w", vec![2, 2], vec![1.0; 3])];
    let e = to_safetensors_bytes(&mismatch).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    assert!(e.to_string().contains("`w`"), "{e}");
    let twice = [
        WeightTensor::f32("w", vec![1], vec![1.0]),
        WeightTensor::f32("w", vec![1], vec![2.0]),
    ];
    assert!(to_safetensors_bytes(&twice).is_err());
    assert!(to_safetensors_bytes(&[WeightTensor::f32("__metadata__", vec![], vec![1.0])]).is_err());

    let dir = tempfile::tempdir().unwrap();
    let missing_dir = dir.path().join("no/such/dir/w.safetensors");
    assert!(write_safetensors(&missing_dir, &state_dict()).is_err());

    let half = dir.path().join("half.safetensors");
    let view = safetensors::tensor::TensorView::new(Dtype::F16, vec![1], &[0, 0x3C]).unwrap();
    std::fs::write(&half, safetensors::serialize([("h", view)], &None).unwrap()).unwrap();
    let e = read_safetensors(&half).unwrap_err().to_string();
    assert!(
        e.contains("half.safetensors") && e.contains("`h`") && e.contains("F16"),
        "{e}"
    );

    let junk = dir.path().join("junk.safetensors");
    std::fs::write(&junk, b"\x05\x00\x00\x00\x00\x00\x00\x00{}").unwrap();
    let e = read_safetensors(&junk).unwrap_err().to_string();
    assert!(e.contains("junk.safetensors"), "{e}");
    let e = read_safetensors(&dir.path().join("absent.safetensors"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("absent.safetensors"), "{e}");
    assert_eq!(WeightTensor::f32("x", vec![1], vec![0.0]).dtype, DType::F32);
}

#[test]
fn wire_tensors_are_written_byte_for_byte_as_weight_tensors_and_read_back_as_views() {
    use rookery_job::weights::{read_wire_safetensors, write_wire_safetensors};
    use rookery_proto::{WireDType, WireTensor};
    let wire: Vec<WireTensor> = state_dict()
        .iter()
        .map(|t| {
            let dtype = match t.dtype {
                DType::F32 => WireDType::F32,
                DType::I64 => WireDType::I64,
            };
            WireTensor::from_f32(t.name.clone(), &t.shape, &t.values, dtype)
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    write_wire_safetensors(&path, &wire).unwrap();
    assert_eq!(
        std::fs::read(&path).unwrap(),
        to_safetensors_bytes(&state_dict()).unwrap()
    );
    let mut want = wire.clone();
    want.sort_by(|a, b| a.name.cmp(&b.name));
    let read = read_wire_safetensors(&path).unwrap();
    assert_eq!(read, want);
    // Every tensor is a view into one buffer holding the file.
    let start = read[0].data.as_ptr() as usize;
    assert!(
        read.iter()
            .all(|t| (t.data.as_ptr() as usize).abs_diff(start) < 4096)
    );

    let twice = [wire[0].clone(), wire[0].clone()];
    assert!(write_wire_safetensors(&path, &twice).is_err());
    let mut short = wire[0].clone();
    short.data = short.data.slice(1..);
    assert!(write_wire_safetensors(&path, &[short]).is_err());
    // Quantized activations are never weights.
    let int8 = WireTensor::from_f32("q", &[3], &[1.0, -2.0, 0.5], WireDType::I8Block);
    let error = write_wire_safetensors(&path, &[int8]).unwrap_err();
    assert!(error.to_string().contains("int8"), "{error}");
}
