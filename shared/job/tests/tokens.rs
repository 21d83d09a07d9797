//! Token files (`format = "tokens"`): raw u16/u32 and `.npy` ids, gzipped
//! or not, cut into next-token windows in the seeded order; the job-file
//! keys; and every bad input (a truncated file, too few tokens, an id past
//! the vocabulary, a window longer than the model's positions) as an error
//! naming its field or file.
// Helpers outside #[test] fns panic on purpose too: a panic is a test failure.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::Write;
use std::path::Path;

use common::{i64_le, npy, write};
use prost::Message;
use rookery_job::{
    DataFormat, DataRef, JobError, JobSpec, Labels, Samples, Schedule, Split, TokenDType, TokenIds,
    TokenWindows, epoch_permutation, load_split, prepare, validate_against_model,
};
use rookery_model::Loss;
use rookery_model::onnx::pb;

fn u16_le(ids: &[u16]) -> Vec<u8> {
    ids.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn u32_le(ids: &[u32]) -> Vec<u8> {
    ids.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut z = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    z.write_all(bytes).unwrap();
    z.finish().unwrap()
}

fn windows(
    dir: &Path,
    name: &str,
    bytes: &[u8],
    dtype: Option<TokenDType>,
    seq: usize,
) -> Result<TokenWindows, JobError> {
    write(dir, name, bytes);
    TokenWindows::read(&DataRef::file(dir.join(name)), dtype, seq)
}

#[test]
fn windows_are_seq_len_plus_one_tokens_at_a_stride_of_seq_len() {
    let dir = tempfile::tempdir().unwrap();
    let ids: Vec<u16> = (100..110).collect(); // 10 tokens
    let w = windows(dir.path(), "t.u16", &u16_le(&ids), None, 3).unwrap();
    // (10 - 1) / 3 = 3 windows: [100..104), [103..107), [106..110).
    assert_eq!((w.len(), w.seq_len()), (3, 3));
    assert_eq!(w.gather_inputs(&[0]), [100, 101, 102]);
    assert_eq!(w.gather_labels(&[0]), [101, 102, 103]);
    assert_eq!(w.gather_inputs(&[2, 1]), [106, 107, 108, 103, 104, 105]);
    assert_eq!(w.gather_labels(&[2, 1]), [107, 108, 109, 104, 105, 106]);
    // One token short of a fourth window.
    let w = windows(dir.path(), "t.u16", &u16_le(&ids[..9]), None, 3).unwrap();
    assert_eq!(w.len(), 2);
}

#[test]
fn every_form_of_the_file_reads_the_same_ids() {
    let dir = tempfile::tempdir().unwrap();
    let ids: Vec<u32> = vec![0, 7, 65535, 3, 9, 1];
    let as_u16: Vec<u16> = ids.iter().map(|&v| v as u16).collect();
    let want = TokenIds::U32(ids.clone());
    let cases: Vec<(&str, Vec<u8>, Option<TokenDType>)> = vec![
        ("a.u16", u16_le(&as_u16), None),
        ("a.u16.gz", gzip(&u16_le(&as_u16)), None),
        ("a.bin", u16_le(&as_u16), Some(TokenDType::U16)),
        ("a.u32", u32_le(&ids), None),
        ("a.u32.gz", gzip(&u32_le(&ids)), None),
        ("a.tok", u32_le(&ids), Some(TokenDType::U32)),
        ("a.npy", npy("<u2", "(6,)", &u16_le(&as_u16)), None),
        ("a.npy.gz", gzip(&npy("<u4", "(6,)", &u32_le(&ids))), None),
        (
            "b.npy",
            npy(
                "<i8",
                "(6,)",
                &i64_le(&ids.iter().map(|&v| i64::from(v)).collect::<Vec<_>>()),
            ),
            None,
        ),
        (
            "c.npy",
            npy(
                "<i4",
                "(6,)",
                &ids.iter()
                    .flat_map(|&v| (v as i32).to_le_bytes())
                    .collect::<Vec<_>>(),
            ),
            None,
        ),
    ];
    for (name, bytes, dtype) in cases {
        let w =
            windows(dir.path(), name, &bytes, dtype, 2).unwrap_or_else(|e| panic!("{name}: {e}"));
        let got: Vec<u32> = (0..w.ids().len()).map(|i| w.ids().get(i)).collect();
        let want_ids: Vec<u32> = (0..want.len()).map(|i| want.get(i)).collect();
        assert_eq!(got, want_ids, "{name}");
        assert_eq!(w.gather_labels(&[1]), [3, 9], "{name}");
    }
    // u16 files keep their ids at two bytes each.
    let w = windows(dir.path(), "k.u16", &u16_le(&as_u16), None, 2).unwrap();
    assert!(matches!(w.ids(), TokenIds::U16(v) if v.len() == 6));
}

#[test]
fn a_file_that_is_not_whole_ids_or_too_short_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let e = windows(dir.path(), "odd.u16", &[1, 0, 2, 0, 3], None, 1).unwrap_err();
    assert!(
        matches!(&e, JobError::File { path, .. } if path.ends_with("odd.u16")),
        "{e}"
    );
    assert!(
        e.to_string()
            .contains("5 bytes, not a whole number of u16 token ids"),
        "{e}"
    );
    let e = windows(dir.path(), "odd.u32", &u32_le(&[1, 2])[..6], None, 1).unwrap_err();
    assert!(
        e.to_string().contains("6 bytes, not a whole number of u32"),
        "{e}"
    );

    let e = windows(dir.path(), "short.u16", &u16_le(&[1, 2, 3, 4]), None, 4).unwrap_err();
    assert!(
        matches!(&e, JobError::File { path, .. } if path.ends_with("short.u16")),
        "{e}"
    );
    assert!(
        e.to_string()
            .contains("holds 4 tokens, fewer than one window needs: data.seq_len + 1 = 5"),
        "{e}"
    );
    let e = windows(dir.path(), "empty.u16", &[], None, 1).unwrap_err();
    assert!(e.to_string().contains("holds 0 tokens"), "{e}");
}

