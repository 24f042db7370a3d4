#![doc = include_str!("../README.md")]

pub mod app;
pub mod keys;
pub mod source;
pub mod theme;
pub mod views;
