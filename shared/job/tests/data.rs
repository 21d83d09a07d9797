//! Dataset readers: the repository's real MNIST subset end to end, every format
//! and element type against files written as the formats specify, labels per
//! loss, preprocessing, the checks against the model, and corrupt, truncated or
//! oversized-claiming files (a table, then proptest on random bytes,
//! truncations and byte flips) giving errors that name the file, never panics.
// Helpers outside #[test] fns panic on purpose too: a panic is a test failure.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;

use common::*;
use proptest::prelude::*;
use rookery_job::data::{ElemType, read_array};
use rookery_job::{
    DataFormat, DataRef, Dataset, JobError, JobSpec, Labels, Samples, Split, load_split,
    validate_against_model,
};
use rookery_model::{ClassAxis, Graph, Loss};

fn repo() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

fn mnist_job(normalise: bool) -> JobSpec {
    let data = repo().join("datasets/mnist-10k");
    let model = repo().join("examples/mnist-cnn.toml");
    let norm = if normalise {
        "mean = 0.1307\nstd = 0.3081\n"
    } else {
        ""
    };
    let text = format!(
        r#"
[model]
spec = {model:?}
input_shape = [1, 28, 28]
[data]
format = "idx"
train_inputs = "train-images-idx3-ubyte.gz"
train_labels = "train-labels-idx1-ubyte.gz"
test_inputs = "t10k-images-idx3-ubyte.gz"
test_labels = "t10k-labels-idx1-ubyte.gz"
scale = 0.00392156862745098
{norm}
[training]
batch_size = 64
micro_batches = 4
"#
    );
    JobSpec::from_toml(&text, &data).unwrap()
}

#[test]
fn real_mnist_loads_8000_train_and_2000_test_samples_that_fit_the_cnn() {
    let job = mnist_job(false);
    let loss = job.training.loss;
    let mut train = load_split(&job.data, Split::Train, loss).unwrap().unwrap();
    let mut test = load_split(&job.data, Split::Test, loss).unwrap().unwrap();
    assert_eq!((train.len(), test.len()), (8000, 2000));
    assert_eq!(train.sample_shape, [28, 28]); // as IDX stores it
    assert_eq!(inputs_of(&train).len(), 8000 * 784);

    let graph = job.load_model().unwrap().graph;
    for d in [&mut train, &mut test] {
        validate_against_model(&graph, &job.model.input_shape, d, loss).unwrap();
        assert_eq!(d.sample_shape, [1, 28, 28]);
        let Labels::Classes(c) = labels_of(d) else {
            panic!("classes")
        };
        let mut seen = [0usize; 10];
        for &l in c {
            seen[usize::try_from(l).unwrap()] += 1;
        }
        assert!(seen.iter().all(|&n| n > 0), "every digit occurs: {seen:?}");
        let max = inputs_of(d).iter().copied().fold(f32::MIN, f32::max);
        let min = inputs_of(d).iter().copied().fold(f32::MAX, f32::min);
        assert!(
            (max - 1.0).abs() < 1e-6 && min == 0.0,
            "scaled to [0, 1]: {min}..{max}"
        );
    }
    // The files' own first labels, in file order.
    assert_eq!(
        train.gather_labels(&[0, 1, 2, 3, 4, 5, 6, 7]),
        Labels::Classes(vec![8, 0, 2, 0, 0, 0, 9, 6])
    );
    assert_eq!(
        test.gather_labels(&[0, 1, 2, 3, 4, 5, 6, 7]),
        Labels::Classes(vec![9, 8, 7, 4, 2, 6, 9, 9])
    );

    // With mean/std: black pixels become -mean/std.
    let job = mnist_job(true);
    let test = load_split(&job.data, Split::Test, loss).unwrap().unwrap();
    let min = inputs_of(&test).iter().copied().fold(f32::MAX, f32::min);
    assert!((min - (-0.1307f32 / 0.3081)).abs() < 1e-5, "{min}");
}

#[test]
fn missing_test_split_is_none() {
    let dir = tempfile::tempdir().unwrap();
    let x = write(
        dir.path(),
        "x.npy",
        &npy("<f4", "(2, 1)", &f32_le(&[1.0, 2.0])),
    );
    let y = write(dir.path(), "y.npy", &npy("<i8", "(2,)", &i64_le(&[0, 1])));
    let spec = data_spec(DataFormat::Npy, DataRef::file(x), DataRef::file(y));
    assert!(
        load_split(&spec, Split::Test, Loss::cross_entropy())
            .unwrap()
            .is_none()
    );
    assert_eq!(
        load_split(&spec, Split::Train, Loss::cross_entropy())
            .unwrap()
            .unwrap()
            .len(),
        2
    );
}

