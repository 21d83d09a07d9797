//! The example GPT (examples/gpt) for benchmarks: exported with PyTorch as
//! README tells users to, the tokens its steps read, and its job files.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::Context;
use rookery_test_support::workspace_root;

/// A GPT's shape, and the batch and steps a benchmark trains it for.
#[derive(Debug, Clone, Copy)]
pub struct GptSize {
    pub name: &'static str,
    pub layers: u32,
    pub d_model: u32,
    pub heads: u32,
    pub vocab: u32,
    pub context: u32,
    pub batch: u32,
    pub steps: u32,
}

/// examples/gpt's model (about 14M parameters) on its Shakespeare tokens.
pub const EXAMPLE: GptSize = GptSize {
    name: "example",
    layers: 6,
    d_model: 384,
    heads: 6,
    vocab: 4096,
    context: 128,
    batch: 16,
    steps: 12,
};

/// GPT-2 small's shape (124M parameters) on random tokens.
pub const GPT2_SMALL: GptSize = GptSize {
    name: "124m",
    layers: 12,
    d_model: 768,
    heads: 12,
    vocab: 50_257,
    context: 128,
    batch: 8,
    steps: 3,
};

impl GptSize {
    /// For people: `GPT example (6 layers, d 384, 6 heads, vocab 4096,
    /// context 128)`.
    pub fn describe(&self) -> String {
        format!(
            "GPT {} ({} layers, d {}, {} heads, vocab {}, context {})",
            self.name, self.layers, self.d_model, self.heads, self.vocab, self.context
        )
    }

    pub fn tokens_per_step(&self) -> f64 {
        f64::from(self.batch * self.context)
    }
}

/// The Python that exports models: `ROOKERY_PYTHON` (xtask sets it to the
/// cache's torch venv), else `python3`.
pub fn python() -> PathBuf {
    std::env::var_os("ROOKERY_PYTHON").map_or_else(|| PathBuf::from("python3"), PathBuf::from)
}

/// The model, exported as README tells users to (dynamo, dynamic batch),
/// without dropout, to `dir/gpt.onnx`.
pub fn export(dir: &Path, size: &GptSize) -> anyhow::Result<PathBuf> {
    let out = dir.join("gpt.onnx");
    let started = Instant::now();
    let status = Command::new(python())
        .arg(workspace_root().join("examples/gpt/export.py"))
        .args(["--out", &out.display().to_string()])
        .args(["--vocab", &size.vocab.to_string()])
        .args(["--context", &size.context.to_string()])
        .args(["--layers", &size.layers.to_string()])
        .args(["--d-model", &size.d_model.to_string()])
        .args(["--heads", &size.heads.to_string()])
        .args(["--dropout", "0"])
        .stdout(Stdio::inherit())
        .stderr(Stdio::null())
        .status()
        .context("running examples/gpt/export.py (set ROOKERY_PYTHON to a Python with torch)")?;
    anyhow::ensure!(status.success(), "export.py failed: {status}");
    println!("exported in {:.1} s", started.elapsed().as_secs_f64());
    Ok(out)
}

/// Exactly the tokens `steps` steps read: the start of the example's own
/// corpus, or (for the 124M model, whose vocabulary it does not use) seeded
/// random ids.
pub fn tokens_file(dir: &Path, size: &GptSize) -> anyhow::Result<PathBuf> {
    let needed = (size.steps * size.batch * size.context + 1) as usize;
    let path = dir.join("train.u16");
    if size.name == EXAMPLE.name {
        let corpus = workspace_root().join("examples/gpt/data/train.u16.gz");
        let out = Command::new("gzip")
            .arg("-dc")
            .arg(&corpus)
            .output()
            .with_context(|| format!("gzip -dc {}", corpus.display()))?;
        anyhow::ensure!(
            out.status.success() && out.stdout.len() >= needed * 2,
            "{} holds fewer than {needed} tokens",
            corpus.display()
        );
        std::fs::write(&path, &out.stdout[..needed * 2])?;
        return Ok(path);
    }
    let mut state = 0x9E37_79B9_7F4A_7C15_u64;
    let mut bytes = Vec::with_capacity(needed * 2);
    for _ in 0..needed {
        // xorshift64*: any fixed sequence of ids below the vocabulary will do.
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        let id = (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 32) % u64::from(size.vocab);
        bytes.extend_from_slice(&(id as u16).to_le_bytes());
    }
    std::fs::write(&path, bytes)?;
    Ok(path)
}

/// A job file at `path` that trains `size` on `tokens` for its steps: Adam,
/// 4 micro-batches, one cluster of `stages` stages, no shuffling, and
/// `settings` (more `[training]` lines, such as the schedule).
pub fn write_job(
    path: &Path,
    onnx: &Path,
    tokens: &Path,
    size: &GptSize,
    stages: usize,
    settings: &str,
) -> anyhow::Result<()> {
    let text = format!(
        "[model]\nonnx = \"{}\"\ninput_shape = [{ctx}]\n\
         [data]\nformat = \"tokens\"\ntrain_inputs = \"{}\"\nseq_len = {ctx}\n\
         [training]\nepochs = 1\nbatch_size = {}\nmicro_batches = 4\n\
         optimizer = {{ name = \"adam\", lr = 0.0003 }}\n\
         loss = {{ name = \"cross_entropy\", class_axis = -1 }}\n\
         clusters = 1\nstages = {stages}\nshuffle = false\nseed = 0\n{settings}\n",
        onnx.display(),
        tokens.display(),
        size.batch,
        ctx = size.context,
    );
    std::fs::write(path, text)?;
    Ok(())
}
