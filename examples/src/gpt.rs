//! A small GPT in the style of tch's own examples (min-GPT): token and position embeddings, a
//! stack of pre-norm blocks with causal self-attention and an MLP, and a language-model head.
//!
//! The layers that hold weights come from a [`Layers`] factory, so one model definition trains
//! resident (plain `tch::nn`, [`TchLayers`]) or streamed by Stagehand's layer mode
//! ([`StreamedLayers`]): the diff a user makes is the factory. The norms carry no parameters, so
//! every parameter lives in a linear or embedding layer. The attention probabilities (of the
//! recomputed attention), the norms' outputs and the MLP's activation are recomputed in backward
//! under an activation runtime ([`stagehand::activations::recompute`]) rather than stored; in
//! plain tch that is the same computation. With [`GptConfig::checkpoint`] each block is one
//! recompute scope over its input, weights and biases: only the block's input is stored, and
//! backward computes the block again (one more forward on the device, no activations to spill).

use stagehand::activations::recompute;
use stagehand::nn as snn;
use stagehand::torch::attention::fixed_kernel_attention;
use tch::nn::{self, Module};
use tch::{Kind, Tensor};

/// Makes the layers that hold weights, at a path like `["blocks", "3", "qkv"]`.
pub trait Layers {
    fn linear(&self, path: &[String], in_dim: i64, out_dim: i64) -> Box<dyn LinearLayer>;
    fn embedding(&self, path: &[String], n: i64, dim: i64) -> Box<dyn Module>;
}

/// A linear layer whose weight and bias a checkpointed block hands to its recompute scope.
pub trait LinearLayer: Module {
    /// Runs `f` on `[weight, bias]` while they hold their values (a streamed layer's block
    /// resident).
    fn with_params(&self, f: &mut dyn FnMut(&[Tensor]) -> Tensor) -> Tensor;
}

impl LinearLayer for nn::Linear {
    fn with_params(&self, f: &mut dyn FnMut(&[Tensor]) -> Tensor) -> Tensor {
        let bias = self.bs.as_ref().expect("the GPT's linear layers have biases");
        f(&[self.ws.shallow_clone(), bias.shallow_clone()])
    }
}

impl LinearLayer for snn::Linear {
    fn with_params(&self, f: &mut dyn FnMut(&[Tensor]) -> Tensor) -> Tensor {
        let run = self.run(|l| {
            let bias = l.bs.as_ref().expect("the GPT's linear layers have biases");
            f(&[l.ws.shallow_clone(), bias.shallow_clone()])
        });
        // As the layer's own forward does: an error of the runtime is raised as a panic.
        run.unwrap_or_else(|e| panic!("layer '{}': {e}", self.name()))
    }
}

/// Plain `tch::nn` layers on a VarStore path.
#[derive(Debug)]
pub struct TchLayers<'a>(pub nn::Path<'a>);

impl Layers for TchLayers<'_> {
    fn linear(&self, path: &[String], i: i64, o: i64) -> Box<dyn LinearLayer> {
        let p = path.iter().fold(&self.0 / "", |p, s| p / s.as_str());
        Box::new(nn::linear(p, i, o, Default::default()))
    }
    fn embedding(&self, path: &[String], n: i64, d: i64) -> Box<dyn Module> {
        let p = path.iter().fold(&self.0 / "", |p, s| p / s.as_str());
        Box::new(nn::embedding(p, n, d, Default::default()))
    }
}

/// Stagehand's drop-in layers: each one a block streamed from host memory.
#[derive(Debug)]
pub struct StreamedLayers<'a>(pub &'a snn::ManagedVarStore);

impl Layers for StreamedLayers<'_> {
    fn linear(&self, path: &[String], i: i64, o: i64) -> Box<dyn LinearLayer> {
        let p = path.iter().fold(self.0.root(), |p, s| p / s.as_str());
        Box::new(snn::linear(p, i, o, Default::default()))
    }
    fn embedding(&self, path: &[String], n: i64, d: i64) -> Box<dyn Module> {
        let p = path.iter().fold(self.0.root(), |p, s| p / s.as_str());
        Box::new(snn::embedding(p, n, d, Default::default()))
    }
}