#[test]
fn npy_reads_every_supported_dtype_and_byte_order() {
    let dir = tempfile::tempdir().unwrap();
    let cases: Vec<(&str, Vec<u8>, Vec<f32>, ElemType)> = vec![
        ("<f4", f32_le(&[1.5, -2.0]), vec![1.5, -2.0], ElemType::F32),
        (
            ">f4",
            [1.5f32, -2.0]
                .iter()
                .flat_map(|v| v.to_be_bytes())
                .collect(),
            vec![1.5, -2.0],
            ElemType::F32,
        ),
        (
            "<f8",
            [0.25f64, -8.0]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
            vec![0.25, -8.0],
            ElemType::F64,
        ),
        (
            "<f2",
            [0x3C00u16, 0xC000]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
            vec![1.0, -2.0],
            ElemType::F16,
        ),
        ("|u1", vec![0, 255], vec![0.0, 255.0], ElemType::U8),
        ("|b1", vec![0, 1], vec![0.0, 1.0], ElemType::U8),
        ("|i1", vec![0x80, 0x7F], vec![-128.0, 127.0], ElemType::I8),
        (
            "<i2",
            [-300i16, 300]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
            vec![-300.0, 300.0],
            ElemType::I16,
        ),
        (
            "<u2",
            [65535u16, 1].iter().flat_map(|v| v.to_le_bytes()).collect(),
            vec![65535.0, 1.0],
            ElemType::U16,
        ),
        (
            "<i4",
            [-70000i32, 7]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
            vec![-70000.0, 7.0],
            ElemType::I32,
        ),
        (
            ">i4",
            [-70000i32, 7]
                .iter()
                .flat_map(|v| v.to_be_bytes())
                .collect(),
            vec![-70000.0, 7.0],
            ElemType::I32,
        ),
        (
            "<i8",
            i64_le(&[-3, 1 << 40]),
            vec![-3.0, (1u64 << 40) as f32],
            ElemType::I64,
        ),
        (
            "<u8",
            [5u64, 6].iter().flat_map(|v| v.to_le_bytes()).collect(),
            vec![5.0, 6.0],
            ElemType::U64,
        ),
    ];
    for (i, (descr, payload, want, elem)) in cases.into_iter().enumerate() {
        for major in [1, 2, 3] {
            let p = write(
                dir.path(),
                &format!("a{i}-{major}.npy"),
                &npy_v(major, descr, false, "(2,)", &payload),
            );
            let a = read_array(DataFormat::Npy, &DataRef::file(&p)).unwrap();
            assert_eq!((a.shape(), a.elem()), (&[2usize][..], elem), "{descr}");
            assert_eq!(a.to_f32(), want, "{descr} v{major}");
        }
    }
    // Gzipped, found by its magic bytes although named .npy.
    let p = write(
        dir.path(),
        "g.npy",
        &gz(&npy("<f4", "(1, 2)", &f32_le(&[3.0, 4.0]))),
    );
    let a = read_array(DataFormat::Npy, &DataRef::file(&p)).unwrap();
    assert_eq!((a.shape(), a.to_f32()), (&[1usize, 2][..], vec![3.0, 4.0]));
    // Fortran order is fine where it is the same layout (one non-trivial axis).
    let p = write(
        dir.path(),
        "f1.npy",
        &npy_v(1, "<f4", true, "(3,)", &f32_le(&[1.0, 2.0, 3.0])),
    );
    assert_eq!(
        read_array(DataFormat::Npy, &DataRef::file(&p))
            .unwrap()
            .to_f32(),
        [1.0, 2.0, 3.0]
    );
    // Scalars and Python 2 long dims parse too.
    let p = write(
        dir.path(),
        "l.npy",
        &npy("<f4", "(1L, 2L)", &f32_le(&[1.0, 2.0])),
    );
    assert_eq!(
        read_array(DataFormat::Npy, &DataRef::file(&p))
            .unwrap()
            .shape(),
        [1, 2]
    );
}

#[test]
fn idx_reads_every_element_type_plain_and_gzipped() {
    let dir = tempfile::tempdir().unwrap();
    let cases: Vec<(u8, Vec<u8>, Vec<f32>)> = vec![
        (0x08, vec![0, 200], vec![0.0, 200.0]),
        (0x09, vec![0xFF, 5], vec![-1.0, 5.0]),
        (
            0x0B,
            [-2i16, 3].iter().flat_map(|v| v.to_be_bytes()).collect(),
            vec![-2.0, 3.0],
        ),
        (
            0x0C,
            [-2i32, 1 << 20]
                .iter()
                .flat_map(|v| v.to_be_bytes())
                .collect(),
            vec![-2.0, (1 << 20) as f32],
        ),
        (
            0x0D,
            [0.5f32, -1.25]
                .iter()
                .flat_map(|v| v.to_be_bytes())
                .collect(),
            vec![0.5, -1.25],
        ),
        (
            0x0E,
            [0.5f64, 1e3].iter().flat_map(|v| v.to_be_bytes()).collect(),
            vec![0.5, 1000.0],
        ),
    ];
    for (t, payload, want) in cases {
        let bytes = idx(t, &[2, 1], &payload);
        for (name, b) in [
            (format!("p{t}.idx"), bytes.clone()),
            (format!("g{t}.idx"), gz(&bytes)),
        ] {
            let p = write(dir.path(), &name, &b);
            let a = read_array(DataFormat::Idx, &DataRef::file(&p)).unwrap();
            assert_eq!(a.shape(), [2, 1], "{name}");
            assert_eq!(a.to_f32(), want, "{name}");
        }
    }
}

