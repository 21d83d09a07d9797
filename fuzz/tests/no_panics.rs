//! The fuzz targets under proptest in every test run: a few thousand mutated
//! seeds per parser, shrunk to the smallest panicking mutation if one panics.
//! `cargo xtask bench fuzz` runs the same targets with a million inputs each.

// Helpers outside #[test] fns panic on purpose too: a panic is a test failure.
#![allow(clippy::unwrap_used)]

use std::sync::LazyLock;

use proptest::prelude::*;
use rookery_fuzz::mutate::{LineAction, Mutation, apply};
use rookery_fuzz::targets::{self, Target, Targets};

static TARGETS: LazyLock<Targets> = LazyLock::new(|| targets::all().unwrap());

fn target(name: &str) -> &'static Target {
    TARGETS.list.iter().find(|t| t.name == name).unwrap()
}

fn mutation(text: bool) -> impl Strategy<Value = Mutation> {
    let bytes =
        prop_oneof![
            (any::<u32>(), 0u8..8).prop_map(|(at, bit)| Mutation::FlipBit { at, bit }),
            (any::<u32>(), any::<u8>()).prop_map(|(at, which)| Mutation::Interesting { at, which }),
            (any::<u32>(), any::<u8>()).prop_map(|(at, value)| Mutation::SetByte { at, value }),
            any::<u32>().prop_map(|at| Mutation::Truncate { at }),
            (any::<u32>(), proptest::collection::vec(any::<u8>(), 1..16))
                .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
            (any::<u32>(), 1u16..64).prop_map(|(at, len)| Mutation::Remove { at, len }),
            (any::<u32>(), 1u16..256, any::<u32>())
                .prop_map(|(from, len, to)| Mutation::Duplicate { from, len, to }),
            (any::<u16>(), any::<u32>(), any::<u32>())
                .prop_map(|(seed, at, from)| Mutation::Splice { seed, at, from }),
            (any::<u32>(), any::<u64>()).prop_map(|(at, value)| Mutation::Varint { at, value }),
        ];
    let text_ops = prop_oneof![
        (any::<u16>(), any::<u8>()).prop_map(|(nth, which)| Mutation::Token { nth, which }),
        (
            any::<u16>(),
            prop_oneof![
                Just(LineAction::Delete),
                Just(LineAction::Duplicate),
                Just(LineAction::SwapWithNext)
            ]
        )
            .prop_map(|(nth, action)| Mutation::Line { nth, action }),
    ];
    if text {
        prop_oneof![2 => bytes, 1 => text_ops].boxed()
    } else {
        bytes.boxed()
    }
}

/// Mutates a seed of `name` with up to four ops and runs it; a panic fails
/// with its message.
fn no_panic(name: &str, seed: usize, ops: &[Mutation]) -> Result<(), TestCaseError> {
    let target = target(name);
    let input = apply(&target.seeds, seed, ops);
    rookery_fuzz::run_one(target, seed, &input)
        .map(drop)
        .map_err(|message| TestCaseError::fail(format!("{name} panicked: {message}")))
}

#[test]
fn every_seed_parses_so_mutations_start_from_valid_input() {
    for target in &TARGETS.list {
        for (i, seed) in target.seeds.iter().enumerate() {
            assert_eq!(
                rookery_fuzz::run_one(target, i, seed),
                Ok(true),
                "{} seed {i}",
                target.name
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    #[test]
    fn mutated_frames_to_the_server_never_panic(seed in 0usize..64, ops in proptest::collection::vec(mutation(false), 1..5)) {
        no_panic("protocol ToServer", seed, &ops)?;
    }

    #[test]
    fn mutated_frames_to_providers_never_panic(seed in 0usize..64, ops in proptest::collection::vec(mutation(false), 1..5)) {
        no_panic("protocol ToProvider", seed, &ops)?;
    }

    #[test]
    fn mutated_frame_sequences_never_panic(seed in 0usize..64, ops in proptest::collection::vec(mutation(false), 1..5)) {
        no_panic("protocol stream", seed, &ops)?;
    }

    #[test]
    fn mutated_job_files_never_panic(seed in 0usize..64, ops in proptest::collection::vec(mutation(true), 1..5)) {
        no_panic("job file (TOML)", seed, &ops)?;
        no_panic("job file (JSON)", seed, &ops)?;
    }

    #[test]
    fn mutated_layer_specs_never_panic(seed in 0usize..64, ops in proptest::collection::vec(mutation(true), 1..5)) {
        no_panic("layer spec (TOML)", seed, &ops)?;
    }
}

proptest! {
    // An import runs shape inference over a whole model: fewer cases.
    #![proptest_config(ProptestConfig::with_cases(1500))]

    #[test]
    fn mutated_dataset_files_never_panic(seed in 0usize..64, ops in proptest::collection::vec(mutation(false), 1..5)) {
        no_panic("dataset files", seed, &ops)?;
    }

    #[test]
    fn mutated_onnx_models_never_panic(seed in 0usize..64, ops in proptest::collection::vec(mutation(false), 1..5)) {
        no_panic("ONNX import", seed, &ops)?;
    }
}

/// Inputs the fuzzer once panicked on (`regressions/TARGET-WHAT.bin`, TARGET
/// being the target's name with every other character than letters and
/// digits as `_`, as `bench fuzz` names what it finds), kept so each fix stays.
#[test]
fn inputs_that_once_panicked_are_errors() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("regressions");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        let target = TARGETS
            .list
            .iter()
            .find(|t| file.starts_with(&format!("{}-", rookery_fuzz::slug(t.name))))
            .unwrap_or_else(|| panic!("{file} names no target"));
        let input = std::fs::read(&path).unwrap();
        let outcome = rookery_fuzz::run_one(target, 0, &input);
        assert!(outcome.is_ok(), "{file}: {outcome:?}");
        seen += 1;
    }
    assert!(seen >= 3, "only {seen} regression inputs");
}
