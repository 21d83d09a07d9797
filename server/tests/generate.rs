//! `rookery generate` on the toy GPTs of tests/fixtures/gpt-tiny, trained
//! to count (each token the previous plus one, modulo 48): greedy sampling
//! continues exactly as PyTorch's greedy loop did, for both exporters, both
//! attention spellings and both logit layouts, sliding past the context;
//! seeded sampling repeats itself.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use rookery_server::cli::generate::{GenerateArgs, GenerateBackend, Vocab, generate};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/gpt-tiny")
        .join(name)
}

fn args(model: &str, weights: &str, prompt: &str) -> GenerateArgs {
    GenerateArgs {
        model: fixture(model),
        weights: fixture(weights),
        prompt: prompt.into(),
        tokenizer: Some(fixture("vocab.json")),
        tokens: 20,
        temperature: 0.0,
        seed: 0,
        context: None,
        backend: GenerateBackend::Cpu,
    }
}

fn expected_greedy(attn: &str, vocab: &Vocab) -> String {
    let e: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("expected.json")).unwrap()).unwrap();
    let ids: Vec<u32> = e["greedy"][attn]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    vocab.decode(&ids)
}

#[tokio::test]
async fn greedy_generation_continues_as_pytorch_did_for_every_export() {
    let vocab = Vocab::load(&fixture("vocab.json")).unwrap();
    // Ids 5, 6, 7 in the character vocabulary; 20 more cross the context of 16.
    assert_eq!(vocab.encode("fgh").unwrap(), [5, 6, 7]);
    for exporter in ["dynamo", "legacy"] {
        for attn in ["hand", "mha"] {
            let want = expected_greedy(attn, &vocab);
            assert_eq!(want, "ijklmnopqrstuvwxyzAB", "the fixture counts");
            for layout in ["ntv", "nvt"] {
                let model = format!("{exporter}-{attn}-{layout}.onnx");
                let got = generate(&args(&model, &format!("{attn}.safetensors"), "fgh"), &vocab)
                    .await
                    .unwrap();
                assert_eq!(got, want, "{model}");
            }
        }
    }
}

#[tokio::test]
async fn seeded_sampling_repeats_for_a_seed_and_varies_across_seeds() {
    let vocab = Vocab::load(&fixture("vocab.json")).unwrap();
    let mut texts = Vec::new();
    for seed in [1, 1, 2, 3, 4] {
        let mut a = args("dynamo-hand-ntv.onnx", "hand.safetensors", "abc");
        // Hot enough that the counting model's second choices come up.
        a.temperature = 3.0;
        a.seed = seed;
        a.tokens = 12;
        texts.push(generate(&a, &vocab).await.unwrap());
    }
    assert_eq!(texts[0].chars().count(), 12);
    assert_eq!(texts[0], texts[1], "the same seed");
    assert!(texts[2..].iter().any(|t| *t != texts[0]), "{texts:?}");
}

#[tokio::test]
async fn weights_of_another_model_are_refused_by_name() {
    let vocab = Vocab::load(&fixture("vocab.json")).unwrap();
    let err = generate(
        &args("dynamo-hand-ntv.onnx", "mha.safetensors", "abc"),
        &vocab,
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("mha.safetensors") && err.contains("blocks.0.attn.qkv.weight"),
        "{err}"
    );
}

#[cfg(feature = "torch")]
#[tokio::test]
async fn greedy_generation_on_libtorch_matches_pytorch() {
    let vocab = Vocab::load(&fixture("vocab.json")).unwrap();
    for model in ["legacy-mha-nvt.onnx", "dynamo-hand-ntv.onnx"] {
        let weights = if model.contains("mha") { "mha" } else { "hand" };
        let mut a = args(model, &format!("{weights}.safetensors"), "fgh");
        a.backend = GenerateBackend::Torch;
        let got = generate(&a, &vocab).await.unwrap();
        assert_eq!(got, expected_greedy(weights, &vocab), "{model}");
    }
}
