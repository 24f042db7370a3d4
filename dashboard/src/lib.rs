#![doc = include_str!("../README.md")]

pub mod app;
pub mod filter;
pub mod format;
pub mod keys;
pub mod sort;
pub mod source;
pub mod theme;
pub mod views;
