//! The documented example job file, and a folder that holds (empty) files
//! under every name the jobs in these tests mention.
#![allow(dead_code, clippy::unwrap_used)]

pub const EXAMPLE: &str = r#"
[model]
onnx = "cnn.onnx"            # or: spec = "model.toml"  (exactly one of the two)
input_shape = [1, 28, 28]    # one sample
[data]
format = "idx"               # idx | npy | npz | safetensors | csv
train_inputs = "train-images-idx3-ubyte.gz"
train_labels = "train-labels-idx1-ubyte.gz"
test_inputs  = "t10k-images-idx3-ubyte.gz"   # test_* optional
test_labels  = "t10k-labels-idx1-ubyte.gz"
scale = 0.00392156862745098  # optional: x*scale, then optional mean/std normalise: (x-mean)/std
mean = 0.1307                # optional
std = 0.3081                 # optional
[training]
epochs = 2
batch_size = 64              # per cluster per step
micro_batches = 4
loss = "cross_entropy"       # cross_entropy | mse
optimizer = { name = "adam", lr = 0.001 }
clusters = "auto"            # or a number
sync_every = 1
shuffle = true
seed = 42
wire_dtype = "f32"           # f32 | f16 | bf16
"#;

const FILES: [&str; 9] = [
    "cnn.onnx",
    "model.toml",
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
    "x.npy",
    "y.npy",
    "data.npz",
];

/// A folder holding (empty) files under every name the jobs here mention.
pub fn base() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in FILES {
        std::fs::write(dir.path().join(f), b"").unwrap();
    }
    dir
}

pub fn example_with(replace: &str, with: &str) -> String {
    assert!(EXAMPLE.contains(replace), "{replace}");
    EXAMPLE.replacen(replace, with, 1)
}
