//! Training data the examples generate themselves: sequences that follow a rule a small model
//! can learn (arithmetic progressions modulo the vocabulary, with random starts and strides), so
//! the loss visibly falls within a few hundred steps without downloading anything.

use tch::{Device, Kind, Tensor};

/// A batch of inputs and next-token targets, both `(batch, block_size)` int64.
#[derive(Debug)]
pub struct Batch {
    pub inputs: Tensor,
    pub targets: Tensor,
}

/// Draws a batch: token `t` of a sequence is `(start + t * stride) mod vocab`.
pub fn progression_batch(batch: i64, block_size: i64, vocab: i64, device: Device) -> Batch {
    let opts = (Kind::Int64, Device::Cpu);
    let start = Tensor::randint(vocab, [batch, 1], opts);
    let stride = Tensor::randint(7, [batch, 1], opts) + 1;
    let t = Tensor::arange(block_size + 1, opts).unsqueeze(0);
    let seq = (start + t * stride).remainder(vocab);
    Batch {
        inputs: seq.narrow(1, 0, block_size).to_device(device),
        targets: seq.narrow(1, 1, block_size).to_device(device),
    }
}