/// Stagehand's drop-in layers under a path of a handle (a model declared with
/// `Stagehand::model`, or the root).
#[derive(Debug)]
pub struct StreamedLayersAt<'a>(pub snn::Path<'a>);

impl Layers for StreamedLayersAt<'_> {
    fn linear(&self, path: &[String], i: i64, o: i64) -> Box<dyn LinearLayer> {
        let p = path.iter().fold(self.0.clone(), |p, s| p / s.as_str());
        Box::new(snn::linear(p, i, o, Default::default()))
    }
    fn embedding(&self, path: &[String], n: i64, d: i64) -> Box<dyn Module> {
        let p = path.iter().fold(self.0.clone(), |p, s| p / s.as_str());
        Box::new(snn::embedding(p, n, d, Default::default()))
    }
}

fn at(prefix: &[String], name: &str) -> Vec<String> {
    let mut v = prefix.to_vec();
    v.push(name.to_owned());
    v
}

/// Runs `f` on `sources`, recomputed in backward rather than stored when `scoped` (inside a
/// checkpointed block, whose own scope already recomputes everything, it simply runs).
fn scope(scoped: bool, sources: &[&Tensor], mut f: impl FnMut(&[Tensor]) -> Tensor + Send + 'static) -> Tensor {
    if scoped {
        recompute(sources, f)
    } else {
        f(&sources.iter().map(|t| t.shallow_clone()).collect::<Vec<_>>())
    }
}

/// The norm before a linear layer, recomputed in backward rather than stored: the linear saves
/// its input, which is the norm's output, and the norm's own input is saved anyway; recomputing
/// one layer norm costs less than keeping (or spilling and restoring) a tensor of the block's
/// width.
fn normed(scoped: bool, x: &Tensor) -> Tensor {
    scope(scoped, &[x], |s| norm(&s[0]))
}

/// Layer norm without learnable parameters.
fn norm(x: &Tensor) -> Tensor {
    let d = *x.size().last().expect("a norm input has a last dimension");
    x.layer_norm([d], None::<&Tensor>, None::<&Tensor>, 1e-5, false)
}

/// How a block computes attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Attention {
    /// Matmuls and a softmax, the probabilities recomputed in backward rather than stored.
    #[default]
    Recomputed,
    /// libtorch's fused scaled-dot-product attention (on CUDA in 16 bits cuDNN's or flash
    /// attention; in a checkpointed block one kernel by name, see
    /// [`fixed_kernel_attention`]): the probabilities are never materialised. What 16-bit
    /// training uses.
    Fused,
}

/// Model size.
#[derive(Debug, Clone, Copy)]
pub struct GptConfig {
    pub vocab: i64,
    pub block_size: i64,
    pub n_layer: i64,
    pub n_head: i64,
    pub n_embd: i64,
    pub attention: Attention,
    /// Each block one recompute scope (activation checkpointing): only its input is stored,
    /// and backward runs its forward again. Under a tight budget this trades one more forward
    /// on the device for the activations a block would otherwise spill over PCIe and hold in
    /// host memory. In plain tch (no activation runtime) it is the same computation.
    pub checkpoint: bool,
}

impl GptConfig {
    /// Checks the shape before anything is built: sizes above 0 (no blocks is a model too), a
    /// width its attention heads divide, and sizes within bounds far beyond any model a host
    /// holds, so that counting the parameters cannot overflow.
    pub fn check(&self) -> Result<(), String> {
        for (what, v, least, most) in [
            ("vocabulary", self.vocab, 1, 1 << 24),
            ("sequence length", self.block_size, 1, 1 << 24),
            ("blocks", self.n_layer, 0, 1 << 16),
            ("width", self.n_embd, 1, 1 << 16),
            ("attention heads", self.n_head, 1, 1 << 16),
        ] {
            if !(least..=most).contains(&v) {
                return Err(format!("{what} {v}: from {least} to {most}"));
            }
        }
        if self.n_embd % self.n_head != 0 {
            return Err(format!(
                "width {}: a multiple of its {} attention heads (16-bit precisions use heads of 128, at least 4)",
                self.n_embd, self.n_head
            ));
        }
        Ok(())
    }

