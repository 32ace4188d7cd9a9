//! Which layers run on the GPU.
//!
//! The pipeline of a forward pass is: the embedding (always on the host, one row per token
//! read from the mapped file), trunk layers `0 .. L`, then the **head** (final norm, LM head
//! and, when the model has one, the MTP block with its own KV cache). The GPU takes a
//! **suffix** of it: layers `first_gpu_layer .. L` and the head. So a pass crosses from host
//! to device at most once (the residual rows of the chunk, through a pinned buffer) and comes
//! back with the logits and final hidden states.
//!
//! With `gpu_layers = N` the last N layers (and the head, when N > 0) are placed, and the
//! VRAM budget must hold them. With `auto`, the head is placed first (it is read every token
//! and is usually the largest single matrix), then layers from the last one backwards while
//! the budget holds their weights and their sequence state (KV cache for attention layers,
//! snapshot-ring planes for Gated DeltaNet layers). Fixed costs (scratch buffers) are charged
//! before anything.

use crate::options::GpuLayers;

/// GPU memory one trunk layer needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LayerCost {
    /// Bytes of its weights (matrices as stored, vectors as f32).
    pub weights: u64,
    /// Bytes of its sequence state: an attention layer's share of the KV block pool
    /// (`kv_tokens` positions over all sequences), a Gated DeltaNet layer's snapshot-ring
    /// planes for every sequence slot.
    pub state: u64,
}

impl LayerCost {
    pub fn total(&self) -> u64 {
        self.weights + self.state
    }
}

/// GPU memory of everything that could be placed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Costs {
    pub layers: Vec<LayerCost>,
    /// The head: final norm, LM head, MTP block and its KV cache.
    pub head: u64,
    /// Activation scratch, pinned-buffer mirrors and the like, charged whenever anything is
    /// placed.
    pub fixed: u64,
}

/// Where the pipeline crosses to the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// Layers `first_gpu_layer ..` run on the GPU (equal to the layer count: none).
    pub first_gpu_layer: usize,
    pub n_layers: usize,
    /// The head (final norm, LM head, MTP block) runs on the GPU.
    pub head_on_gpu: bool,
    /// GPU bytes the placement needs.
    pub bytes: u64,
}

impl Placement {
    /// Trunk layers on the GPU.
    pub fn gpu_layers(&self) -> usize {
        self.n_layers - self.first_gpu_layer
    }

    /// Whether anything runs on the GPU.
    pub fn uses_gpu(&self) -> bool {
        self.head_on_gpu || self.gpu_layers() > 0
    }

    /// Whether trunk layer `layer` runs on the GPU.
    pub fn on_gpu(&self, layer: usize) -> bool {
        layer >= self.first_gpu_layer
    }

    /// Everything on the host.
    pub fn cpu_only(n_layers: usize) -> Self {
        Self {
            first_gpu_layer: n_layers,
            n_layers,
            head_on_gpu: false,
            bytes: 0,
        }
    }
}

/// Why a placement is impossible.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DoesNotFit {
    pub asked: usize,
    pub needed: u64,
    pub budget: u64,
}

/// Places layers and head within `budget` bytes as `request` says (see the module docs).
pub fn place(costs: &Costs, request: GpuLayers, budget: u64) -> Result<Placement, DoesNotFit> {
    let n = costs.layers.len();
    let suffix_bytes = |k: usize| -> u64 {
        costs.layers[n - k..]
            .iter()
            .map(LayerCost::total)
            .sum::<u64>()
    };
    match request {
        GpuLayers::Count(0) => Ok(Placement::cpu_only(n)),
        GpuLayers::Count(asked) => {
            let k = asked.min(n);
            let needed = costs.fixed + costs.head + suffix_bytes(k);
            if needed > budget {
                return Err(DoesNotFit {
                    asked: k,
                    needed,
                    budget,
                });
            }
            Ok(Placement {
                first_gpu_layer: n - k,
                n_layers: n,
                head_on_gpu: true,
                bytes: needed,
            })
        }
        GpuLayers::Auto => {
            let mut used = costs.fixed + costs.head;
            if used > budget {
                return Ok(Placement::cpu_only(n));
            }
            let mut k = 0;
            while k < n && used + costs.layers[n - 1 - k].total() <= budget {
                used += costs.layers[n - 1 - k].total();
                k += 1;
            }
            Ok(Placement {
                first_gpu_layer: n - k,
                n_layers: n,
                head_on_gpu: true,
                bytes: used,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn costs() -> Costs {
        Costs {
            layers: vec![
                LayerCost {
                    weights: 100,
                    state: 10
                };
                4
            ],
            head: 50,
            fixed: 5,
        }
    }

    #[test]
    fn auto_fills_the_budget_from_the_last_layer() {
        let c = costs();
        let all = place(&c, GpuLayers::Auto, 10_000).unwrap();
        assert_eq!(
            (all.first_gpu_layer, all.head_on_gpu, all.bytes),
            (0, true, 495)
        );
        assert_eq!(all.gpu_layers(), 4);
        let two = place(&c, GpuLayers::Auto, 55 + 2 * 110 + 109).unwrap();
        assert_eq!((two.first_gpu_layer, two.gpu_layers()), (2, 2));
        assert!(two.on_gpu(3) && two.on_gpu(2) && !two.on_gpu(1));
        let head_only = place(&c, GpuLayers::Auto, 60).unwrap();
        assert_eq!((head_only.gpu_layers(), head_only.head_on_gpu), (0, true));
        assert!(head_only.uses_gpu());
        let nothing = place(&c, GpuLayers::Auto, 54).unwrap();
        assert_eq!(nothing, Placement::cpu_only(4));
        assert!(!nothing.uses_gpu());
    }

    #[test]
    fn a_count_is_checked_against_the_budget() {
        let c = costs();
        let three = place(&c, GpuLayers::Count(3), 1000).unwrap();
        assert_eq!((three.first_gpu_layer, three.bytes), (1, 55 + 330));
        let all = place(&c, GpuLayers::Count(usize::MAX), 1000).unwrap();
        assert_eq!(all.first_gpu_layer, 0);
        assert_eq!(
            place(&c, GpuLayers::Count(0), 0).unwrap(),
            Placement::cpu_only(4)
        );
        assert_eq!(
            place(&c, GpuLayers::Count(3), 300).unwrap_err(),
            DoesNotFit {
                asked: 3,
                needed: 385,
                budget: 300
            }
        );
    }
}
