//! A small GPT in the style of tch's own examples (min-GPT): token and position embeddings, a
//! stack of pre-norm blocks with causal self-attention and an MLP, and a language-model head.

use tch::nn::{self, Module};
use tch::{Kind, Tensor};

/// Model size.
#[derive(Debug, Clone, Copy)]
pub struct GptConfig {
    pub vocab: i64,
    pub block_size: i64,
    pub n_layer: i64,
    pub n_head: i64,
    pub n_embd: i64,
}

impl GptConfig {
    /// Parameters of the model (embeddings, blocks, head).
    pub fn parameters(&self) -> i64 {
        let d = self.n_embd;
        let per_block = 4 * d * d + 4 * d + 2 * (4 * d * d) + 4 * d + d + 4 * d;
        self.vocab * d + self.block_size * d + self.n_layer * per_block + 2 * d + d * self.vocab
    }
}

/// One transformer block: `x + attn(ln1(x))`, then `x + mlp(ln2(x))`.
#[derive(Debug)]
pub struct Block {
    ln1: nn::LayerNorm,
    ln2: nn::LayerNorm,
    qkv: nn::Linear,
    proj: nn::Linear,
    fc: nn::Linear,
    fc_out: nn::Linear,
    n_head: i64,
}

impl Block {
    pub fn new(p: &nn::Path<'_>, cfg: &GptConfig) -> Block {
        let d = cfg.n_embd;
        Block {
            ln1: nn::layer_norm(p / "ln1", vec![d], Default::default()),
            ln2: nn::layer_norm(p / "ln2", vec![d], Default::default()),
            qkv: nn::linear(p / "qkv", d, 3 * d, Default::default()),
            proj: nn::linear(p / "proj", d, d, Default::default()),
            fc: nn::linear(p / "fc", d, 4 * d, Default::default()),
            fc_out: nn::linear(p / "fc_out", 4 * d, d, Default::default()),
            n_head: cfg.n_head,
        }
    }

    fn attention(&self, x: &Tensor) -> Tensor {
        let (b, t, c) = x.size3().expect("block input is (batch, time, channels)");
        let hd = c / self.n_head;
        let qkv = self.qkv.forward(x).view([b, t, 3, self.n_head, hd]);
        let q = qkv.select(2, 0).transpose(1, 2);
        let k = qkv.select(2, 1).transpose(1, 2);
        let v = qkv.select(2, 2).transpose(1, 2);
        let att = q.matmul(&k.transpose(-2, -1)) * (1.0 / (hd as f64).sqrt());
        let mask = Tensor::ones([t, t], (Kind::Bool, x.device())).tril(0);
        let att = att.masked_fill(&mask.logical_not(), f64::NEG_INFINITY);
        let y = att.softmax(-1, att.kind()).matmul(&v);
        self.proj.forward(&y.transpose(1, 2).contiguous().view([b, t, c]))
    }
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> Tensor {
        let x = x + self.attention(&self.ln1.forward(x));
        let h = self.fc.forward(&self.ln2.forward(&x)).gelu("tanh");
        &x + self.fc_out.forward(&h)
    }
}

/// The whole model.
#[derive(Debug)]
pub struct Gpt {
    pub cfg: GptConfig,
    tok: nn::Embedding,
    pos: nn::Embedding,
    pub blocks: Vec<Block>,
    ln_f: nn::LayerNorm,
    head: nn::Linear,
}

impl Gpt {
    /// Builds the model under `p`; block `i` lives at `blocks.i`.
    pub fn new(p: &nn::Path<'_>, cfg: GptConfig) -> Gpt {
        let d = cfg.n_embd;
        Gpt {
            cfg,
            tok: nn::embedding(p / "tok", cfg.vocab, d, Default::default()),
            pos: nn::embedding(p / "pos", cfg.block_size, d, Default::default()),
            blocks: (0..cfg.n_layer)
                .map(|i| Block::new(&(p / "blocks" / i), &cfg))
                .collect(),
            ln_f: nn::layer_norm(p / "ln_f", vec![d], Default::default()),
            head: nn::linear(p / "head", d, cfg.vocab, Default::default()),
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
        self.head.forward(&self.ln_f.forward(x))
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