#[test]
fn the_width_comes_from_token_dtype_or_the_name_and_they_must_agree() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = u16_le(&[1, 2, 3, 4]);
    let field = |e: &JobError| match e {
        JobError::Field { field, .. } => field.clone(),
        other => panic!("not a field error: {other}"),
    };
    let e = windows(dir.path(), "t.bin", &bytes, None, 1).unwrap_err();
    assert_eq!(field(&e), "data.token_dtype");
    assert!(e.to_string().contains("missing"), "{e}");
    let e = windows(dir.path(), "t.u16", &bytes, Some(TokenDType::U32), 1).unwrap_err();
    assert_eq!(field(&e), "data.token_dtype");
    assert!(e.to_string().contains("says u16"), "{e}");
    let e = windows(
        dir.path(),
        "t.npy",
        &npy("<u2", "(4,)", &bytes),
        Some(TokenDType::U16),
        1,
    )
    .unwrap_err();
    assert_eq!(field(&e), "data.token_dtype");
    // A .npy must be flat, of integer ids, none negative.
    let e = windows(dir.path(), "m.npy", &npy("<u2", "(2, 2)", &bytes), None, 1).unwrap_err();
    assert!(e.to_string().contains("one flat sequence"), "{e}");
    let e = windows(
        dir.path(),
        "f.npy",
        &npy("<f4", "(1,)", &1f32.to_le_bytes()),
        None,
        1,
    )
    .unwrap_err();
    assert!(e.to_string().contains("u16, u32, i32 or i64"), "{e}");
    let e = windows(
        dir.path(),
        "n.npy",
        &npy("<i8", "(3,)", &i64_le(&[1, -4, 2])),
        None,
        1,
    )
    .unwrap_err();
    assert!(e.to_string().contains("token id -4 at position 1"), "{e}");
}

#[test]
fn windows_follow_the_seeded_order_of_any_samples() {
    let dir = tempfile::tempdir().unwrap();
    let ids: Vec<u16> = (0..41).collect(); // 10 windows of 4
    let w = windows(dir.path(), "t.u16", &u16_le(&ids), None, 4).unwrap();
    let schedule = Schedule::new(w.len(), 2, 2).unwrap();
    assert_eq!(schedule.steps_per_epoch, 2);
    let perm = epoch_permutation(w.len(), 42, 0, true);
    assert_ne!(perm, (0..10).collect::<Vec<_>>(), "seed 42 shuffles");
    let batch = schedule.batch(&perm, 1, 1);
    let inputs = w.gather_inputs(batch);
    let want: Vec<i64> = batch
        .iter()
        .flat_map(|&k| (4 * k as i64)..(4 * k as i64 + 4))
        .collect();
    assert_eq!(inputs, want);
    let labels: Vec<i64> = want.iter().map(|v| v + 1).collect();
    assert_eq!(w.gather_labels(batch), labels);
}

const BIGRAM: &str = r#"
input_shape = [1]
[[layers]]
type = "Embedding"
num_embeddings = 8
embedding_dim = 4
[[layers]]
type = "Flatten"
[[layers]]
type = "Dense"
units = 8
"#;

