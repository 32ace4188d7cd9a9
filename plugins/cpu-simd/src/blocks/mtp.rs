//! The NextN / MTP head (`blk.{n_trunk}`): from the trunk's final-norm hidden state `h` of
//! position `p` and the token at `p + 1`, the logits for position `p + 2`.
//!
//! `x = eh_proj · [enorm(embed(token)) | hnorm(h)]`, then one gated full-attention decoder
//! block with the trunk's FFN kind (`x += attn(attn_norm(x)); x += ffn(post_attention_norm(x))`)
//! over the head's own KV cache, then `shared_head_norm` (else `output_norm`) gives the head's
//! hidden state — which feeds the next chained step — and `shared_head_head` (else `output`)
//! the logits. The embedding is `nextn.embed_tokens`, else `token_embd`.
//!
//! Cache entry `p` holds the keys and values of the step for position `p`; its RoPE position
//! is `p + 1`, the position of the token it embeds (as llama.cpp feeds the MTP head the
//! target's tokens at their own positions).

use specula_gguf::GgufFile;
use specula_kernels::{matmul, ops};
use specula_plugin_api::PluginError;

use crate::arch::hybrid::{HybridConfig, HybridScratch};
use crate::blocks::attention::{self, GatedAttentionWeights, KvSlot};
use crate::blocks::ffn::{self, FfnBlock};
use crate::kv_cache::KvCache;
use crate::model::weights::{load_optional_vector, load_vector, MatrixRef};
use crate::model::LoadError;

/// The weights of the MTP block.
#[derive(Debug, Clone)]
pub struct MtpWeights {
    /// The block's index (`blk.{layer}`).
    pub layer: usize,
    /// `nextn.eh_proj {2·n_embd, n_embd}`.
    pub eh_proj: MatrixRef,
    pub enorm: Vec<f32>,
    pub hnorm: Vec<f32>,
    pub attn_norm: Vec<f32>,
    pub post_attention_norm: Vec<f32>,
    pub attention: GatedAttentionWeights,
    pub ffn: FfnBlock,
    /// `nextn.shared_head_norm`, else the trunk's `output_norm`.
    pub head_norm: Vec<f32>,
    /// `nextn.embed_tokens`, else `token_embd`.
    pub embed: MatrixRef,
    /// `nextn.shared_head_head`, else the trunk's `output`.
    pub head: MatrixRef,
}

impl MtpWeights {
    /// Loads block `layer` as an MTP head; the optional NextN tensors fall back to the trunk's
    /// `token_embd`, `output` and `output_norm`.
    pub fn load(
        file: &GgufFile,
        layer: usize,
        config: &HybridConfig,
        token_embd: &MatrixRef,
        output: &MatrixRef,
        output_norm: &[f32],
    ) -> Result<Self, LoadError> {
        let e = config.n_embd;
        let name = |t: &str| format!("blk.{layer}.{t}.weight");
        let optional_matrix = |t: &str| -> Result<Option<MatrixRef>, LoadError> {
            match file.tensor_info(&name(t)) {
                None => Ok(None),
                Some(_) => MatrixRef::load(file, &name(t), config.n_vocab, e).map(Some),
            }
        };
        Ok(Self {
            layer,
            eh_proj: MatrixRef::load(file, &name("nextn.eh_proj"), e, 2 * e)?,
            enorm: load_vector(file, &name("nextn.enorm"), e)?,
            hnorm: load_vector(file, &name("nextn.hnorm"), e)?,
            attn_norm: load_vector(file, &name("attn_norm"), e)?,
            post_attention_norm: load_vector(file, &name("post_attention_norm"), e)?,
            attention: GatedAttentionWeights::load(file, layer, &config.attention, e)?,
            ffn: FfnBlock::load(file, layer, &config.ffn)?,
            head_norm: load_optional_vector(file, &name("nextn.shared_head_norm"), e)?
                .unwrap_or_else(|| output_norm.to_vec()),
            embed: optional_matrix("nextn.embed_tokens")?.unwrap_or_else(|| token_embd.clone()),
            head: optional_matrix("nextn.shared_head_head")?.unwrap_or_else(|| output.clone()),
        })
    }
}

/// One MTP step at `position` (already validated: `position <= kv.len()`, within the cache,
/// `hidden` of `n_embd` values, `token` in the vocabulary). Cuts the head's cache to `position`
/// entries, appends the step's entry, and writes `logits` (`n_vocab`) and `hidden_out`
/// (`n_embd`).
#[allow(clippy::too_many_arguments)]
pub fn step(
    config: &HybridConfig,
    w: &MtpWeights,
    file: &GgufFile,
    hidden: &[f32],
    token: u32,
    position: usize,
    kv: &mut KvCache,
    s: &mut HybridScratch,
    logits: &mut [f32],
    hidden_out: &mut [f32],
) -> Result<(), PluginError> {
    let e = config.n_embd;
    let eps = config.rms_eps;
    kv.set_len(position);

    // Input: eh_proj · [enorm(embedding) | hnorm(hidden)].
    let (embedded, normed_hidden) = s.concat.split_at_mut(e);
    w.embed
        .view(file)?
        .dequantize_row(token as usize, &mut s.proj[..e]);
    ops::rms_norm(&s.proj[..e], &w.enorm, eps, embedded);
    ops::rms_norm(hidden, &w.hnorm, eps, normed_hidden);
    matmul(
        &w.eh_proj.view(file)?,
        &s.concat,
        &mut s.x[..e],
        &mut s.matmul,
    );

    // The decoder block.
    ops::rms_norm(&s.x[..e], &w.attn_norm, eps, &mut s.xn[..e]);
    attention::forward_gated(
        &config.attention,
        &config.rope,
        eps,
        &w.attention,
        file,
        &s.xn[..e],
        1,
        kv,
        KvSlot {
            layer: 0,
            pos0: position,
            rope_offset: 1,
        },
        &mut s.attention,
        &mut s.matmul,
        &mut s.proj[..e],
    )?;
    ops::add_in_place(&mut s.x[..e], &s.proj[..e]);
    ops::rms_norm(&s.x[..e], &w.post_attention_norm, eps, &mut s.xn[..e]);
    ffn::forward_block(
        &config.ffn,
        &w.ffn,
        file,
        &s.xn[..e],
        1,
        &mut s.ffn,
        &mut s.matmul,
        &mut s.proj[..e],
    )?;
    ops::add_in_place(&mut s.x[..e], &s.proj[..e]);

    // The shared head.
    ops::rms_norm(&s.x[..e], &w.head_norm, eps, hidden_out);
    matmul(&w.head.view(file)?, hidden_out, logits, &mut s.matmul);
    kv.set_len(position + 1);
    Ok(())
}
