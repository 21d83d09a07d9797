//! `rookery generate`: samples text from a trained language model on this
//! machine, forward only (RavDL's `predict()`), through the same executors
//! the providers train with ([`rookery_stage::Predictor`] over our kernels'
//! CPU references, or over libtorch with feature `torch`; its weights are
//! read as `rookery predict` reads them).
//!
//! The model reads `[1, T]` token ids, `T` its context, and gives logits
//! `[1, T, V]` or `[1, V, T]`. Each new token comes from the last `T` ids,
//! right-padded with id 0: causal attention never looks right, so the
//! logits at the last real position are those of the unpadded sequence.

mod vocab;

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rookery_model::Graph;
use rookery_proto::tensor::WireTensor;
use rookery_stage::{BackendFactory, CpuDevice, OwnFactory, Predictor};

pub use vocab::{Vocab, VocabError};

/// Where the model runs.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum GenerateBackend {
    /// Rookery's kernels (their CPU references).
    Cpu,
    /// libtorch on the CPU (a `rookery` built with feature `torch`).
    Torch,
}

#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    /// The model: an ONNX export of a language model (token ids in, logits out).
    #[arg(long)]
    pub model: PathBuf,
    /// Its trained weights (safetensors, `state_dict` names: what `rookery
    /// train` and `rookery download` write).
    #[arg(long)]
    pub weights: PathBuf,
    /// Text to continue.
    #[arg(long)]
    pub prompt: String,
    /// A tokenizers JSON file (byte-level BPE) or a JSON list of strings
    /// (id -> text). Default: `tokenizer.json` or `data/tokenizer.json`
    /// beside the model.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Tokens to sample.
    #[arg(long, default_value_t = 100)]
    pub tokens: usize,
    /// Softmax temperature; 0 picks the most likely token (greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Seed of the sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The model's context length, where the export leaves it dynamic.
    #[arg(long)]
    pub context: Option<usize>,
    /// libtorch where this `rookery` was built with it (far faster), else
    /// Rookery's kernels.
    #[arg(long, value_enum, default_value = DEFAULT_BACKEND)]
    pub backend: GenerateBackend,
}

const DEFAULT_BACKEND: &str = if cfg!(feature = "torch") {
    "torch"
} else {
    "cpu"
};

/// `rookery generate`: prints the prompt and its continuation.
pub async fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let tokenizer = match &args.tokenizer {
        Some(path) => path.clone(),
        None => default_tokenizer(&args.model)?,
    };
    let vocab = Vocab::load(&tokenizer)?;
    // Each token is printed as it comes: on Rookery's CPU kernels a token
    // of a 10M-parameter model takes seconds.
    let mut out = std::io::stdout();
    write!(out, "{}", args.prompt)?;
    out.flush()?;
    generate_with(&args, &vocab, &mut |piece| {
        // A closed stdout (`| head`) must not stop the sampling with a panic.
        let _ = write!(out, "{piece}").and_then(|()| out.flush());
    })
    .await?;
    writeln!(out)?;
    Ok(())
}

fn default_tokenizer(model: &Path) -> anyhow::Result<PathBuf> {
    let dir = model.parent().unwrap_or(Path::new("."));
    ["tokenizer.json", "data/tokenizer.json"]
        .iter()
        .map(|p| dir.join(p))
        .find(|p| p.is_file())
        .with_context(|| {
            format!(
                "no tokenizer.json beside {}; name one with --tokenizer",
                model.display()
            )
        })
}

/// Samples `args.tokens` tokens after `args.prompt` and returns their text.
pub async fn generate(args: &GenerateArgs, vocab: &Vocab) -> anyhow::Result<String> {
    generate_with(args, vocab, &mut |_| ()).await
}

