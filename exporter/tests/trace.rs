//! The `stagehand-trace` binary on recorded runs: a valid trace, written only on success and
//! never over its input.

use serde_json::Value;
use stagehand::events::jsonl::{JsonlSink, OpenMode};
use stagehand::events::synthetic::{self, SyntheticRun};
use stagehand::events::EventSink;
use stagehand_exporter::trace::{validate, COMPUTE_TID, D2H_TID, H2D_TID};
use std::path::Path;
use std::process::{Command, Output};

fn write_run(path: &Path, steps: u64) -> Vec<stagehand::events::Event> {
    let events = synthetic::events(SyntheticRun::finished(steps));
    let mut sink = JsonlSink::open(path, OpenMode::CreateNew).expect("opens");
    for e in &events {
        sink.on_event(e);
    }
    sink.flush();
    events
}

fn trace_cmd(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_stagehand-trace")).args(args).output().expect("runs")
}

#[test]
fn cli_converts_a_telemetry_file_into_a_valid_trace() {
    let dir = tempfile::tempdir().expect("tempdir");
    let input = dir.path().join("run.jsonl");
    let events = write_run(&input, 3);
    let out = dir.path().join("run.trace.json");
    let o = trace_cmd(&[input.as_os_str(), "-o".as_ref(), out.as_os_str()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
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
    let completed = events.iter().filter(|e| e.kind.name() == "transfer_completed").count();
    assert_eq!(count(&|e| e["ph"] == "X" && e["cat"] == "transfer"), completed);
    assert!(count(&|e| e["ph"] == "C" && e["name"] == "VRAM") > 10);
    assert!(count(&|e| e["ph"] == "C" && e["name"] == "VRAM by owner") > 10);
    assert_eq!(count(&|e| e["ph"] == "C" && e["name"] == "step time (ms)"), 3);
    assert!(count(&|e| e["ph"] == "C" && e["name"] == "activation pool") > 0);
    assert!(count(&|e| e["ph"] == "i" && e["name"] == "events dropped") > 0);
    // The default output name, beside the input.
    let o = trace_cmd(&[input.as_os_str()]);
    assert!(o.status.success());
    assert!(dir.path().join("run.jsonl.trace.json").exists());
}

#[test]
fn the_input_is_never_overwritten() {
    let dir = tempfile::tempdir().expect("tempdir");
    let input = dir.path().join("run.jsonl");
    write_run(&input, 1);
    let before = std::fs::read(&input).expect("reads");
    let link = dir.path().join("alias.jsonl");
    std::fs::hard_link(&input, &link).expect("links");
    let dotted = dir.path().join(".").join("run.jsonl");
    for out in [input.as_os_str(), link.as_os_str(), dotted.as_os_str()] {
        let o = trace_cmd(&[input.as_os_str(), "-o".as_ref(), out]);
        assert!(!o.status.success(), "wrote over its input via {out:?}");
        assert!(String::from_utf8_lossy(&o.stderr).contains("refusing"), "{}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(std::fs::read(&input).expect("reads"), before, "the telemetry is intact");
    }
}

#[test]
fn a_failed_conversion_leaves_nothing_behind() {
    let dir = tempfile::tempdir().expect("tempdir");
    let listing = |d: &Path| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d).expect("lists").map(|e| e.expect("entry").file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    };
    // A missing input.
    let o = trace_cmd(&[dir.path().join("missing.jsonl").as_os_str()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("missing.jsonl"));
    assert!(listing(dir.path()).is_empty(), "{:?}", listing(dir.path()));
    // An input with no events: an error, not an empty trace; an older trace stays as it was.
    let junk = dir.path().join("junk.jsonl");
    std::fs::write(&junk, "not telemetry\n{\"also\": \"not\"}\n").expect("writes");
    let old = dir.path().join("junk.jsonl.trace.json");
    std::fs::write(&old, "older trace").expect("writes");
    let o = trace_cmd(&[junk.as_os_str()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("no events"), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(std::fs::read_to_string(&old).expect("reads"), "older trace");
    // A read error part way (a folder given as the file).
    let folder = dir.path().join("folder.jsonl");
    std::fs::create_dir(&folder).expect("mkdir");
    let o = trace_cmd(&[folder.as_os_str(), "-o".as_ref(), dir.path().join("f.trace.json").as_os_str()]);
    assert!(!o.status.success());
    assert_eq!(listing(dir.path()), ["folder.jsonl", "junk.jsonl", "junk.jsonl.trace.json"]);
}

#[test]
fn usage_errors_exit_2() {
    let o = trace_cmd(&["--bogus".as_ref()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("usage"));
}
