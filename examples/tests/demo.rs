//! The demo's printed commands run as printed: the dashboard and metrics addresses answer, the
//! live `stagehand-top --connect ...` shows the run, and after the run the `--replay` and
//! `stagehand-trace` commands open the (compressed) telemetry file. The run's configuration is
//! structured JSON on /api/run.

use portable_pty::{native_pty_system, CommandBuilder, PtySize};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const DEMO: &str = env!("CARGO_BIN_EXE_stagehand-demo");

// The web crate's test client and WebDriver, to open the printed address in a real browser.
#[path = "../../web/tests/http/mod.rs"]
mod http;
#[path = "../../web/tests/webdriver/mod.rs"]
mod webdriver;

/// GET `url` (http://HOST:PORT/PATH?QUERY), with the token when there is one: status and the
/// whole answer (head and body).
fn get(url: &str, token: Option<&str>) -> (u16, String) {
    let rest = url.strip_prefix("http://").expect("an http URL");
    let (host, path) = rest.split_once('/').map_or((rest, "/".to_owned()), |(h, p)| (h, format!("/{p}")));
    let mut s = TcpStream::connect(host).expect("connects");
    s.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
    let auth = token.map(|t| format!("authorization: Bearer {t}\r\n")).unwrap_or_default();
    write!(s, "GET {path} HTTP/1.1\r\nhost: {host}\r\n{auth}connection: close\r\n\r\n").expect("sends");
    let mut text = String::new();
    s.read_to_string(&mut text).expect("reads");
    let status = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, text)
}

/// The command printed after `label`, split into words.
fn command(lines: &[String], label: &str) -> Vec<String> {
    let line = lines
        .iter()
        .find(|l| l.trim_start().starts_with(label))
        .unwrap_or_else(|| panic!("the demo printed no '{label}' line: {lines:#?}"));
    line.trim_start()[label.len()..].split_whitespace().map(str::to_owned).collect()
}

/// Whether a printed program can run here at once: a path that exists, or a name found on PATH
/// (not `cargo run`, which the demo prints when the program is not built: it would build it).
fn runnable(program: &str) -> bool {
    if program == "cargo" {
        return false;
    }
    if program.contains('/') {
        return Path::new(program).exists();
    }
    std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(program).exists()))
}

/// The leading `NAME=VALUE` words of a printed command, and the command after them.
fn env_and_words(words: &[String]) -> (Vec<(String, String)>, Vec<String>) {
    let n = words.iter().take_while(|w| w.split_once('=').is_some_and(|(k, _)| !k.is_empty() && !k.contains('/'))).count();
    let env = words[..n].iter().filter_map(|w| w.split_once('=')).map(|(k, v)| (k.to_owned(), v.to_owned())).collect();
    (env, words[n..].to_vec())
}

/// Runs `words` in a pseudo-terminal until its screen shows `text`, then presses `q` and expects
/// a clean exit.
fn tui_shows(words: &[String], cwd: &Path, text: &str) {
    tui_walk(words, cwd, &[(b"", text)]);
}

