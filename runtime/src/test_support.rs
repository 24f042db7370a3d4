//! What the crate's unit tests share.

use crate::events::{Event, EventSink};
use std::sync::{Arc, Mutex};

/// Collects every event the bus delivers.
#[derive(Clone, Default)]
pub(crate) struct Collect(pub(crate) Arc<Mutex<Vec<Event>>>);

impl EventSink for Collect {
    fn on_event(&mut self, e: &Event) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).push(e.clone());
    }
}