#[test]
fn npz_reads_named_arrays_stored_and_deflated() {
    let dir = tempfile::tempdir().unwrap();
    let x = npy("<f4", "(3, 2)", &f32_le(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]));
    let y = npy("<i8", "(3,)", &i64_le(&[2, 0, 1]));
    for deflate in [false, true] {
        let p = write(
            dir.path(),
            &format!("d{deflate}.npz"),
            &npz(
                &[("x_train.npy", x.clone()), ("y_train.npy", y.clone())],
                deflate,
            ),
        );
        let spec = data_spec(
            DataFormat::Npz,
            DataRef::member(&p, "x_train"),
            DataRef::member(&p, "y_train"),
        );
        let d = load_split(&spec, Split::Train, Loss::cross_entropy())
            .unwrap()
            .unwrap();
        assert_eq!(d.sample_shape, [2]);
        assert_eq!(inputs_of(&d), [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!(*labels_of(&d), Labels::Classes(vec![2, 0, 1]));
        // Without a name, a file of two arrays is an error listing them.
        let e = read_array(DataFormat::Npz, &DataRef::file(&p))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("x_train") && e.contains("y_train") && e.contains(&p.display().to_string()),
            "{e}"
        );
        let e = read_array(DataFormat::Npz, &DataRef::member(&p, "z"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no array `z`") && e.contains("x_train"), "{e}");
    }
    // A single array needs no name.
    let p = write(dir.path(), "one.npz", &npz(&[("arr_0.npy", x)], true));
    assert_eq!(
        read_array(DataFormat::Npz, &DataRef::file(&p))
            .unwrap()
            .shape(),
        [3, 2]
    );
}

#[test]
fn safetensors_reads_named_tensors_of_each_dtype() {
    use safetensors::Dtype;
    let dir = tempfile::tempdir().unwrap();
    let p = write(
        dir.path(),
        "d.safetensors",
        &safetensors(&[
            (
                "images",
                Dtype::U8,
                vec![2, 2, 2],
                vec![0, 51, 102, 153, 204, 255, 0, 0],
            ),
            ("labels", Dtype::I64, vec![2], i64_le(&[1, 0])),
            (
                "half",
                Dtype::F16,
                vec![2],
                [0x3C00u16, 0x4000]
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
            ),
            (
                "brain",
                Dtype::BF16,
                vec![2],
                [0x3F80u16, 0xC000]
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
            ),
            (
                "targets",
                Dtype::F32,
                vec![2, 3],
                f32_le(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
            ),
        ]),
    );
    let mut spec = data_spec(
        DataFormat::Safetensors,
        DataRef::member(&p, "images"),
        DataRef::member(&p, "labels"),
    );
    spec.scale = Some(1.0 / 255.0);
    let d = load_split(&spec, Split::Train, Loss::cross_entropy())
        .unwrap()
        .unwrap();
    assert_eq!(d.sample_shape, [2, 2]);
    let want = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 0.0, 0.0];
    assert!(
        inputs_of(&d)
            .iter()
            .zip(want)
            .all(|(a, b)| (a - b).abs() < 1e-6),
        "{:?}",
        inputs_of(&d)
    );
    assert_eq!(*labels_of(&d), Labels::Classes(vec![1, 0]));
    let a = read_array(DataFormat::Safetensors, &DataRef::member(&p, "half")).unwrap();
    assert_eq!((a.elem(), a.to_f32()), (ElemType::F16, vec![1.0, 2.0]));
    let a = read_array(DataFormat::Safetensors, &DataRef::member(&p, "brain")).unwrap();
    assert_eq!((a.elem(), a.to_f32()), (ElemType::Bf16, vec![1.0, -2.0]));
    spec.train_labels = Some(DataRef::member(&p, "targets"));
    let d = load_split(&spec, Split::Train, Loss::Mse).unwrap().unwrap();
    assert_eq!(
        (labels_of(&d).clone(), d.label_shape.clone()),
        (Labels::Targets(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), vec![3])
    );
    let e = read_array(DataFormat::Safetensors, &DataRef::file(&p))
        .unwrap_err()
        .to_string();
    assert!(e.contains("holds 5 tensors") && e.contains("images"), "{e}");
    let e = read_array(DataFormat::Safetensors, &DataRef::member(&p, "nope"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("no tensor `nope`"), "{e}");
}

#[test]
fn csv_reads_rows_with_or_without_a_header() {
    let dir = tempfile::tempdir().unwrap();
    let with = write(dir.path(), "x.csv", b"a, b ,\"c\"\n1,2,3\n\n4.5,-5,6e1\n");
    let without = write(dir.path(), "x2.csv", b"1,2,3\r\n4.5,-5,6e1\r\n");
    let labels = write(dir.path(), "y.csv", b"label\n3\n1\n");
    for x in [with, without] {
        let spec = data_spec(DataFormat::Csv, DataRef::file(&x), DataRef::file(&labels));
        let d = load_split(&spec, Split::Train, Loss::cross_entropy())
            .unwrap()
            .unwrap();
        assert_eq!(d.sample_shape, [3]);
        assert_eq!(inputs_of(&d), [1.0, 2.0, 3.0, 4.5, -5.0, 60.0]);
        assert_eq!(*labels_of(&d), Labels::Classes(vec![3, 1]));
    }
    let gzipped = write(dir.path(), "g.csv", &gz(b"1,2\n3,4\n"));
    assert_eq!(
        read_array(DataFormat::Csv, &DataRef::file(&gzipped))
            .unwrap()
            .to_f32(),
        [1.0, 2.0, 3.0, 4.0]
    );
}

#[test]
fn labels_follow_the_loss() {
    let dir = tempfile::tempdir().unwrap();
    let x = write(
        dir.path(),
        "x.npy",
        &npy("<f4", "(3, 1)", &f32_le(&[0.0, 1.0, 2.0])),
    );
    let integral = write(
        dir.path(),
        "yf.npy",
        &npy("<f4", "(3, 1)", &f32_le(&[2.0, 0.0, 1.0])),
    );
    let fractional = write(
        dir.path(),
        "yh.npy",
        &npy(
            "<f8",
            "(3,)",
            &[0.0f64, 1.0, 2.5]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<_>>(),
        ),
    );
    let wide = write(
        dir.path(),
        "yw.npy",
        &npy("<f4", "(3, 2)", &f32_le(&[0.0; 6])),
    );
    let short = write(dir.path(), "ys.npy", &npy("<i8", "(2,)", &i64_le(&[0, 1])));

    let spec = |y: &Path| data_spec(DataFormat::Npy, DataRef::file(&x), DataRef::file(y));
    let d = load_split(&spec(&integral), Split::Train, Loss::cross_entropy())
        .unwrap()
        .unwrap();
    assert_eq!(
        *labels_of(&d),
        Labels::Classes(vec![2, 0, 1]),
        "integral floats are classes"
    );
    let d = load_split(&spec(&integral), Split::Train, Loss::Mse)
        .unwrap()
        .unwrap();
    assert_eq!(
        (labels_of(&d).clone(), d.label_shape.clone()),
        (Labels::Targets(vec![2.0, 0.0, 1.0]), vec![1])
    );

    let e = load_split(&spec(&fractional), Split::Train, Loss::cross_entropy())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("yh.npy") && e.contains("2.5") && e.contains("index 2"),
        "{e}"
    );
    // Any per-sample label shape loads; validation fits it to the model.
    let d = load_split(&spec(&wide), Split::Train, Loss::cross_entropy())
        .unwrap()
        .unwrap();
    assert_eq!((d.len(), d.label_shape), (3, vec![2]));
    let e = load_split(&spec(&short), Split::Train, Loss::cross_entropy())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("x.npy")
            && e.contains("ys.npy")
            && e.contains("has 3 samples")
            && e.contains("has 2"),
        "{e}"
    );
}

#[test]
fn inputs_are_scaled_then_normalised() {
    let dir = tempfile::tempdir().unwrap();
    let x = write(
        dir.path(),
        "x.npy",
        &npy("|u1", "(2, 2)", &[0, 255, 51, 102]),
    );
    let y = write(dir.path(), "y.npy", &npy("|u1", "(2,)", &[0, 1]));
    let mut spec = data_spec(DataFormat::Npy, DataRef::file(x), DataRef::file(y));
    spec.scale = Some(1.0 / 255.0);
    spec.mean = Some(0.5);
    spec.std = Some(0.25);
    let d = load_split(&spec, Split::Train, Loss::cross_entropy())
        .unwrap()
        .unwrap();
    let want: Vec<f32> = [0.0f32, 255.0, 51.0, 102.0]
        .iter()
        .map(|v| (v * (1.0 / 255.0f64) as f32 - 0.5) / 0.25)
        .collect();
    assert_eq!(inputs_of(&d), want);
}

#[test]
fn gather_takes_samples_in_the_given_order() {
    let d = arrays(
        vec![2],
        vec![0.0, 0.5, 1.0, 1.5, 2.0, 2.5],
        Labels::Targets(vec![10.0, 11.0, 12.0]),
        vec![1],
    );
    assert_eq!((d.len(), d.is_empty(), d.sample_numel()), (3, false, 2));
    assert_eq!(d.gather_inputs(&[2, 0, 2]), [2.0, 2.5, 0.0, 0.5, 2.0, 2.5]);
    assert_eq!(d.gather_input_ids(&[2, 1]), [2, 2, 1, 1]);
    assert_eq!(d.gather_labels(&[1, 2]), Labels::Targets(vec![11.0, 12.0]));
    assert_eq!(d.targets(&[1, 2], Loss::Mse), 2);
    let c = arrays(
        vec![2],
        d.gather_inputs(&[0, 1, 2]),
        Labels::Classes(vec![4, 5, 6]),
        vec![],
    );
    assert_eq!(c.gather_labels(&[2, 1]), Labels::Classes(vec![6, 5]));
}

#[test]
fn per_token_labels_gather_whole_samples_and_count_what_is_not_ignored() {
    let d = arrays(
        vec![3],
        (0..9).map(|v| v as f32).collect(),
        Labels::Classes(vec![1, 2, 3, -100, 5, 6, 7, -100, -100]),
        vec![3],
    );
    assert_eq!(d.len(), 3);
    let gathered = d.gather_labels(&[2, 0]);
    assert_eq!(gathered, Labels::Classes(vec![7, -100, -100, 1, 2, 3]));
    let ce = Loss::cross_entropy();
    assert_eq!(gathered.targets(ce, 2), 4);
    assert_eq!(d.targets(&[2, 0], ce), 4);
    assert_eq!(d.targets(&[0, 1, 2], ce), 6);
    let keep_all = Loss::CrossEntropy {
        class_axis: ClassAxis::Last,
        ignore_index: -1,
    };
    assert_eq!(d.targets(&[0, 1, 2], keep_all), 9);
}

fn graph(spec: &str) -> Graph {
    rookery_model::from_toml(spec).unwrap()
}

const CLASSIFIER: &str = "input_shape = [4]\n[[layers]]\ntype = \"Dense\"\nunits = 3\n";
const REGRESSOR: &str = "input_shape = [4]\n[[layers]]\ntype = \"Dense\"\nunits = 2\n";

fn dataset(sample_shape: Vec<usize>, labels: Labels, label_shape: Vec<usize>) -> Dataset {
    let n = labels.numel() / label_shape.iter().product::<usize>();
    let inputs = vec![0.0; n * sample_shape.iter().product::<usize>()];
    arrays(sample_shape, inputs, labels, label_shape)
}

fn arrays(
    sample_shape: Vec<usize>,
    inputs: Vec<f32>,
    labels: Labels,
    label_shape: Vec<usize>,
) -> Dataset {
    Dataset {
        sample_shape,
        label_shape,
        samples: Samples::Arrays { inputs, labels },
    }
}

fn inputs_of(d: &Dataset) -> &[f32] {
    match &d.samples {
        Samples::Arrays { inputs, .. } => inputs,
        Samples::Tokens(_) => panic!("token windows, not arrays"),
    }
}

fn labels_of(d: &Dataset) -> &Labels {
    match &d.samples {
        Samples::Arrays { labels, .. } => labels,
        Samples::Tokens(_) => panic!("token windows, not arrays"),
    }
}

#[test]
fn validation_reshapes_to_the_input_shape_and_checks_labels_against_the_output() {
    let ce = graph(CLASSIFIER);
    let mut d = dataset(vec![2, 2], Labels::Classes(vec![0, 2, 1]), vec![]);
    validate_against_model(&ce, &[4], &mut d, Loss::cross_entropy()).unwrap();
    assert_eq!(d.sample_shape, [4]);
    // A column of classes is one class per sample.
    let mut d = dataset(vec![4], Labels::Classes(vec![0, 2, 1]), vec![1]);
    validate_against_model(&ce, &[4], &mut d, Loss::cross_entropy()).unwrap();
    assert_eq!((d.len(), d.label_shape.clone()), (3, vec![]));

    let mut d = dataset(vec![5], Labels::Classes(vec![0]), vec![]);
    let e = validate_against_model(&ce, &[4], &mut d, Loss::cross_entropy())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("[5]") && e.contains("model.input_shape") && e.contains("[4]"),
        "{e}"
    );

    for (labels, bad, index) in [
        (vec![0, 1, 3, -100], "label 3", "sample 2"),
        (vec![-1, 0], "label -1", "sample 0"),
    ] {
        let mut d = dataset(vec![4], Labels::Classes(labels), vec![]);
        let e = validate_against_model(&ce, &[4], &mut d, Loss::cross_entropy())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(bad) && e.contains(index) && e.contains("0..=2") && e.contains("-100"),
            "{e}"
        );
    }

    let mse = graph(REGRESSOR);
    let mut d = dataset(vec![4], Labels::Targets(vec![0.0; 4]), vec![1, 2]);
    validate_against_model(&mse, &[4], &mut d, Loss::Mse).unwrap();
    assert_eq!(d.label_shape, [2]);
    let mut d = dataset(vec![4], Labels::Targets(vec![0.0; 6]), vec![3]);
    let e = validate_against_model(&mse, &[4], &mut d, Loss::Mse)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("mse") && e.contains("[2]") && e.contains("[3]"),
        "{e}"
    );
    let mut d = dataset(vec![4], Labels::Classes(vec![0]), vec![]);
    assert!(validate_against_model(&mse, &[4], &mut d, Loss::Mse).is_err());
    // A conv's [batch, 2, 4, 4] output takes [4, 4] labels per sample, not one.
    let conv = graph(
        "input_shape = [1, 4, 4]\n[[layers]]\ntype = \"Conv2D\"\nfilters = 2\nkernel_size = 1\n",
    );
    let mut d = dataset(vec![16], Labels::Classes(vec![0]), vec![]);
    let e = validate_against_model(&conv, &[1, 4, 4], &mut d, Loss::cross_entropy())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("[1, 2, 4, 4]") && e.contains("needs [4, 4]") && e.contains("have shape []"),
        "{e}"
    );
    let mut d = dataset(vec![16], Labels::Classes(vec![1; 16]), vec![4, 4]);
    validate_against_model(&conv, &[1, 4, 4], &mut d, Loss::cross_entropy()).unwrap();
}