fn job_text(model: &str, seq_len: usize, extra: &str) -> String {
    format!(
        r#"
[model]
{model}
input_shape = [{seq_len}]
[data]
format = "tokens"
train_inputs = "train.u16"
test_inputs = "test.u16"
seq_len = {seq_len}
{extra}
[training]
batch_size = 4
micro_batches = 2
optimizer = {{ name = "adam", lr = 0.01 }}
"#
    )
}

fn token_job(dir: &Path, model: &str, seq_len: usize, train: &[u16]) -> Result<JobSpec, JobError> {
    write(dir, "train.u16", &u16_le(train));
    write(dir, "test.u16", &u16_le(&[1, 2, 3, 4, 5, 6, 7, 0, 1]));
    JobSpec::from_toml(&job_text(model, seq_len, ""), dir)
}

#[test]
fn a_token_job_file_reads_and_prepares_with_next_token_labels() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "bigram.toml", BIGRAM.as_bytes());
    let train: Vec<u16> = (0..33).map(|i| (i * 3 % 8) as u16).collect();
    let spec = token_job(dir.path(), "spec = \"bigram.toml\"", 1, &train).unwrap();
    assert_eq!(spec.data.format, DataFormat::Tokens);
    assert_eq!(
        (spec.data.seq_len, spec.data.train_labels.as_ref()),
        (Some(1), None)
    );
    // The JSON form carries the token keys through.
    let again = JobSpec::from_json(&spec.to_json().unwrap(), dir.path()).unwrap();
    assert_eq!(again, spec);

    let p = prepare(spec).unwrap();
    assert_eq!((p.train.len(), p.test.as_ref().unwrap().len()), (32, 8));
    // The model's output is [batch, 8]: one class a window of one, so the
    // labels are sent as [batch], as the loss wants them.
    assert_eq!(p.train.label_shape, Vec::<usize>::new());
    assert_eq!(p.train.sample_shape, [1]);
    assert_eq!(p.train.gather_input_ids(&[0, 5]), [0, i64::from(train[5])]);
    assert_eq!(
        p.train.gather_labels(&[0, 5]),
        Labels::Classes(vec![i64::from(train[1]), i64::from(train[6])])
    );
    assert!(matches!(p.train.samples, Samples::Tokens(_)));
}

#[test]
fn token_job_keys_are_checked_by_name() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "bigram.toml", BIGRAM.as_bytes());
    write(dir.path(), "train.u16", &u16_le(&[1, 2, 3]));
    write(dir.path(), "test.u16", &u16_le(&[1, 2, 3]));
    write(dir.path(), "y.npy", &npy("<i8", "(1,)", &i64_le(&[1])));
    let model = "spec = \"bigram.toml\"";
    let field_of = |text: &str| match JobSpec::from_toml(text, dir.path()).unwrap_err() {
        JobError::Field { field, reason } => (field, reason),
        other => panic!("not a field error: {other}"),
    };
    let (f, r) = field_of(&job_text(model, 1, "train_labels = \"y.npy\""));
    assert_eq!(f, "data.train_labels");
    assert!(r.contains("next token"), "{r}");
    let (f, _) = field_of(&job_text(model, 1, "test_labels = \"y.npy\""));
    assert_eq!(f, "data.test_labels");
    let (f, _) = field_of(&job_text(model, 1, "").replace("seq_len = 1\n", ""));
    assert_eq!(f, "data.seq_len");
    let (f, _) =
        field_of(&job_text(model, 0, "").replace("input_shape = [0]", "input_shape = [1]"));
    assert_eq!(f, "data.seq_len");
    let (f, r) =
        field_of(&job_text(model, 4, "").replace("input_shape = [4]", "input_shape = [2, 2]"));
    assert_eq!(f, "model.input_shape");
    assert!(r.contains("[4]"), "{r}");
    let (f, _) = field_of(&job_text(model, 1, "token_dtype = \"u8\""));
    assert_eq!(f, "data.token_dtype");
    // The token keys belong to the tokens format only.
    let npy_job = r#"
[model]
spec = "bigram.toml"
input_shape = [1]
[data]
format = "npy"
train_inputs = "y.npy"
train_labels = "y.npy"
seq_len = 4
[training]
batch_size = 1
"#;
    let (f, _) = field_of(npy_job);
    assert_eq!(f, "data.seq_len");
    let (f, _) = field_of(&npy_job.replace("seq_len = 4", "token_dtype = \"u16\""));
    assert_eq!(f, "data.token_dtype");
    let (f, _) = field_of(&npy_job.replace("train_labels = \"y.npy\"\n", ""));
    assert_eq!(f, "data.train_labels");
}

