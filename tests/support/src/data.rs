//! Seeded synthetic data: the same values on every machine and every run.

/// `n` pseudo-random values in [-1, 1) from a xorshift stream seeded with
/// `seed` (no libtorch RNG involved).
pub fn pseudo(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// `n` values in [-1, 1) from a fixed linear congruential stream seeded with
/// `seed`: data that differs per position but not per run.
pub fn lcg_values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// A classification data set: `samples` inputs of shape `sample`, row-major,
/// and one class per input.
#[derive(Debug, Clone, PartialEq)]
pub struct Classes {
    pub sample: Vec<usize>,
    pub x: Vec<f32>,
    pub y: Vec<i64>,
}

impl Classes {
    /// Learnable 4-class data: [`lcg_values`] inputs whose class is a
    /// function of their first four values (their sum, shifted and cut into
    /// four bands).
    pub fn learnable(samples: usize, sample: &[usize], seed: u64) -> Self {
        let numel: usize = sample.iter().product();
        let x = lcg_values(samples * numel, seed);
        let y = x
            .chunks(numel.max(1))
            .take(samples)
            .map(|row| {
                let s: f32 = row.iter().take(4).sum();
                (s + 2.0).clamp(0.0, 3.99) as i64
            })
            .collect();
        Self {
            sample: sample.to_vec(),
            x,
            y,
        }
    }

    /// Data that only exercises the plumbing: a fixed sawtooth of inputs in
    /// [-1, 1) and the classes `0, 1, .., classes - 1` in turn.
    pub fn cyclic(samples: usize, features: usize, classes: usize) -> Self {
        let x = (0..samples * features)
            .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
            .collect();
        let y = (0..samples).map(|i| (i % classes) as i64).collect();
        Self {
            sample: vec![features],
            x,
            y,
        }
    }

    pub fn len(&self) -> usize {
        self.y.len()
    }

    pub fn is_empty(&self) -> bool {
        self.y.is_empty()
    }

    /// The inputs' shape: the samples, then one sample's.
    pub fn shape(&self) -> Vec<usize> {
        let mut shape = vec![self.len()];
        shape.extend_from_slice(&self.sample);
        shape
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_fixed_and_in_range() {
        assert_eq!(pseudo(4, 3), pseudo(4, 3));
        assert_ne!(pseudo(4, 3), pseudo(4, 4));
        for v in pseudo(1000, 1).into_iter().chain(lcg_values(1000, 1)) {
            assert!((-1.0..1.0).contains(&v), "{v}");
        }
    }

    #[test]
    fn learnable_classes_follow_the_first_four_values() {
        let data = Classes::learnable(64, &[12], 0x2545_f491_4f6c_dd1d);
        assert_eq!((data.x.len(), data.shape()), (64 * 12, vec![64, 12]));
        for (row, &y) in data.x.chunks(12).zip(&data.y) {
            let s: f32 = row[..4].iter().sum();
            assert_eq!(y, (s + 2.0).clamp(0.0, 3.99) as i64);
        }
        assert!((0..4).all(|c| data.y.contains(&c)));
    }
}