    /// Parameters of the model (embeddings, blocks, head).
    pub fn parameters(&self) -> i64 {
        let d = self.n_embd;
        // qkv, proj, fc, fc_out with their biases.
        let per_block = (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d);
        self.vocab * d + self.block_size * d + self.n_layer * per_block + d * self.vocab + self.vocab
    }

    /// The model as it trains in `p`. Under 16-bit precisions attention is libtorch's fused
    /// kernel (flash attention on CUDA) with heads of 128 (at least 4 heads), as 16-bit training
    /// runs it, and each block is checkpointed: a 16-bit step is 7-9x shorter on the device than
    /// a float32 one, so the host's memory (the optimizer's pass, the copies) is the wall, and
    /// computing a block again in backward costs less than spilling its activations and bringing
    /// them back through that memory. In float32 and tf32 the blocks are not checkpointed and
    /// the attention is as it was given.
    pub fn with_precision(mut self, p: stagehand::Precision) -> GptConfig {
        self.checkpoint = p.is_mixed();
        if p.is_mixed() {
            self.attention = Attention::Fused;
            self.n_head = (self.n_embd / 128).max(4);
        }
        self
    }
}

/// One transformer block: `x + attn(ln1(x))`, then `x + mlp(ln2(x))`.
#[derive(Debug)]
pub struct Block {
    qkv: Box<dyn LinearLayer>,
    proj: Box<dyn LinearLayer>,
    fc: Box<dyn LinearLayer>,
    fc_out: Box<dyn LinearLayer>,
    math: BlockMath,
    checkpoint: bool,
}

impl Block {
    /// Block layers at `path` (e.g. `["blocks", "3"]`).
    pub fn new(layers: &dyn Layers, path: &[String], cfg: &GptConfig) -> Block {
        let d = cfg.n_embd;
        Block {
            qkv: layers.linear(&at(path, "qkv"), d, 3 * d),
            proj: layers.linear(&at(path, "proj"), d, d),
            fc: layers.linear(&at(path, "fc"), d, 4 * d),
            fc_out: layers.linear(&at(path, "fc_out"), 4 * d, d),
            math: BlockMath { n_head: cfg.n_head, attention: cfg.attention, scoped: true },
            checkpoint: cfg.checkpoint,
        }
    }

    /// The block as one recompute scope over its input and the four layers' weights and
    /// biases, which backward's recomputation gets back resident.
    fn checkpointed(&self, x: &Tensor) -> Tensor {
        let math = BlockMath { scoped: false, ..self.math };
        self.qkv.with_params(&mut |a| {
            self.proj.with_params(&mut |b| {
                self.fc.with_params(&mut |c| {
                    self.fc_out.with_params(&mut |d| {
                        let sources: Vec<&Tensor> = std::iter::once(x).chain(a).chain(b).chain(c).chain(d).collect();
                        recompute(&sources, move |s| {
                            let linear = |i: usize, h: &Tensor| h.linear(&s[1 + 2 * i], Some(&s[2 + 2 * i]));
                            math.forward(&s[0], &linear)
                        })
                    })
                })
            })
        })
    }
}

/// The block's computation, given its linear layers (0: qkv, 1: proj, 2: fc, 3: fc_out).
#[derive(Debug, Clone, Copy)]
struct BlockMath {
    n_head: i64,
    attention: Attention,
    /// The norms, attention probabilities and activation in recompute scopes of their own.
    scoped: bool,
}

impl BlockMath {
    fn forward(&self, x: &Tensor, linear: &dyn Fn(usize, &Tensor) -> Tensor) -> Tensor {
        let x = x + self.attention(&normed(self.scoped, x), linear);
        // The activation's output is as large as its input and elementwise to recompute.
        let h = scope(self.scoped, &[&linear(2, &normed(self.scoped, &x))], |s| s[0].gelu("tanh"));
        &x + linear(3, &h)
    }

