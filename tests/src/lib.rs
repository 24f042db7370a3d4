//! End-to-end tests across the Stagehand crates live in `tests/`; this library is empty.
