//! Real tch training loops wrapped with Stagehand: the model, data and loop they share.

pub mod data;
pub mod floors;
pub mod gpt;
pub mod process;
pub mod report;
pub mod trainer;
pub mod watch;
