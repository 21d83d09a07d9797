//! The blockwise int8 kernels on a real adapter (lavapipe natively) against
//! the wire's own encoder and decoder (`Int8Block`'s references): the
//! payload's bytes as read back, scale by scale exactly and level by level
//! within WGSL's division error of a half ([`Int8Block::check_payload`]),
//! and decoded values within the bounds derived from WGSL's stated
//! accuracy. Fails, not skips, without an adapter. Run with `cargo test -p
//! rookery-kernels --features gpu`.
#![cfg(feature = "gpu")]

mod common;

use common::gpu;
use proptest::prelude::*;
use rookery_kernels::checks::{self, int8_values};
use rookery_kernels::int8::{Int8Block, NAN_SCALE, from_words};

/// The payload the quantize kernel makes of `x`, as read back.
fn quantize_on_gpu(x: &[f32]) -> Vec<u8> {
    let q = Int8Block::new(x.len());
    let gpu = gpu();
    let values = gpu.upload_f32(x).expect("the values upload");
    // Garbage in the output buffer beforehand: every word must be written.
    let packed = gpu
        .upload_u32(&vec![0xdead_beef; q.payload_words()])
        .expect("the payload buffer");
    pollster::block_on(gpu.dispatch(&q.quantize(), &[&values, &packed])).expect("the kernel runs");
    let words = pollster::block_on(gpu.read_u32(&packed)).expect("the payload reads back");
    from_words(&words, q.payload_bytes())
}

fn payload_matches_the_wire(x: &[f32]) -> Result<(), String> {
    let q = Int8Block::new(x.len());
    let got = quantize_on_gpu(x);
    q.check_payload(x, &got)?;
    // What the next stage decodes is within the block's absmax / 254 of
    // the value, and the derived slack.
    let decoded = q.dequantize_reference(&got);
    let bounds = q.wire_bounds(x);
    match (0..x.len()).find(|&i| (decoded[i] - x[i]).abs() > bounds[i]) {
        Some(i) => Err(format!(
            "value {i} decodes to {} for {} (bound {:e})",
            decoded[i], x[i], bounds[i]
        )),
        None => Ok(()),
    }
}

#[test]
fn quantized_payloads_match_the_wire_encoder_at_ragged_lengths() {
    for len in [
        1, 2, 3, 4, 5, 63, 64, 65, 127, 128, 129, 255, 256, 257, 4097, 70_001,
    ] {
        for seed in 0..3 {
            let x = int8_values(len, seed * 1000 + len as u64);
            payload_matches_the_wire(&x).unwrap_or_else(|e| panic!("[{len}] seed {seed}: {e}"));
        }
    }
}

#[test]
fn blocks_of_zeros_huge_and_subnormal_values_quantize_as_the_wire_does() {
    let mut x = vec![0.0f32; 64];
    x.extend((0..64).map(|i| if i % 2 == 0 { -0.0 } else { 0.0 }));
    x.extend((0..64).map(|i| f32::MAX * (i as f32 - 31.5) / 32.0));
    x.extend((0..64).map(|i| f32::from_bits(1 + 1000 * i) * if i % 3 == 0 { -1.0 } else { 1.0 }));
    x.extend((0..64).map(|i| f32::MIN_POSITIVE * (1.0 + i as f32)));
    // Values 2^-30 to 1 in one block: most levels round to 0.
    x.extend((0..64).map(|i| 2f32.powi(-(i % 31)) * if i % 2 == 0 { 1.0 } else { -0.75 }));
    x.extend([3.0; 7]);
    payload_matches_the_wire(&x).unwrap();
}

#[test]
fn a_block_holding_a_non_finite_value_gets_the_wires_nan_scale_and_zeros() {
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -f32::NAN] {
        let mut x = int8_values(200, 4);
        x[70] = bad;
        x[199] = bad;
        let q = Int8Block::new(x.len());
        let got = quantize_on_gpu(&x);
        q.check_payload(&x, &got).unwrap();
        for block in [1, 3] {
            assert_eq!(got[4 * block..4 * block + 4], NAN_SCALE.to_le_bytes());
        }
        assert!(got[16 + 64..16 + 128].iter().all(|&b| b == 0));
        assert!(got[16 + 192..].iter().all(|&b| b == 0));
    }
}

#[test]
fn quantize_then_dequantize_on_the_gpu_stays_within_the_derived_bounds() {
    for len in [1, 63, 64, 65, 1000, 4097] {
        for seed in 0..3 {
            pollster::block_on(checks::run(
                gpu(),
                &checks::int8(len, seed * 7 + len as u64),
            ))
            .unwrap();
        }
    }
}

#[test]
fn a_wrong_level_or_scale_fails_the_checks() {
    // The harness itself must be able to fail: the payload of other values
    // is refused, and so is a dequantize of the wrong length.
    let x = int8_values(300, 1);
    let mut other = x.clone();
    other[5] = other[5] * 0.5 + 0.25;
    let q = Int8Block::new(300);
    assert!(q.check_payload(&other, &quantize_on_gpu(&x)).is_err());
    let mut check = checks::int8(300, 1);
    check.steps[1].0 = Int8Block::new(299).dequantize();
    assert!(pollster::block_on(checks::run(gpu(), &check)).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn quantize_matches_the_wire_on_random_lengths(len in 1usize..9000, seed in any::<u64>()) {
        prop_assert_eq!(payload_matches_the_wire(&int8_values(len, seed)), Ok(()));
        prop_assert_eq!(
            pollster::block_on(checks::run(gpu(), &checks::int8(len, seed))).map_err(|e| e.to_string()),
            Ok(())
        );
    }
}