/// A language model's logits: `[batch, 5, 7]`, read as `[N, V = 5, T = 7]`
/// (classes second) or `[N, T = 5, V = 7]` (classes last).
fn lm_logits() -> Graph {
    graph("input_shape = [5, 3]\n[[layers]]\ntype = \"Dense\"\nunits = 7\n")
}

#[test]
fn per_token_labels_fit_either_class_axis_and_say_which_when_they_do_not() {
    let lm = lm_logits();
    assert_eq!(
        lm.analyze().unwrap().shape(&lm.outputs[0]).unwrap(),
        [1, 5, 7]
    );
    let last = Loss::CrossEntropy {
        class_axis: ClassAxis::Last,
        ignore_index: -100,
    };
    // Classes last: [N, T = 5, V = 7], labels [5] per sample in 0..7.
    let tokens = vec![0, 6, -100, 3, 2, 1, 1, 1, 1, -100];
    let mut d = dataset(vec![15], Labels::Classes(tokens.clone()), vec![5]);
    validate_against_model(&lm, &[5, 3], &mut d, last).unwrap();
    assert_eq!((d.len(), d.label_shape.clone()), (2, vec![5]));
    // The same labels with classes second ([N, V = 5, T = 7]) need [7]: the
    // error says what fits.
    let mut d = dataset(vec![15], Labels::Classes(tokens.clone()), vec![5]);
    let e = validate_against_model(&lm, &[5, 3], &mut d, Loss::cross_entropy()).unwrap_err();
    assert!(matches!(e, JobError::Labels(_)), "{e:?}");
    let e = e.to_string();
    assert!(
        e.contains("have shape [5]") && e.contains("needs [7]") && e.contains("class_axis = -1"),
        "{e}"
    );
    // Classes second with [7] labels in 0..5: 6 is out of range.
    let mut d = dataset(
        vec![15],
        Labels::Classes(vec![0, 1, 2, 3, 4, -100, 6]),
        vec![7],
    );
    let e = validate_against_model(&lm, &[5, 3], &mut d, Loss::cross_entropy())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("label 6 at sample 0, position 6") && e.contains("0..=4"),
        "{e}"
    );
    // A label equal to another ignore_index is a class like any other.
    let other = Loss::CrossEntropy {
        class_axis: ClassAxis::Last,
        ignore_index: -1,
    };
    let mut d = dataset(vec![15], Labels::Classes(tokens), vec![5]);
    let e = validate_against_model(&lm, &[5, 3], &mut d, other)
        .unwrap_err()
        .to_string();
    assert!(e.contains("label -100 at sample 0, position 2"), "{e}");
}