    fn attention(&self, x: &Tensor, linear: &dyn Fn(usize, &Tensor) -> Tensor) -> Tensor {
        let (b, t, c) = x.size3().expect("block input is (batch, time, channels)");
        let hd = c / self.n_head;
        let qkv = linear(0, x).view([b, t, 3, self.n_head, hd]);
        let q = qkv.select(2, 0).transpose(1, 2);
        let k = qkv.select(2, 1).transpose(1, 2);
        let v = qkv.select(2, 2).transpose(1, 2);
        if self.attention == Attention::Fused {
            let y = if self.scoped {
                Tensor::scaled_dot_product_attention(&q, &k, &v, None::<&Tensor>, 0.0, true, None, false)
            } else {
                // Inside a checkpointed block, one fixed kernel: on CUDA libtorch's dispatcher
                // may pick another backend for the same call on backward's thread (seen on the
                // second GPU of a group: cuDNN's in backward after the efficient kernel in the
                // forward), and a recomputation that saves other tensors than the forward did
                // is refused.
                fixed_kernel_attention(&q, &k, &v, true).expect("attention")
            };
            return linear(1, &y.transpose(1, 2).contiguous().view([b, t, c]));
        }
        let scale = 1.0 / (hd as f64).sqrt();
        // The probabilities are the block's largest activation (batch x heads x t x t) and cost
        // one batched matmul to compute again: recomputed in backward, not stored.
        let att = scope(self.scoped, &[&q, &k], move |s| {
            let att = s[0].matmul(&s[1].transpose(-2, -1)) * scale;
            let mask = Tensor::ones([t, t], (Kind::Bool, att.device())).tril(0);
            att.masked_fill(&mask.logical_not(), f64::NEG_INFINITY).softmax(-1, att.kind())
        });
        let y = att.matmul(&v);
        linear(1, &y.transpose(1, 2).contiguous().view([b, t, c]))
    }
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> Tensor {
        if self.checkpoint {
            return self.checkpointed(x);
        }
        let layers = [&self.qkv, &self.proj, &self.fc, &self.fc_out];
        self.math.forward(x, &|i, h| layers[i].forward(h))
    }
}

/// The whole model.
#[derive(Debug)]
pub struct Gpt {
    pub cfg: GptConfig,
    tok: Box<dyn Module>,
    pos: Box<dyn Module>,
    pub blocks: Vec<Block>,
    head: Box<dyn Module>,
}

impl Gpt {
    /// Builds the model from `layers`; block `i`'s layers live at `blocks.i.*`.
    pub fn new(layers: &dyn Layers, cfg: GptConfig) -> Gpt {
        let d = cfg.n_embd;
        let name = |s: &str| vec![s.to_owned()];
        Gpt {
            cfg,
            tok: layers.embedding(&name("tok"), cfg.vocab, d),
            pos: layers.embedding(&name("pos"), cfg.block_size, d),
            blocks: (0..cfg.n_layer)
                .map(|i| Block::new(layers, &["blocks".to_owned(), i.to_string()], &cfg))
                .collect(),
            head: layers.linear(&name("head"), d, cfg.vocab),
        }
    }

    /// Embeddings of a batch of token ids `(batch, time)`.
    pub fn embed(&self, idx: &Tensor) -> Tensor {
        let t = idx.size()[1];
        let pos = Tensor::arange(t, (Kind::Int64, idx.device()));
        self.tok.forward(idx) + self.pos.forward(&pos)
    }

    /// Logits from the output of the last block.
    pub fn logits(&self, x: &Tensor) -> Tensor {
        self.head.forward(&norm(x))
    }

    /// Cross-entropy of next-token prediction.
    pub fn loss(logits: &Tensor, targets: &Tensor) -> Tensor {
        let v = logits.size()[2];
        logits
            .view([-1, v])
            .cross_entropy_for_logits(&targets.reshape([-1]))
    }
}

impl Module for Gpt {
    fn forward(&self, idx: &Tensor) -> Tensor {
        let x = self
            .blocks
            .iter()
            .fold(self.embed(idx), |x, b| b.forward(&x));
        self.logits(&x)
    }
}
