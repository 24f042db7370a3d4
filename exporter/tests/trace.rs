//! The `stagehand-trace` binary on recorded runs: a valid trace, written only on success and
//! never over its input.

use serde_json::Value;
use stagehand_events::jsonl::{JsonlSink, OpenMode};
use stagehand_events::synthetic::{self, SyntheticRun};
use stagehand_events::EventSink;
use stagehand_exporter::trace::{validate, COMPUTE_TID, D2H_TID, H2D_TID};
use std::path::Path;
use std::process::{Command, Output};

fn write_run(path: &Path, steps: u64) -> Vec<stagehand_events::Event> {
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

fn is_root() -> bool {
    Command::new("id").arg("-u").output().map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0").unwrap_or(false)
}

fn mkfifo(path: &Path) -> bool {
    Command::new("mkfifo").arg(path).status().is_ok_and(|s| s.success())
}

fn file_type(path: &Path) -> std::fs::FileType {
    std::fs::symlink_metadata(path).expect("exists").file_type()
}

#[test]
fn devices_pipes_and_links_are_written_through_never_replaced() {
    use std::os::unix::fs::FileTypeExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let input = dir.path().join("run.jsonl");
    write_run(&input, 2);
    // A device node like /dev/null (made privately: needs root, as the breakage did).
    if is_root() {
        let null = dir.path().join("null");
        assert!(Command::new("mknod").args([null.as_os_str(), "c".as_ref(), "1".as_ref(), "3".as_ref()]).status().expect("mknod").success());
        let o = trace_cmd(&[input.as_os_str(), "-o".as_ref(), null.as_os_str()]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        assert!(file_type(&null).is_char_device(), "the device node is still a device");
    } else {
        eprintln!("skipped the device node: not root");
    }
    // A pipe: the trace goes through it, and it stays a pipe.
    let fifo = dir.path().join("pipe");
    if mkfifo(&fifo) {
        let reader = {
            let fifo = fifo.clone();
            std::thread::spawn(move || std::fs::read(&fifo).expect("reads the pipe"))
        };
        let o = trace_cmd(&[input.as_os_str(), "-o".as_ref(), fifo.as_os_str()]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let got = reader.join().expect("reader");
        validate(&serde_json::from_slice(&got).expect("json through the pipe")).expect("valid trace");
        assert!(file_type(&fifo).is_fifo(), "the pipe is still a pipe");
    }
    // A link to standard output: written through, the link stays a link.
    let to_stdout = dir.path().join("out-link");
    std::os::unix::fs::symlink("/dev/stdout", &to_stdout).expect("symlink");
    let o = trace_cmd(&[input.as_os_str(), "-o".as_ref(), to_stdout.as_os_str()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    validate(&serde_json::from_slice(&o.stdout).expect("json on stdout")).expect("valid trace");
    assert!(file_type(&to_stdout).is_symlink());
    // A link to a regular file: the file is replaced, the link is kept.
    let real = dir.path().join("real.trace.json");
    std::fs::write(&real, "old").expect("write");
    let link = dir.path().join("link.trace.json");
    std::os::unix::fs::symlink(&real, &link).expect("symlink");
    let o = trace_cmd(&[input.as_os_str(), "-o".as_ref(), link.as_os_str()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(file_type(&link).is_symlink(), "the link is kept");
    validate(&serde_json::from_slice(&std::fs::read(&real).expect("read")).expect("json")).expect("valid trace");
    // A dangling link and a folder are refused with a word.
    let dangling = dir.path().join("dangling");
    std::os::unix::fs::symlink(dir.path().join("nowhere/x"), &dangling).expect("symlink");
    let o = trace_cmd(&[input.as_os_str(), "-o".as_ref(), dangling.as_os_str()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(file_type(&dangling).is_symlink());
    let o = trace_cmd(&[input.as_os_str(), "-o".as_ref(), dir.path().as_os_str()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("folder"), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn an_interrupted_conversion_leaves_no_temporary_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fifo = dir.path().join("slow.jsonl");
    if !mkfifo(&fifo) {
        eprintln!("skipped: no mkfifo");
        return;
    }
    let out = dir.path().join("out.trace.json");
    for signal in ["INT", "TERM"] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_stagehand-trace"))
            .args([fifo.as_os_str(), "-o".as_ref(), out.as_os_str()])
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("starts");
        // The input comes slowly: the conversion is under way when the signal comes.
        let mut w = std::fs::OpenOptions::new().write(true).open(&fifo).expect("opens the pipe");
        let events = synthetic::events(SyntheticRun::finished(1));
        for e in &events[..20] {
            std::io::Write::write_all(&mut w, (serde_json::to_string(e).expect("json") + "\n").as_bytes()).expect("writes");
        }
        let limit = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let tmp = || std::fs::read_dir(dir.path()).expect("lists").flatten().any(|e| e.file_name().to_string_lossy().ends_with(".tmp"));
        while !tmp() {
            assert!(std::time::Instant::now() < limit, "no temporary file appeared");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(Command::new("kill").args([format!("-{signal}"), child.id().to_string()]).status().expect("kill").success());
        let status = child.wait().expect("waits");
        drop(w);
        assert_eq!(status.code(), Some(130), "SIG{signal}");
        assert!(!tmp(), "SIG{signal} left a temporary file");
        assert!(!out.exists(), "SIG{signal} left an output");
    }
}

#[test]
fn blank_line_floods_are_reported_and_bounded() {
    let dir = tempfile::tempdir().expect("tempdir");
    let input = dir.path().join("blank.jsonl");
    let events = synthetic::events(SyntheticRun::finished(1));
    let mut text = vec![b'\n'; 8 << 20];
    for e in &events {
        text.extend_from_slice((serde_json::to_string(e).expect("json") + "\n").as_bytes());
    }
    std::fs::write(&input, &text).expect("write");
    let o = trace_cmd(&[input.as_os_str(), "-o".as_ref(), dir.path().join("a.json").as_os_str()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains(&format!("{} blank lines", 8 << 20)), "{}", String::from_utf8_lossy(&o.stderr));
    // A flood past the bound ends the read with an error, and leaves no trace.
    let mut flood = vec![b'\n'; 80 << 20];
    flood.extend_from_slice(&text[8 << 20..]);
    std::fs::write(&input, &flood).expect("write");
    let out = dir.path().join("b.json");
    let o = trace_cmd(&[input.as_os_str(), "-o".as_ref(), out.as_os_str()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("no telemetry in"), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!out.exists());
}