#[test]
fn a_token_id_past_the_embedding_table_names_the_file_and_the_vocabulary() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "bigram.toml", BIGRAM.as_bytes());
    let mut train: Vec<u16> = vec![1; 20];
    train[13] = 8; // the table has rows 0..8
    let spec = token_job(dir.path(), "spec = \"bigram.toml\"", 1, &train).unwrap();
    let e = prepare(spec).unwrap_err();
    assert!(
        e.field.as_deref().unwrap_or("").ends_with("train.u16"),
        "{e:?}"
    );
    assert!(
        e.message.contains(
            "token id 8 at position 13 is not below the vocabulary size 8 (the rows of `0.weight`"
        ),
        "{e}"
    );
}

#[test]
fn token_windows_need_cross_entropy_and_an_output_per_position() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "bigram.toml", BIGRAM.as_bytes());
    let train: Vec<u16> = (0..20).map(|i| (i % 8) as u16).collect();
    let spec = token_job(dir.path(), "spec = \"bigram.toml\"", 1, &train).unwrap();
    let graph = spec.load_model().unwrap().graph;
    let mut d = load_split(&spec.data, Split::Train, Loss::cross_entropy())
        .unwrap()
        .unwrap();
    let e = validate_against_model(&graph, &[1], &mut d.clone(), Loss::Mse).unwrap_err();
    assert!(
        matches!(&e, JobError::Field { field, .. } if field == "training.loss"),
        "{e}"
    );
    // Windows of 2 against a model whose output has no sequence dimension.
    let mut two = spec.clone();
    two.data.seq_len = Some(2);
    two.model.input_shape = vec![2];
    let mut d2 = load_split(&two.data, Split::Train, Loss::cross_entropy())
        .unwrap()
        .unwrap();
    let e = validate_against_model(&graph, &[2], &mut d2, Loss::cross_entropy()).unwrap_err();
    assert!(e.to_string().contains("[batch, vocabulary, 2]"), "{e}");
    validate_against_model(&graph, &[1], &mut d, Loss::cross_entropy()).unwrap();
}

