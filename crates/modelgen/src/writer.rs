//! Laying out the tensors of each architecture.

use std::path::Path;

use specula_gguf::{GgmlType, GgufWriter};

use crate::mix::TypeMix;
use crate::spec::{Arch, ModelSpec};
use crate::vocab::Vocab;
use crate::weights::WeightSource;
use crate::GenError;

/// Adds tensors, taking values from the weight source and choosing their storage.
struct Tensors<'a> {
    w: &'a mut GgufWriter,
    weights: &'a mut dyn WeightSource,
    ty: GgmlType,
    mix: TypeMix,
    blocks: u32,
    tied: bool,
}

impl Tensors<'_> {
    /// The type of matrix `name` with rows of `n_in`: the mix's choice, F32 when the rows are
    /// not whole blocks of it.
    fn type_of(&self, name: &str, n_in: usize) -> GgmlType {
        let ty = self.mix.type_of(name, self.ty, self.blocks, self.tied);
        if ty.row_bytes(n_in).is_some() {
            ty
        } else {
            GgmlType::F32
        }
    }

    /// A matrix of `n_out` rows of `n_in`, in the type [`Self::type_of`] says.
    fn matrix(&mut self, name: &str, n_in: usize, n_out: usize) -> Result<(), GenError> {
        let values = self.weights.tensor(name, n_in, n_out);
        let ty = self.type_of(name, n_in);
        let data = specula_kernels::try_quantize(ty, &values)
            .map_err(|e| GenError::Shape(format!("{name}: {e}")))?;
        self.w
            .add_tensor(name, &[n_in as u64, n_out as u64], ty, data)?;
        Ok(())
    }

    /// A 3-D tensor of `experts` stacked matrices.
    fn experts(
        &mut self,
        name: &str,
        n_in: usize,
        n_out: usize,
        experts: usize,
    ) -> Result<(), GenError> {
        let values = self.weights.tensor(name, n_in, n_out * experts);
        let ty = self.type_of(name, n_in);
        let data = specula_kernels::try_quantize(ty, &values)
            .map_err(|e| GenError::Shape(format!("{name}: {e}")))?;
        self.w
            .add_tensor(name, &[n_in as u64, n_out as u64, experts as u64], ty, data)?;
        Ok(())
    }

    /// A vector, always F32.
    fn vector(&mut self, name: &str, n: usize) -> Result<(), GenError> {
        let values = self.weights.tensor(name, n, 1);
        self.w.add_f32(name, &[n as u64], &values)?;
        Ok(())
    }
}

