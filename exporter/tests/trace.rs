//! The trace converter on a recorded run, through the `stagehand-trace` binary, checked against
//! the Trace Event Format's rules.

use serde_json::Value;
use stagehand::events::jsonl::{JsonlSink, OpenMode};
use stagehand::events::EventSink;
use stagehand::events::synthetic::{self, SyntheticRun};
use stagehand_exporter::trace::{validate, COMPUTE_TID, D2H_TID, H2D_TID};

#[test]
fn cli_converts_a_telemetry_file_into_a_valid_trace() {
    let dir = tempfile::tempdir().expect("tempdir");
    let input = dir.path().join("run.jsonl");
    let events = synthetic::events(SyntheticRun::finished(3));
    {
        let mut sink = JsonlSink::open(&input, OpenMode::CreateNew).expect("opens");
        for e in &events {
            sink.on_event(e);
        }
        sink.flush();
    }
    let out = dir.path().join("run.trace.json");
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_stagehand-trace"))
        .arg(&input)
        .arg("-o")
        .arg(&out)
        .status()
        .expect("runs");
    assert!(status.success());
    let trace: Value = serde_json::from_slice(&std::fs::read(&out).expect("written")).expect("json");
    validate(&trace).expect("valid trace");
    let evs = trace["traceEvents"].as_array().expect("array");
    let thread = |tid: u64| {
        evs.iter()
            .find(|e| e["ph"] == "M" && e["name"] == "thread_name" && e["tid"] == tid)
            .map(|e| e["args"]["name"].as_str().unwrap_or("").to_owned())
    };
    assert_eq!(thread(COMPUTE_TID).as_deref(), Some("compute"));
    assert_eq!(thread(H2D_TID).as_deref(), Some("H2D"));
    assert_eq!(thread(D2H_TID).as_deref(), Some("D2H"));
    let count = |f: &dyn Fn(&Value) -> bool| evs.iter().filter(|e| f(e)).count();
    assert_eq!(count(&|e| e["ph"] == "X" && e["cat"] == "step"), 3);
    assert_eq!(count(&|e| e["ph"] == "X" && e["cat"] == "phase"), 15);
    let completed = events
        .iter()
        .filter(|e| e.kind.name() == "transfer_completed")
        .count();
    assert_eq!(count(&|e| e["ph"] == "X" && e["cat"] == "transfer"), completed);
    assert!(count(&|e| e["ph"] == "C" && e["name"] == "VRAM") > 10);
    assert!(count(&|e| e["ph"] == "C" && e["name"] == "activation pool") > 0);

    // A missing file is a clear error, not a panic.
    let bad = std::process::Command::new(env!("CARGO_BIN_EXE_stagehand-trace"))
        .arg(dir.path().join("missing.jsonl"))
        .output()
        .expect("runs");
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("missing.jsonl"));
}