// A tiny GPT-shaped ONNX export: token and position embeddings (positions
// from `arange` over the input's sequence dimension, as exporters write it)
// and a head, with logits [batch, vocab, seq] (torch's cross-entropy layout).
fn tiny_gpt(seq_dim: Option<i64>, positions: usize) -> Vec<u8> {
    use pb::tensor_shape_proto::{Dimension, dimension};
    let (vocab, d) = (8usize, 4usize);
    let int = |name: &str, v: &[i64], dims: &[i64]| pb::TensorProto {
        name: Some(name.into()),
        dims: dims.to_vec(),
        data_type: Some(pb::tensor_proto::DataType::Int64 as i32),
        int64_data: v.to_vec(),
        ..Default::default()
    };
    let float = |name: &str, dims: &[usize]| pb::TensorProto {
        name: Some(name.into()),
        dims: dims.iter().map(|&x| x as i64).collect(),
        data_type: Some(pb::tensor_proto::DataType::Float as i32),
        raw_data: Some(vec![0u8; 4 * dims.iter().product::<usize>()]),
        ..Default::default()
    };
    let node = |op: &str, ins: &[&str], out: &str, attrs: Vec<pb::AttributeProto>| pb::NodeProto {
        op_type: Some(op.into()),
        name: Some(format!("n_{out}")),
        input: ins.iter().map(|s| s.to_string()).collect(),
        output: vec![out.into()],
        attribute: attrs,
        ..Default::default()
    };
    let ints_attr = |name: &str, v: &[i64]| pb::AttributeProto {
        name: Some(name.into()),
        r#type: Some(pb::attribute_proto::AttributeType::Ints as i32),
        ints: v.to_vec(),
        ..Default::default()
    };
    let int_attr = |name: &str, v: i64| pb::AttributeProto {
        name: Some(name.into()),
        r#type: Some(pb::attribute_proto::AttributeType::Int as i32),
        i: Some(v),
        ..Default::default()
    };
    let dim = |v: Option<i64>, p: &str| Dimension {
        value: Some(match v {
            Some(v) => dimension::Value::DimValue(v),
            None => dimension::Value::DimParam(p.into()),
        }),
        ..Default::default()
    };
    let ids = pb::ValueInfoProto {
        name: Some("ids".into()),
        r#type: Some(pb::TypeProto {
            value: Some(pb::type_proto::Value::TensorType(pb::type_proto::Tensor {
                elem_type: Some(pb::tensor_proto::DataType::Int64 as i32),
                shape: Some(pb::TensorShapeProto {
                    dim: vec![dim(None, "batch"), dim(seq_dim, "seq")],
                }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    };
    let constant = |out: &str, v: i64| {
        let value = pb::AttributeProto {
            name: Some("value".into()),
            r#type: Some(pb::attribute_proto::AttributeType::Tensor as i32),
            t: Some(int(out, &[v], &[])),
            ..Default::default()
        };
        node("Constant", &[], out, vec![value])
    };
    let nodes = vec![
        constant("zero", 0),
        constant("one", 1),
        node(
            "Gather",
            &["tok.weight", "ids"],
            "tok",
            vec![int_attr("axis", 0)],
        ),
        node("Shape", &["ids"], "shape", vec![]),
        node("Gather", &["shape", "one"], "t", vec![int_attr("axis", 0)]),
        node("Range", &["zero", "t", "one"], "pos_ids", vec![]),
        node(
            "Gather",
            &["pos.weight", "pos_ids"],
            "pos",
            vec![int_attr("axis", 0)],
        ),
        node("Add", &["tok", "pos"], "h", vec![]),
        node("MatMul", &["h", "head.weight"], "logits_ntv", vec![]),
        node(
            "Transpose",
            &["logits_ntv"],
            "logits",
            vec![ints_attr("perm", &[0, 2, 1])],
        ),
    ];
    pb::ModelProto {
        ir_version: Some(9),
        opset_import: vec![pb::OperatorSetIdProto {
            domain: Some(String::new()),
            version: Some(18),
        }],
        graph: Some(pb::GraphProto {
            node: nodes,
            initializer: vec![
                float("tok.weight", &[vocab, d]),
                float("pos.weight", &[positions, d]),
                float("head.weight", &[d, vocab]),
            ],
            input: vec![ids],
            output: vec![pb::ValueInfoProto {
                name: Some("logits".into()),
                ..Default::default()
            }],
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec()
}

#[test]
fn a_gpt_export_prepares_with_labels_per_position() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "gpt.onnx", &tiny_gpt(None, 8));
    let train: Vec<u16> = (0..41).map(|i| (i % 8) as u16).collect();
    let spec = token_job(dir.path(), "onnx = \"gpt.onnx\"", 4, &train).unwrap();
    let p = prepare(spec).unwrap();
    assert_eq!(p.train.label_shape, [4]);
    assert_eq!(p.train.len(), 10);
}

#[test]
fn a_seq_len_longer_than_the_models_positions_names_data_seq_len() {
    let dir = tempfile::tempdir().unwrap();
    let train: Vec<u16> = (0..41).map(|i| (i % 8) as u16).collect();
    // A dynamic sequence dimension, but a position table of 4 rows.
    write(dir.path(), "gpt.onnx", &tiny_gpt(None, 4));
    let spec = token_job(dir.path(), "onnx = \"gpt.onnx\"", 6, &train).unwrap();
    let e = prepare(spec).unwrap_err();
    assert_eq!(e.field.as_deref(), Some("data.seq_len"), "{e}");
    assert!(
        e.message.contains(
            "6 is longer than the model's 4 positions (its position table `pos.weight` has 4 rows)"
        ),
        "{e}"
    );
    // An export that fixed the sequence at 4.
    write(dir.path(), "gpt.onnx", &tiny_gpt(Some(4), 8));
    let spec = token_job(dir.path(), "onnx = \"gpt.onnx\"", 6, &train).unwrap();
    let e = prepare(spec).unwrap_err();
    assert_eq!(e.field.as_deref(), Some("data.seq_len"), "{e}");
    assert!(
        e.message.contains("6 is longer than the 4 positions"),
        "{e}"
    );
    assert!(e.message.contains("dynamic sequence dimension"), "{e}");
}

#[test]
fn the_gpt_examples_token_files_hold_ids_of_their_tokenizer() {
    let data = Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/gpt/data"
    ));
    let tokenizer: serde_json::Value =
        serde_json::from_slice(&std::fs::read(data.join("tokenizer.json")).unwrap()).unwrap();
    let vocab = tokenizer["model"]["vocab"].as_object().unwrap().len();
    assert_eq!(vocab, 4096);
    for (file, tokens) in [("train.u16.gz", 1_577_745), ("test.u16.gz", 76_242)] {
        let w = TokenWindows::read(&DataRef::file(data.join(file)), None, 128).unwrap();
        assert!(
            matches!(w.ids(), TokenIds::U16(v) if v.len() == tokens),
            "{file}"
        );
        assert_eq!(w.len(), (tokens - 1) / 128, "{file}");
        assert_eq!(w.ids().first_at_or_above(vocab as u64), None, "{file}");
    }
}
