//! Real tch training loops wrapped with Stagehand: the model and data they share.

pub mod data;
pub mod gpt;