/// `(file name, format, bytes, words the error must contain)`.
fn corrupt_cases() -> Vec<(&'static str, DataFormat, Vec<u8>, &'static str)> {
    use DataFormat::*;
    let good_npy = npy("<f4", "(2, 2)", &f32_le(&[1.0; 4]));
    let mut long = good_npy.clone();
    long.extend([0, 0, 0, 0]);
    let mut npy_v2_huge_header = b"\x93NUMPY\x02\x00".to_vec();
    npy_v2_huge_header.extend(u32::MAX.to_le_bytes());
    let mut st_huge = (u64::MAX).to_le_bytes().to_vec();
    st_huge.extend(b"{}");
    let st_header = |h: &str| {
        let mut b = (h.len() as u64).to_le_bytes().to_vec();
        b.extend(h.as_bytes());
        b.extend([0u8; 8]);
        b
    };
    vec![
        ("empty.idx", Idx, vec![], "truncated"),
        ("magic.idx", Idx, vec![1, 0, 8, 1, 0, 0, 0, 1, 0], "not an IDX file"),
        ("type.idx", Idx, idx(0x07, &[1], &[0]), "element type 0x07"),
        ("nodims.idx", Idx, idx(0x08, &[], &[]), "no dimensions"),
        ("dims.idx", Idx, vec![0, 0, 8, 3, 0, 0, 0, 2], "truncated"),
        ("short.idx", Idx, idx(0x08, &[2, 3], &[0; 5]), "truncated"),
        ("long.idx", Idx, idx(0x08, &[2, 3], &[0; 7]), "unexpected bytes"),
        ("huge.idx", Idx, idx(0x08, &[u32::MAX, u32::MAX], &[0; 3]), "truncated"),
        ("overflow.idx", Idx, idx(0x0E, &[u32::MAX, u32::MAX, u32::MAX], &[0; 3]), "too large"),
        ("huge-gz.idx", Idx, gz(&idx(0x0D, &[1 << 30, 4], &[0; 64])), "more than the 4 GiB"),
        ("huge-plain.idx", Idx, idx(0x0D, &[1 << 30, 4], &[0; 64]), "truncated"),
        ("long-gz.idx", Idx, gz(&idx(0x08, &[1], &[0; 9])), "unexpected bytes"),
        ("cut-gz.idx", Idx, gz(&idx(0x08, &[4], &[0; 4]))[..12].to_vec(), "cut-gz.idx"),
        ("empty.npy", Npy, vec![], "truncated"),
        ("magic.npy", Npy, b"\x93NUMPX\x01\x00\x00\x00".to_vec(), "not a .npy file"),
        ("version.npy", Npy, npy_v(4, "<f4", false, "(1,)", &[0; 4]), "version 4.0"),
        ("hugeheader.npy", Npy, npy_v2_huge_header, "header claims"),
        ("dict.npy", Npy, npy("<f4", "(1,", &[0; 4]), ".npy header"),
        ("complex.npy", Npy, npy("<c8", "(1,)", &[0; 8]), "unsupported dtype '<c8'"),
        ("object.npy", Npy, npy("|O", "(1,)", &[0; 8]), "unsupported dtype"),
        ("order.npy", Npy, npy("|f4", "(1,)", &[0; 4]), "unsupported dtype '|f4'"),
        ("structured.npy", Npy, b"\x93NUMPY\x01\x00\x3c\x00{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (1,), }  \n\0\0\0\0".to_vec(), "structured"),
        ("fortran.npy", Npy, npy_v(1, "<f4", true, "(2, 2)", &[0; 16]), "Fortran order"),
        ("hugeshape.npy", Npy, npy("<f4", "(1000000000000,)", &[0; 4]), "truncated"),
        ("overflow.npy", Npy, npy("<f4", "(10000000000, 10000000000, 10000000000)", &[0; 4]), "too large"),
        ("bigdim.npy", Npy, npy("<f4", "(99999999999999999999999,)", &[0; 4]), "too large"),
        ("noshape.npy", Npy, b"\x93NUMPY\x01\x00\x30\x00{'descr': '<f4', 'fortran_order': False}           \n".to_vec(), "missing 'shape'"),
        ("short.npy", Npy, good_npy[..good_npy.len() - 1].to_vec(), "truncated"),
        ("long.npy", Npy, long, "unexpected bytes"),
        ("notzip.npz", Npz, good_npy.clone(), "not a valid .npz"),
        ("notnpy.npz", Npz, npz(&[("a.npy", b"hello, not numpy".to_vec())], false), "not a .npy file"),
        ("cut.npz", Npz, { let z = npz(&[("a.npy", good_npy.clone())], false); z[..z.len() - 10].to_vec() }, "cut.npz"),
        ("short.safetensors", Safetensors, vec![1, 0], "safetensors"),
        ("huge.safetensors", Safetensors, st_huge, "header claims"),
        ("json.safetensors", Safetensors, st_header("{not json"), "header"),
        ("offsets.safetensors", Safetensors, st_header(r#"{"a":{"dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,18446744073709551615]}}"#), "outside"),
        ("size.safetensors", Safetensors, st_header(r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,8]}}"#), "safetensors"),
        ("dtype.safetensors", Safetensors, st_header(r#"{"a":{"dtype":"Q9","shape":[8],"data_offsets":[0,8]}}"#), "safetensors"),
        ("word.csv", Csv, b"1,2\n3,x\n".to_vec(), "line 2, column 2: `x`"),
        ("ragged.csv", Csv, b"1,2\n3\n".to_vec(), "line 2: 1 values, expected 2"),
        ("blank.csv", Csv, b"\n\n".to_vec(), "no data rows"),
        ("header-only.csv", Csv, b"a,b\n".to_vec(), "no data rows"),
        ("binary.csv", Csv, vec![0xff, 0xfe, b'1'], "not UTF-8"),
    ]
}

#[test]
fn corrupt_truncated_and_oversized_files_are_errors_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    for (name, format, bytes, words) in corrupt_cases() {
        let p = write(dir.path(), name, &bytes);
        let r = DataRef::file(&p);
        let e = match read_array(format, &r) {
            Ok(a) => panic!("{name}: read {:?}", a.shape()),
            Err(e) => e,
        };
        assert!(matches!(e, JobError::File { .. }), "{name}: {e:?}");
        let e = e.to_string();
        assert!(e.contains(name), "{name}: file not named: {e}");
        assert!(e.contains(words), "{name}: `{words}` not in: {e}");
    }
}

/// Small valid files of each format, with the array to read.
fn valid_files() -> Vec<(&'static str, DataFormat, Vec<u8>, Option<&'static str>)> {
    use DataFormat::*;
    let x = npy("<f4", "(3, 2)", &f32_le(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]));
    vec![
        (
            "v.idx",
            Idx,
            idx(0x08, &[3, 2, 2], &(0..12).collect::<Vec<u8>>()),
            None,
        ),
        (
            "vgz.idx",
            Idx,
            gz(&idx(0x0C, &[3], &[0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 3])),
            None,
        ),
        ("v.npy", Npy, x.clone(), None),
        (
            "v3.npy",
            Npy,
            npy_v(3, "<i8", false, "(3,)", &i64_le(&[1, 2, 3])),
            None,
        ),
        (
            "s.npz",
            Npz,
            npz(&[("x.npy", x.clone()), ("y.npy", x.clone())], false),
            Some("y"),
        ),
        ("d.npz", Npz, npz(&[("x.npy", x)], true), Some("x")),
        (
            "v.safetensors",
            Safetensors,
            safetensors(&[
                ("x", safetensors::Dtype::F32, vec![3, 2], f32_le(&[0.0; 6])),
                ("y", safetensors::Dtype::I64, vec![3], i64_le(&[0, 1, 2])),
            ]),
            Some("y"),
        ),
        ("v.csv", Csv, b"a,b\n1,2\n3,4\n".to_vec(), None),
    ]
}

fn read_bytes(
    dir: &Path,
    name: &str,
    format: DataFormat,
    member: Option<&str>,
    bytes: &[u8],
) -> Result<(), String> {
    let p = write(dir, name, bytes);
    let r = DataRef {
        path: p,
        member: member.map(str::to_string),
    };
    match read_array(format, &r) {
        Ok(_) => Ok(()),
        Err(e) => {
            let e = e.to_string();
            assert!(e.contains(name), "file not named: {e}");
            Err(e)
        }
    }
}

#[test]
fn valid_files_read_and_every_strict_prefix_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    for (name, format, bytes, member) in valid_files() {
        read_bytes(dir.path(), name, format, member, &bytes).unwrap();
        if format == DataFormat::Csv {
            continue; // a prefix of a CSV file can be a valid CSV file
        }
        for cut in 0..bytes.len() {
            assert!(
                read_bytes(dir.path(), name, format, member, &bytes[..cut]).is_err(),
                "{name} cut at {cut} of {} read",
                bytes.len()
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Random bytes under every format's name: an error or a read, never a panic.
    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..600), prefix in 0usize..4) {
        let dir = tempfile::tempdir().unwrap();
        // Optionally start like the real thing, to get past the magic bytes.
        let starts: [&[u8]; 4] = [b"", b"\x00\x00\x08\x02", b"\x93NUMPY\x01\x00", b"PK\x03\x04"];
        let mut b = starts[prefix].to_vec();
        b.extend(&bytes);
        for (name, format, member) in [
            ("r.idx", DataFormat::Idx, None),
            ("r.npy", DataFormat::Npy, None),
            ("r.npz", DataFormat::Npz, None),
            ("m.npz", DataFormat::Npz, Some("x")),
            ("r.safetensors", DataFormat::Safetensors, None),
            ("r.csv", DataFormat::Csv, None),
        ] {
            let _ = read_bytes(dir.path(), name, format, member, &b);
            let _ = read_bytes(dir.path(), name, format, member, &gz(&b));
        }
    }

    /// Valid files with a few bytes changed: an error or a read, never a panic.
    #[test]
    fn corrupted_valid_files_never_panic(
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        for (name, format, mut bytes, member) in valid_files() {
            for (i, v) in &flips {
                let i = i.index(bytes.len());
                bytes[i] = *v;
            }
            if truncate {
                bytes.truncate(cut.index(bytes.len()));
            }
            let _ = read_bytes(dir.path(), name, format, member, &bytes);
        }
    }
}