/// Writes `spec` with weights from `weights` and tokenizer `vocab` to `path`.
pub fn write_model(
    spec: &ModelSpec,
    vocab: &Vocab,
    weights: &mut dyn WeightSource,
    path: &Path,
) -> Result<(), GenError> {
    spec.validate()?;
    let arch = spec.arch.gguf_name();
    let key = |k: &str| format!("{arch}.{k}");
    let (e, v) = (spec.hidden as usize, vocab.len());
    let hd = spec.head_dim as usize;
    let (q_dim, kv_dim) = (spec.heads as usize * hd, spec.kv_heads as usize * hd);
    let blocks = spec.layers + u32::from(spec.mtp);

    let mut w = GgufWriter::new();
    w.set_str("general.architecture", arch)
        .set_str("general.name", &spec.name)
        .set_u32(key("context_length"), spec.context)
        .set_u32(key("embedding_length"), spec.hidden)
        .set_u32(key("block_count"), blocks)
        .set_u32(key("feed_forward_length"), spec.ffn)
        .set_u32(key("attention.head_count"), spec.heads)
        .set_u32(key("attention.head_count_kv"), spec.kv_heads)
        .set_u32(key("attention.key_length"), spec.head_dim)
        .set_u32(key("attention.value_length"), spec.head_dim)
        .set_f32(key("attention.layer_norm_rms_epsilon"), spec.rms_eps)
        .set_u32(
            key("rope.dimension_count"),
            spec.rope_dims.unwrap_or(spec.head_dim),
        )
        .set_f32(key("rope.freq_base"), spec.rope_base)
        .set_u32(key("vocab_size"), v as u32);
    if let Some(sections) = spec.rope_sections {
        w.set_i32_array(key("rope.dimension_sections"), sections);
    }
    if let Some(h) = spec.hybrid {
        w.set_u32(key("ssm.conv_kernel"), h.conv_kernel)
            .set_u32(key("ssm.state_size"), h.state_size)
            .set_u32(key("ssm.group_count"), h.k_heads)
            .set_u32(key("ssm.time_step_rank"), h.v_heads)
            .set_u32(key("ssm.inner_size"), h.state_size * h.v_heads)
            .set_u32(key("full_attention_interval"), h.full_attention_interval);
    }
    if spec.mtp {
        w.set_u32(key("nextn_predict_layers"), 1);
    }
    if let Some(m) = spec.moe {
        w.set_u32(key("expert_count"), m.experts)
            .set_u32(key("expert_used_count"), m.experts_used)
            .set_u32(key("expert_feed_forward_length"), m.expert_ffn)
            .set_u32(key("expert_shared_feed_forward_length"), m.shared_ffn);
    }
    vocab.write_metadata(&mut w);

    let mut t = Tensors {
        w: &mut w,
        weights,
        ty: spec.weight_type,
        mix: spec.mix,
        blocks,
        tied: spec.tied_output,
    };
    t.matrix("token_embd.weight", e, v)?;
    t.vector("output_norm.weight", e)?;
    if !spec.tied_output {
        t.matrix("output.weight", e, v)?;
    }
    for l in 0..blocks {
        let name = |n: &str| format!("blk.{l}.{n}.weight");
        let is_mtp = l == spec.layers;
        t.vector(&name("attn_norm"), e)?;
        if spec.arch.is_hybrid() {
            t.vector(&name("post_attention_norm"), e)?;
        }
        if is_mtp || spec.is_attention_layer(l) {
            // Hybrids pack a per-head output gate after each head's queries.
            let q_rows = if spec.arch.is_hybrid() {
                2 * q_dim
            } else {
                q_dim
            };
            t.matrix(&name("attn_q"), e, q_rows)?;
            t.matrix(&name("attn_k"), e, kv_dim)?;
            t.matrix(&name("attn_v"), e, kv_dim)?;
            t.matrix(&name("attn_output"), q_dim, e)?;
            if spec.arch == Arch::Qwen2 {
                t.vector(&format!("blk.{l}.attn_q.bias"), q_dim)?;
                t.vector(&format!("blk.{l}.attn_k.bias"), kv_dim)?;
                t.vector(&format!("blk.{l}.attn_v.bias"), kv_dim)?;
            }
            if spec.arch.has_qk_norm() {
                t.vector(&name("attn_q_norm"), hd)?;
                t.vector(&name("attn_k_norm"), hd)?;
            }
        } else {
            let h = spec
                .hybrid
                .expect("validated: hybrid layers need a hybrid shape");
            let (s, hk, hv) = (
                h.state_size as usize,
                h.k_heads as usize,
                h.v_heads as usize,
            );
            let channels = 2 * s * hk + s * hv;
            t.matrix(&name("attn_qkv"), e, channels)?;
            t.matrix(&name("attn_gate"), e, s * hv)?;
            t.matrix(&name("ssm_conv1d"), h.conv_kernel as usize, channels)?;
            t.vector(&format!("blk.{l}.ssm_dt.bias"), hv)?;
            t.vector(&format!("blk.{l}.ssm_a"), hv)?;
            if spec.arch == Arch::Qwen35 {
                t.matrix(&name("ssm_beta"), e, hv)?;
                t.matrix(&name("ssm_alpha"), e, hv)?;
            } else {
                t.matrix(&name("ssm_ba"), e, 2 * hv)?;
            }
            t.vector(&name("ssm_norm"), s)?;
            t.matrix(&name("ssm_out"), s * hv, e)?;
        }
        if !spec.arch.is_hybrid() {
            t.vector(&name("ffn_norm"), e)?;
        }
        match spec.moe {
            Some(m) => {
                let (n, f, sf) = (
                    m.experts as usize,
                    m.expert_ffn as usize,
                    m.shared_ffn as usize,
                );
                t.matrix(&name("ffn_gate_inp"), e, n)?;
                t.experts(&name("ffn_gate_exps"), e, f, n)?;
                t.experts(&name("ffn_up_exps"), e, f, n)?;
                t.experts(&name("ffn_down_exps"), f, e, n)?;
                t.vector(&name("ffn_gate_inp_shexp"), e)?;
                t.matrix(&name("ffn_gate_shexp"), e, sf)?;
                t.matrix(&name("ffn_up_shexp"), e, sf)?;
                t.matrix(&name("ffn_down_shexp"), sf, e)?;
            }
            None => {
                t.matrix(&name("ffn_gate"), e, spec.ffn as usize)?;
                t.matrix(&name("ffn_up"), e, spec.ffn as usize)?;
                t.matrix(&name("ffn_down"), spec.ffn as usize, e)?;
            }
        }
        if is_mtp {
            t.matrix(&name("nextn.eh_proj"), 2 * e, e)?;
            t.vector(&name("nextn.enorm"), e)?;
            t.vector(&name("nextn.hnorm"), e)?;
            t.vector(&name("nextn.shared_head_norm"), e)?;
        }
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| GenError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
    }
    w.write(path)?;
    Ok(())
}
