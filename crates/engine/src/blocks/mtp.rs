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
    /// Every matrix the head multiplies, mutably (to interleave them): not `embed`, which is
    /// looked up by rows.
    pub fn matrices_mut(&mut self) -> Vec<&mut MatrixRef> {
        let mut out = vec![&mut self.eh_proj, &mut self.head];
        out.extend(self.attention.matrices_mut());
        out.extend(self.ffn.matrices_mut());
        out
    }

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

/// The MTP head over `m` consecutive positions starting at `position` (already validated:
/// `position <= kv.len()`, `position + m` within the cache, `m` at most the scratch rows,
/// `hidden` of `m × n_embd` values, tokens in the vocabulary). Row `i` takes the trunk's
/// final-norm hidden of position `position + i` and the token at `position + i + 1`. Cuts the
/// head's cache to `position` entries and appends `m`; writes the head's final-norm hidden of
/// every row to `hidden_out` (`m × n_embd`) and, for `logit_rows` (the last `k` rows, `k` =
/// `logits.len() / n_vocab`), their logits.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    config: &HybridConfig,
    w: &MtpWeights,
    file: &GgufFile,
    hidden: &[f32],
    tokens: &[u32],
    position: usize,
    kv: &mut KvCache,
    s: &mut HybridScratch,
    logits: &mut [f32],
    hidden_out: &mut [f32],
) -> Result<(), PluginError> {
    let e = config.n_embd;
    let m = tokens.len();
    let eps = config.rms_eps;
    kv.set_len(position);

    // Input rows: eh_proj · [enorm(embedding) | hnorm(hidden)].
    let embed = w.embed.view(file)?;
    for (i, &token) in tokens.iter().enumerate() {
        let (embedded, normed_hidden) = s.concat[i * 2 * e..(i + 1) * 2 * e].split_at_mut(e);
        embed.dequantize_row(token as usize, &mut s.proj[..e]);
        ops::rms_norm(&s.proj[..e], &w.enorm, eps, embedded);
        ops::rms_norm(&hidden[i * e..(i + 1) * e], &w.hnorm, eps, normed_hidden);
    }
    let (x, xn, proj) = (&mut s.x[..m * e], &mut s.xn[..m * e], &mut s.proj[..m * e]);
    matmul(
        &w.eh_proj.view(file)?,
        &s.concat[..m * 2 * e],
        x,
        &mut s.matmul,
    );

    // The decoder block.
    for (row, out) in x.chunks_exact(e).zip(xn.chunks_exact_mut(e)) {
        ops::rms_norm(row, &w.attn_norm, eps, out);
    }
    attention::forward_gated(
        &config.attention,
        &config.rope,
        eps,
        &w.attention,
        file,
        xn,
        m,
        kv,
        KvSlot {
            layer: 0,
            pos0: position,
            rope_offset: 1,
        },
        &mut s.attention,
        &mut s.matmul,
        proj,
    )?;
    ops::add_in_place(x, proj);
    for (row, out) in x.chunks_exact(e).zip(xn.chunks_exact_mut(e)) {
        ops::rms_norm(row, &w.post_attention_norm, eps, out);
    }
    ffn::forward_block(
        &config.ffn,
        &w.ffn,
        file,
        xn,
        m,
        &mut s.ffn,
        &mut s.matmul,
        proj,
    )?;
    ops::add_in_place(x, proj);

    // The shared head, logits only for the rows asked for.
    for (row, out) in x.chunks_exact(e).zip(hidden_out.chunks_exact_mut(e)) {
        ops::rms_norm(row, &w.head_norm, eps, out);
    }
    let logit_rows = logits.len() / config.n_vocab;
    if logit_rows > 0 {
        let from = (m - logit_rows) * e;
        matmul(
            &w.head.view(file)?,
            &hidden_out[from..],
            logits,
            &mut s.matmul,
        );
    }
    kv.set_len(position + m);
    Ok(())
}

/// [`forward`] over any number of rows, in chunks of at most `chunk_rows` (the scratch's
/// rows): `logits` holds the last `logits.len() / n_vocab` rows' logits, each taken from the
/// chunk that computed it. Chunking changes no bits: every row is computed as a one-row call.
#[allow(clippy::too_many_arguments)]
pub fn forward_chunked(
    config: &HybridConfig,
    w: &MtpWeights,
    file: &GgufFile,
    hidden: &[f32],
    tokens: &[u32],
    position: usize,
    kv: &mut KvCache,
    s: &mut HybridScratch,
    chunk_rows: usize,
    logits: &mut [f32],
    hidden_out: &mut [f32],
) -> Result<(), PluginError> {
    let (e, vocab, n) = (config.n_embd, config.n_vocab, tokens.len());
    let first_logit_row = n - logits.len() / vocab;
    let mut start = 0;
    while start < n {
        let m = chunk_rows.max(1).min(n - start);
        let (lo, hi) = (first_logit_row.max(start), start + m);
        let chunk_logits = if lo < hi {
            &mut logits[(lo - first_logit_row) * vocab..(hi - first_logit_row) * vocab]
        } else {
            &mut logits[..0]
        };
        forward(
            config,
            w,
            file,
            &hidden[start * e..(start + m) * e],
            &tokens[start..start + m],
            position + start,
            kv,
            s,
            chunk_logits,
            &mut hidden_out[start * e..(start + m) * e],
        )?;
        start += m;
    }
    Ok(())
}
