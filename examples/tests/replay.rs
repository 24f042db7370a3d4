//! The replay program: `--help`, a clear error for a missing file, and a server that stays up,
//! answers, and stops on Ctrl-C (SIGINT).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_replay");

fn get(addr: &str, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connects");
    s.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
    write!(s, "GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n").expect("sends");
    let mut text = String::new();
    s.read_to_string(&mut text).expect("reads");
    let status = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, text)
}

#[test]
fn help_and_a_missing_file() {
    let help = Command::new(BIN).arg("--help").output().expect("runs");
    assert!(help.status.success());
    let text = String::from_utf8_lossy(&help.stdout);
    for flag in ["--addr", "--token", "--allow-host", "--tls-cert", "--serve-secs", "Ctrl-C"] {
        assert!(text.contains(flag), "--help lacks {flag}: {text}");
    }
    let missing = Command::new(BIN).arg("/nonexistent/run.jsonl").output().expect("runs");
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("/nonexistent/run.jsonl"));
}

#[test]
fn serves_the_file_until_ctrl_c() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("run.jsonl");
    let run = stagehand::events::synthetic::SyntheticRun::finished(3);
    std::fs::write(&file, stagehand::events::synthetic::jsonl(run)).expect("writes");
    let events = stagehand::events::synthetic::events(run).len();

    let mut child = Command::new(BIN)
        .arg(&file)
        .args(["--addr", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starts");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let url = loop {
        let line = lines.next().expect("the program prints its address").expect("a line");
        if let Some(rest) = line.strip_prefix("dashboard  http://") {
            break rest.split('/').next().expect("host:port").to_owned();
        }
    };
    assert!(std::fs::metadata(format!("{}.trace.json", file.display())).is_ok(), "the trace is written");
    let (status, body) = get(&url, "/api/replay/status");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains(&format!("\"total\":{events}")) && body.contains("\"paused\":true"), "{body}");
    std::thread::sleep(Duration::from_millis(300));
    assert!(child.try_wait().expect("status").is_none(), "still serving");

    let pid = child.id().to_string();
    assert!(Command::new("kill").args(["-INT", &pid]).status().expect("kill runs").success());
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = child.try_wait().expect("status") {
            break s;
        }
        assert!(Instant::now() < deadline, "the replay did not stop on Ctrl-C");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "a clean exit on Ctrl-C: {status:?}");
}
