#![doc = include_str!("../README.md")]

pub mod conductor;
pub mod events;