/// Runs `words` in a pseudo-terminal; for each step presses its keys and waits until the screen
/// shows its text; then presses `q` and expects a clean exit.
fn tui_walk(words: &[String], cwd: &Path, steps: &[(&[u8], &str)]) {
    let pair = native_pty_system()
        .openpty(PtySize { rows: 40, cols: 120, pixel_width: 0, pixel_height: 0 })
        .expect("opens a pty");
    // `NAME=VALUE` words before the program set its environment, as a shell does.
    let (env, words) = env_and_words(words);
    let mut cmd = CommandBuilder::new(&words[0]);
    cmd.args(&words[1..]);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.cwd(cwd);
    cmd.env("TERM", "xterm-256color");
    let mut child = pair.slave.spawn_command(cmd).expect("starts the program");
    drop(pair.slave);
    let mut reader = pair.master.try_clone_reader().expect("pty reader");
    let mut writer = pair.master.take_writer().expect("pty writer");
    let screen = Arc::new(Mutex::new(vt100::Parser::new(40, 120, 0)));
    let s = screen.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 8192];
        while let Ok(n) = reader.read(&mut buf) {
            if n == 0 {
                break;
            }
            s.lock().expect("screen").process(&buf[..n]);
        }
    });
    let limit = Instant::now() + Duration::from_secs(60);
    for (keys, text) in steps {
        writer.write_all(keys).expect("presses keys");
        writer.flush().expect("flushes");
        loop {
            let c = screen.lock().expect("screen").screen().contents();
            if c.contains(text) {
                break;
            }
            assert!(child.try_wait().expect("status").is_none(), "{words:?} exited early:\n{c}");
            assert!(Instant::now() < limit, "{words:?} never showed '{text}':\n{c}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    writer.write_all(b"q").expect("presses q");
    writer.flush().expect("flushes");
    let status = loop {
        if let Some(s) = child.try_wait().expect("status") {
            break s;
        }
        assert!(Instant::now() < limit, "{words:?} did not quit on q");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{words:?}: {status:?}");
}

#[test]
fn every_printed_command_runs_as_printed() {
    printed_commands_run(&[]);
}

#[test]
fn with_a_token_the_printed_addresses_carry_it() {
    printed_commands_run(&["--random-token"]);
}

fn printed_commands_run(extra: &[&str]) {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut demo = Command::new(DEMO)
        .args(["--steps", "4", "--layers", "2", "--d-model", "32", "--seq", "8", "--batch", "2"])
        .args(["--budget-mib", "4", "--cpu", "--addr", "127.0.0.1:0", "--compress", "--keep-serving"])
        .args(extra)
        .current_dir(dir.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("the demo starts");
    let mut lines = Vec::new();
    let mut out = BufReader::new(demo.stdout.take().expect("stdout")).lines();
    while !lines.last().is_some_and(|l: &String| l.starts_with("serving ")) {
        lines.push(out.next().expect("the demo prints until it serves").expect("a line"));
    }

    // While it serves: the addresses answer, and the live TUI shows the finished run.
    let dashboard = command(&lines, "dashboard");
    // The page's address works as printed: the page (with a token, the token is in the
    // address's fragment, which the browser keeps to the page: never a cookie).
    let (page_url, token) = match dashboard[0].split_once("#token=") {
        Some((u, t)) => (u.to_owned(), Some(t.to_owned())),
        None => (dashboard[0].clone(), None),
    };
    assert_eq!(token.is_some(), !extra.is_empty(), "{dashboard:?}");
    let (status, page) = get(&page_url, None);
    assert_eq!(status, 200, "{page}");
    assert!(!page.to_ascii_lowercase().contains("set-cookie"), "{page}");
    let metrics = command(&lines, "metrics");
    if let Some(t) = &token {
        assert!(metrics.join(" ").contains(&format!("'Authorization: Bearer {t}'")), "{metrics:?}");
        assert_eq!(get(&metrics[0], None).0, 401, "the token is needed");
    }
    let (status, body) = get(&metrics[0], token.as_deref());
    let step = body.lines().find(|l| l.starts_with("stagehand_step{")).and_then(|l| l.rsplit(' ').next());
    assert_eq!((status, step), (200, Some("4")), "{body}");
    let base = metrics[0].trim_end_matches("/metrics");
    // The plan printed before the first step; the summary's figures are the page's.
    let at = |head: &str| lines.iter().position(|l| l.trim_start().starts_with(head)).unwrap_or_else(|| panic!("no '{head}' in {lines:#?}"));
    assert!(at("plan") < at("step 1 traced") && at("step 1 traced") < at("summary"), "{lines:#?}");
    let (_, view) = get(&format!("{base}/api/view"), token.as_deref());
    let view: serde_json::Value = serde_json::from_str(view.split_once("\r\n\r\n").map_or("", |(_, b)| b)).expect("/api/view is JSON");
    let view = &view["view"];
    let mib = |b: &serde_json::Value| format!("{:.1} MiB", b.as_u64().expect("bytes") as f64 / (1u64 << 20) as f64);
    let line = |head: &str| lines[at(head)].clone();
    assert!(line("peak VRAM").contains(&format!("peak VRAM  {} of", mib(&view["vram"]["peak_allocated_bytes"]))), "{lines:#?}\n{view}");
    let r = &view["residency"];
    assert!(line("weights").contains(&format!("{} prefetch hits, {} misses", r["prefetch_hits"], r["prefetch_misses"])), "{lines:#?}");
    let t = &view["transfers"];
    assert!(line("moved").contains(&format!("{} H2D, {} D2H", mib(&t["h2d"]["bytes"]), mib(&t["d2h"]["bytes"]))), "{lines:#?}");
    let (_, run) = get(&format!("{base}/api/run"), token.as_deref());
    let run = run.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    let run: serde_json::Value = serde_json::from_str(run).expect("/api/run is JSON");
    let memory = &run["run"]["config"]["memory"];
    assert!(memory.is_object() && memory["mode"] == "stagehand", "structured: {run}");
    assert_eq!(run["run"]["config"]["telemetry"]["level"], "summary", "{run}");
    // The printed address in a real browser: the finished run with its time and VRAM breakdowns.
    if token.is_none() {
        if let Some((chromium, chromedriver)) = webdriver::browser() {
            let profile = tempfile::tempdir().expect("profile dir");
            let driver = webdriver::Driver::start(&chromium, &chromedriver, profile.path());
            driver.open(&dashboard[0]);
            let f = driver.wait_for("the finished run", |f| {
                f.get("run-ended").map(String::as_str) == Some("true") && f.get("step").map(String::as_str) == Some("4")
            });
            let number = |k: &str| f.get(k).and_then(|v| v.parse::<f64>().ok()).unwrap_or_else(|| panic!("{k}: {f:#?}"));
            assert_eq!(f["time-step"], "4", "the breakdown of the last step");
            assert!(number("time-compute") > 0.0 && number("time-total") > 0.0, "{f:#?}");
            assert!(number("peak-allocated") > 0.0 && number("peak-weights") > 0.0, "VRAM by owner at the peak: {f:#?}");
        }
    }
    let live = command(&lines, "live TUI");
    let (live_env, live_words) = env_and_words(&live);
    if let Some(t) = &token {
        // The token goes in the environment, not on the command line (`ps` shows that).
        assert_eq!(live_env, [("STAGEHAND_TOKEN".to_owned(), t.clone())], "{live:?}");
        assert!(!live_words.iter().any(|w| w.contains(t.as_str())), "{live:?}");
    }
    if runnable(&live_words[0]) {
        // The run's end, then the two questions the screens answer: where each step's time went
        // and who holds the VRAM.
        tui_walk(
            &live,
            dir.path(),
            &[(b"", "(ended)"), (b"2", "where the time went"), (b"2", "compute"), (b"3", "By owner"), (b"3", "kept acts")],
        );
    } else {
        eprintln!("skipping the live TUI command: '{}' is not built (cargo build -p stagehand-dashboard)", live_words[0]);
    }
    demo.stdin.take().expect("stdin").write_all(b"\n").expect("presses Enter");
    let rest: Vec<String> = out.map(|l| l.expect("a line")).collect();
    assert!(demo.wait().expect("exits").success(), "{lines:#?}\n{rest:#?}");

    // After the run: the file commands open what it wrote.
    let replay = command(&lines, "replay it");
    let file = dir.path().join(replay.last().expect("a file"));
    assert!(file.to_string_lossy().ends_with(".jsonl.zst") && file.exists(), "{replay:?}");
    if runnable(&replay[0]) {
        // It plays at recorded speed: the short run reaches its end at once.
        tui_shows(&replay, dir.path(), "(ended)");
    } else {
        eprintln!("skipping the replay command: '{}' is not built (cargo build -p stagehand-dashboard)", replay[0]);
    }
    let trace = command(&lines, "trace it");
    if runnable(&trace[0]) {
        let o = Command::new(&trace[0]).args(&trace[1..]).current_dir(dir.path()).output().expect("runs");
        assert!(o.status.success(), "{trace:?}: {}", String::from_utf8_lossy(&o.stderr));
        let json = std::fs::read(format!("{}.trace.json", file.display())).expect("the trace is written");
        let json: serde_json::Value = serde_json::from_slice(&json).expect("trace json");
        stagehand_exporter::trace::validate(&json).expect("a valid trace");
    } else {
        eprintln!("skipping the trace command: '{}' is not built (cargo build -p stagehand-exporter)", trace[0]);
    }
}

/// Sends `signal` (a name `kill` knows) to `pid`.
fn signal(pid: u32, signal: &str) {
    let ok = Command::new("kill").args([&format!("-{signal}"), &pid.to_string()]).status().expect("kill runs");
    assert!(ok.success(), "kill -{signal} {pid}");
}

/// The demo, long enough to be stopped, printing into a pipe; its lines until `until`.
fn stoppable(
    dir: &std::path::Path,
    size: &[&str],
    until: &str,
) -> (std::process::Child, Vec<String>, std::io::Lines<BufReader<std::process::ChildStdout>>) {
    let mut demo = Command::new(DEMO)
        .args(["--steps", "100000"])
        .args(size)
        .args(["--cpu", "--no-serve", "--out", "run.jsonl"])
        .current_dir(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("the demo starts");
    let mut out = BufReader::new(demo.stdout.take().expect("stdout")).lines();
    let mut lines = Vec::new();
    while !lines.last().is_some_and(|l: &String| l.contains(until)) {
        lines.push(out.next().expect("the demo prints").expect("a line"));
    }
    (demo, lines, out)
}

#[test]
fn a_signal_ends_the_run_cleanly_and_a_second_at_once() {
    use std::os::unix::process::ExitStatusExt;
    // SIGTERM after the first step: the step in progress ends, then the summary, the file's
    // end, and 143.
    let dir = tempfile::tempdir().expect("tempdir");
    let small = ["--layers", "2", "--d-model", "32", "--seq", "8", "--batch", "2", "--budget-mib", "4"];
    let (mut demo, lines, out) = stoppable(dir.path(), &small, "step 1 traced");
    signal(demo.id(), "TERM");
    let rest: Vec<String> = out.map(|l| l.expect("a line")).collect();
    let status = demo.wait().expect("exits");
    assert_eq!((status.code(), status.signal()), (Some(143), None), "{lines:#?}\n{rest:#?}");
    assert!(lines.iter().any(|l| l == "plan"), "the plan printed before the first step: {lines:#?}");
    let stopped = rest.iter().find(|l| l.contains("stopped    by SIGTERM after step")).unwrap_or_else(|| panic!("{rest:#?}"));
    assert!(rest.iter().any(|l| l.contains("peak VRAM")), "the summary: {rest:#?}");
    let (events, report) = stagehand::events::jsonl::read_file(dir.path().join("run.jsonl")).expect("the file reads");
    assert_eq!(report.skipped_total, 0);
    let last = events.last().expect("events");
    let steps: u64 = stopped.split("after step ").nth(1).and_then(|s| s.split(' ').next()).and_then(|s| s.parse().ok()).expect("a step");
    assert!(matches!(last.kind, stagehand::events::EventKind::RunEnded { steps: n } if n == steps), "{last:?}");

    // A second signal, once the first was heard, while a step of the demo's own size runs: out
    // at once, no summary.
    let dir = tempfile::tempdir().expect("tempdir");
    // A model whose steps take over a second here (2.4 s the first, 1.8 s later ones on 2 cores),
    // so the second signal lands while the step the first one let finish still runs.
    let long = ["--d-model", "256", "--seq", "256", "--budget-mib", "64"];
    let (mut demo, _, mut out) = stoppable(dir.path(), &long, "activation pool at most");
    std::thread::sleep(Duration::from_millis(300));
    signal(demo.id(), "INT");
    let mut rest = Vec::new();
    while !rest.last().is_some_and(|l: &String| l.contains("stopping after the step in progress")) {
        rest.push(out.next().expect("the demo says it heard the signal").expect("a line"));
    }
    signal(demo.id(), "INT");
    rest.extend(out.map(|l| l.expect("a line")));
    assert_eq!(demo.wait().expect("exits").code(), Some(130), "{rest:#?}");
    assert!(!rest.iter().any(|l| l == "summary"), "the second signal does not wait for the summary: {rest:#?}");
}

#[test]
fn resident_prints_only_what_it_measured() {
    let dir = tempfile::tempdir().expect("tempdir");
    let o = Command::new(DEMO)
        .args(["--steps", "2", "--layers", "2", "--d-model", "32", "--seq", "8", "--batch", "2"])
        .args(["--budget-mib", "4", "--cpu", "--no-serve", "--resident", "--threads", "1"])
        .current_dir(dir.path())
        .output()
        .expect("the demo runs");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}");
    assert!(out.contains("threads    1 intra-op threads"), "{out}");
    assert!(out.contains("peak VRAM  not measured") && !out.contains("MiB budget"), "no budget, no host peak: {out}");
    assert!(!out.contains("\nplan"), "plain tch has no plan: {out}");
}

#[test]
fn telemetry_lost_to_a_full_disk_is_reported_and_fails_the_run() {
    let dir = tempfile::tempdir().expect("tempdir");
    let o = Command::new(DEMO)
        .args(["--steps", "2", "--layers", "2", "--d-model", "32", "--seq", "8", "--batch", "2"])
        .args(["--budget-mib", "4", "--cpu", "--no-serve", "--out", "/dev/full"])
        .current_dir(dir.path())
        .output()
        .expect("the demo runs");
    let out = String::from_utf8_lossy(&o.stdout);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "a run that lost its telemetry exits non-zero:\n{out}\n{err}");
    assert!(err.contains("telemetry incomplete") && err.contains("/dev/full"), "{err}");
    let lost = out.lines().find(|l| l.contains("lost writing the telemetry")).expect("the summary says what was lost");
    assert!(!lost.contains(" 0 lost"), "{lost}");
}

/// Every setting a finding names is a flag of the demo (its `--help` lists it), and a batch that
/// does not split into the micro-batches asked for is refused before anything starts.
#[test]
fn every_knob_a_finding_names_is_a_flag_and_micro_batches_are_checked() {
    let help = Command::new(DEMO).arg("--help").output().expect("the demo runs");
    let help = String::from_utf8_lossy(&help.stdout);
    for k in stagehand::events::insight::KNOBS {
        assert!(help.contains(k.flag), "{} ({}) is not a flag of the demo", k.flag, k.name);
    }
    let o = Command::new(DEMO)
        .args(["--steps", "1", "--layers", "2", "--d-model", "32", "--seq", "8", "--batch", "4", "--micro-batches", "3"])
        .args(["--cpu", "--no-serve", "--telemetry-level", "off"])
        .output()
        .expect("the demo runs");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("multiple of 3"), "{err}");
}

/// Model and batch sizes the host cannot build, or that make no model, are refused with the
/// reason before anything is allocated, never a panic: a width the heads do not divide, sizes
/// of 0, a model or a batch larger than the host's memory, sizes whose product would overflow.
#[test]
fn sizes_that_make_no_model_or_do_not_fit_the_host_are_refused_before_anything_is_built() {
    for (args, says) in [
        (&["--d-model", "130"][..], "width 130: a multiple of its 4 attention heads"),
        (&["--d-model", "0"], "width 0: from 1 to 65536"),
        (&["--seq", "0"], "sequence length 0: from 1 to 16777216"),
        (&["--batch", "0"], "a batch of 0 sequences: at least 1"),
        (&["--layers=-1"], "blocks -1: from 0 to 65536"),
        (&["--d-model", "9223372036854775807"], "width 9223372036854775807: from 1 to 65536"),
        (&["--d-model", "65536", "--layers", "4096"], "of host memory to build"),
        (&["--batch", "1000000000"], "for its inputs alone"),
    ] {
        let o = Command::new(DEMO)
            .args(["--steps", "1", "--cpu", "--no-serve", "--telemetry-level", "off"])
            .args(args)
            .env("RUST_BACKTRACE", "0")
            .output()
            .expect("the demo runs");
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{args:?} exits with an error, not a panic: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

/// `--gpus 4` trains data parallel on four devices (simulated on the host here, as CI has no
/// GPU): the summary has each GPU's line, and every GPU's steps are in the telemetry file on its
/// own lane.
#[test]
fn four_gpus_train_and_each_one_is_in_the_summary_and_the_telemetry() {
    let dir = tempfile::tempdir().expect("tempdir");
    let o = Command::new(DEMO)
        .args(["--gpus", "4", "--steps", "3", "--layers", "2", "--d-model", "32", "--seq", "8", "--batch", "4"])
        .args(["--budget-mib", "4", "--cpu", "--no-serve", "--out", "run.jsonl"])
        .current_dir(dir.path())
        .output()
        .expect("the demo runs");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}\n{}", String::from_utf8_lossy(&o.stderr));
    for g in 0..4 {
        assert!(out.lines().any(|l| l.trim_start().starts_with(&format!("GPU {g} ")) && l.contains("collectives")), "GPU {g}: {out}");
    }
    let text = std::fs::read_to_string(dir.path().join("run.jsonl")).expect("the telemetry file");
    let mut steps = std::collections::BTreeSet::new();
    for line in text.lines() {
        let e: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
        if e["kind"] == "step_time" {
            // Device 0's events leave the lane out.
            steps.insert((e["dev"].as_u64().unwrap_or(0), e["step"].as_u64().expect("a step")));
        }
    }
    let want: std::collections::BTreeSet<_> = (0..4).flat_map(|d| (1..=3).map(move |s| (d, s))).collect();
    assert_eq!(steps, want, "every GPU's three steps");
}