/// [`generate`], handing `text` each new piece of the continuation as soon
/// as its tokens decode to whole characters.
pub async fn generate_with(
    args: &GenerateArgs,
    vocab: &Vocab,
    text: &mut dyn FnMut(&str),
) -> anyhow::Result<String> {
    let context = match args.context {
        Some(t) => t,
        None => declared_context(&args.model)?,
    };
    if context == 0 {
        bail!("--context must be at least 1");
    }
    let model = rookery_model::load::load_model_file(&args.model, Some(&[context]), 1)?;
    let graph = model.graph;
    let params = super::predict::parameters(&graph, Some(&args.weights))?;
    let mut prompt = vocab.encode(&args.prompt)?;
    if prompt.is_empty() {
        bail!("the prompt encodes to no tokens; give some text");
    }
    let sampler = Sampler {
        vocab: vocab.len(),
        context,
        temperature: args.temperature,
        rng: ChaCha8Rng::seed_from_u64(args.seed),
    };
    let prompt_len = prompt.len();
    let mut shown = String::new();
    let mut on_token = |ids: &[u32]| {
        let now = vocab.decode(&ids[prompt_len..]);
        // A byte-level token can end inside a character; wait for the rest.
        if let Some(piece) = now.strip_prefix(shown.as_str())
            && !now.ends_with(char::REPLACEMENT_CHARACTER)
        {
            text(piece);
            shown = now;
        }
    };
    let mut job = Sampling {
        graph: &graph,
        params: &params,
        ids: &mut prompt,
        count: args.tokens,
        on_token: &mut on_token,
    };
    match args.backend {
        GenerateBackend::Cpu => {
            sampler
                .run(&mut OwnFactory::new(CpuDevice), &mut job)
                .await?
        }
        GenerateBackend::Torch => {
            #[cfg(feature = "torch")]
            sampler
                .run(&mut rookery_torch::TorchStageFactory::cpu(), &mut job)
                .await?;
            #[cfg(not(feature = "torch"))]
            bail!("this rookery was built without libtorch (build it with feature `torch`)");
        }
    }
    let all = vocab.decode(&prompt[prompt_len..]);
    if let Some(rest) = all.strip_prefix(shown.as_str()) {
        text(rest);
    }
    Ok(all)
}

/// The sequence length the export fixed for its first input.
fn declared_context(model: &Path) -> anyhow::Result<usize> {
    let dims = rookery_model::onnx::declared_input_dims(model)?;
    match dims.as_deref() {
        Some([_, Some(t)]) => Ok(*t as usize),
        Some([_, None]) => bail!(
            "{} leaves the sequence length dynamic; give the model's context with --context",
            model.display()
        ),
        other => bail!(
            "{}: the first input should be token ids [batch, sequence], it declares {other:?}",
            model.display()
        ),
    }
}

/// What one sampling run reads and extends.
struct Sampling<'a> {
    graph: &'a Graph,
    params: &'a [WireTensor],
    /// The prompt's ids, then each sampled one.
    ids: &'a mut Vec<u32>,
    count: usize,
    on_token: &'a mut dyn FnMut(&[u32]),
}

struct Sampler {
    vocab: usize,
    context: usize,
    temperature: f64,
    rng: ChaCha8Rng,
}

impl Sampler {
    async fn run<F: BackendFactory>(
        mut self,
        factory: &mut F,
        job: &mut Sampling<'_>,
    ) -> anyhow::Result<()> {
        let mut predictor = Predictor::new(factory, job.graph, job.params)?;
        for _ in 0..job.count {
            let ids = &mut *job.ids;
            let window = &ids[ids.len().saturating_sub(self.context)..];
            let mut tokens: Vec<i64> = window.iter().map(|&i| i64::from(i)).collect();
            let last = tokens.len() - 1;
            tokens.resize(self.context, 0);
            let input = WireTensor::from_i64("tokens", &[1, self.context], &tokens);
            let logits = predictor.predict(&input).await?;
            let row = self.logits_at(&logits, last)?;
            ids.push(self.pick(&row) as u32);
            (job.on_token)(ids);
        }
        Ok(())
    }

    /// The logits of position `t`, from `[1, T, V]` or `[1, V, T]`.
    fn logits_at(&self, logits: &WireTensor, t: usize) -> anyhow::Result<Vec<f32>> {
        let (v, ctx) = (self.vocab, self.context);
        let values = logits.to_f32()?;
        let shape = logits.shape_usize();
        match shape.as_slice() {
            [1, a, b] if *a == ctx && *b == v && (a != b) => {
                Ok(values[t * v..(t + 1) * v].to_vec())
            }
            [1, a, b] if *a == v && *b == ctx && (a != b) => {
                Ok((0..v).map(|c| values[c * ctx + t]).collect())
            }
            _ => bail!(
                "the model's output {shape:?} is neither [1, {ctx}, {v}] nor [1, {v}, {ctx}] \
                 (context {ctx}, the tokenizer's {v} ids)"
            ),
        }
    }

    fn pick(&mut self, logits: &[f32]) -> usize {
        let argmax = || {
            logits
                .iter()
                .enumerate()
                .fold((0, f32::NEG_INFINITY), |best, (i, &x)| {
                    if x > best.1 { (i, x) } else { best }
                })
                .0
        };
        if self.temperature <= 0.0 {
            return argmax();
        }
        let max = f64::from(logits[argmax()]);
        let weights: Vec<f64> = logits
            .iter()
            .map(|&x| ((f64::from(x) - max) / self.temperature).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        let mut u = self.rng.random::<f64>() * total;
        for (i, w) in weights.iter().enumerate() {
            u -= w;
            if u < 0.0 {
                return i;
            }
        }
        weights.len() - 1
    }
}
