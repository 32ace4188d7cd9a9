//! Where tensor values come from.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};

/// Fills tensors: `(name, n_in, n_out)` → `n_in × n_out` values, `n_out` rows of `n_in`.
/// Vectors (norm weights, biases) have `n_out` = 1.
pub trait WeightSource {
    fn tensor(&mut self, name: &str, n_in: usize, n_out: usize) -> Vec<f32>;
}

/// Random weights from a seeded generator: matrices ~ N(0, 1/n_in) (the output projection
/// scaled up for peakier logits), norm weights ~ 1 ± 0.02, and the Gated DeltaNet vectors in
/// their usual ranges (`ssm_a` negative, as it stores −exp(A_log); `ssm_dt.bias` around 0).
pub struct RandomWeights {
    rng: ChaCha8Rng,
    /// Multiplies `output.weight`.
    pub output_scale: f32,
}

impl RandomWeights {
    pub fn new(seed: u64) -> Self {
        Self {
            rng: ChaCha8Rng::seed_from_u64(seed),
            output_scale: 4.0,
        }
    }

    fn normal(&mut self, n: usize, mean: f32, std: f32) -> Vec<f32> {
        let dist = Normal::new(mean, std).expect("finite std");
        (0..n).map(|_| dist.sample(&mut self.rng)).collect()
    }
}

impl WeightSource for RandomWeights {
    fn tensor(&mut self, name: &str, n_in: usize, n_out: usize) -> Vec<f32> {
        let n = n_in * n_out;
        if name.ends_with("ssm_a") {
            return self
                .normal(n, -1.0, 0.3)
                .into_iter()
                .map(|v| v.min(-0.05))
                .collect();
        }
        if name.ends_with("ssm_dt.bias") {
            return self.normal(n, 0.0, 0.5);
        }
        if n_out == 1 && name.contains("norm") {
            return self.normal(n, 1.0, 0.02);
        }
        let mut values = self.normal(n, 0.0, 1.0 / (n_in as f32).sqrt());
        if name == "output.weight" {
            values.iter_mut().for_each(|v| *v *= self.output_scale);
        }
        values
    }
}
