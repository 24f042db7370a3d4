//! The real `stagehand-top` binary in a pseudo-terminal: keys in, screen read back through a
//! VT100 parser. Against a replay file, and against a live SSE stream.

mod common;

use common::*;
use portable_pty::{native_pty_system, Child, CommandBuilder, MasterPty, PtySize};
use std::io::{Read, Write};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

struct Tui {
    child: Box<dyn Child + Send + Sync>,
    writer: Box<dyn Write + Send>,
    screen: Arc<Mutex<vt100::Parser>>,
    _master: Box<dyn MasterPty + Send>,
}

impl Tui {
    fn start(args: &[&str]) -> Tui {
        let pair = native_pty_system()
            .openpty(PtySize { rows: H, cols: W, pixel_width: 0, pixel_height: 0 })
            .expect("opens a pty");
        let mut cmd = CommandBuilder::new(env!("CARGO_BIN_EXE_stagehand-top"));
        cmd.args(args);
        cmd.cwd(env!("CARGO_MANIFEST_DIR"));
        cmd.env("TERM", "xterm-256color");
        cmd.env_remove("NO_COLOR");
        let child = pair.slave.spawn_command(cmd).expect("starts stagehand-top");
        drop(pair.slave);
        let mut reader = pair.master.try_clone_reader().expect("pty reader");
        let writer = pair.master.take_writer().expect("pty writer");
        let screen = Arc::new(Mutex::new(vt100::Parser::new(H, W, 0)));
        let s = screen.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 8192];
            while let Ok(n) = reader.read(&mut buf) {
                if n == 0 {
                    break;
                }
                s.lock().expect("screen lock").process(&buf[..n]);
            }
        });
        Tui { child, writer, screen, _master: pair.master }
    }

    fn contents(&self) -> String {
        self.screen.lock().expect("screen lock").screen().contents()
    }

    /// Waits until the screen shows `text` (failing after a generous limit, never timing).
    fn wait_for(&self, text: &str) -> String {
        self.wait_for_all(&[text])
    }

    /// Waits until one screen shows every one of `texts` at once: a frame read mid-redraw can
    /// show part of the new view over the old one.
    fn wait_for_all(&self, texts: &[&str]) -> String {
        let limit = Instant::now() + Duration::from_secs(30);
        loop {
            let c = self.contents();
            if texts.iter().all(|t| c.contains(t)) {
                return c;
            }
            assert!(Instant::now() < limit, "screen never showed all of {texts:?}:\n{c}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn keys(&mut self, bytes: &str) {
        self.writer.write_all(bytes.as_bytes()).expect("writes keys");
        self.writer.flush().expect("flushes keys");
    }

    fn quit(mut self) {
        self.keys("q");
        let limit = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().expect("waits") {
                assert!(status.success(), "exit status {status:?}");
                return;
            }
            assert!(Instant::now() < limit, "did not quit:\n{}", self.contents());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Tui {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
    }
}

#[test]
fn replay_in_a_terminal_follows_keys() {
    let mut t = Tui::start(&["--replay", RUN, "--paused"]);
    t.wait_for("0/813");
    t.keys("\x1b[F"); // End
    t.wait_for("813/813");
    t.wait_for("dropped 17");
    t.keys("2");
    t.wait_for_all(&["Step 3 took 88.0 ms: where the time went", "compute 63.0 ms 72%", "Findings (1)"]);
    t.keys("3");
    t.wait_for_all(&["Step 3 fullest reading: 288 MiB", "weights 192 MiB 67%", "By owner over"]);
    t.keys("4");
    t.wait_for_all(&["gpu_freeing 1", "blocks.7", "id▲"]);
    t.keys("s"); // sort by name
    t.wait_for("name▲");
    t.keys("S"); // reversed
    t.wait_for("name▼");
    t.keys("sssssss"); // round to id, in registration order
    t.wait_for("id▲");
    t.keys("jj\r"); // the third block's details
    t.wait_for("Block blocks.2");
    t.keys("9/kind:events_dropped\r");
    t.wait_for("17 dropped so far");
    t.keys("["); // back to the start of the current training step
    t.wait_for("step 4 step_begin");
    t.keys("?");
    t.wait_for("Keys (Esc or ? to close)");
    t.quit();
}

#[test]
fn live_run_in_a_terminal_shows_the_stream_and_reconnects() {
    let ev = stagehand_events::synthetic::events(Default::default());
    let mut first = vec![snapshot_of(&ev[..400])];
    first.extend(events_of(&ev[400..]));
    let addr = sse_server(vec![(first, true), (vec![snapshot_of(&ev)], false)]);
    let url = format!("http://{addr}");
    let mut t = Tui::start(&["--connect", &url]);
    // The first connection is closed by the server; the second snapshot makes the second resync.
    t.wait_for(&format!("{} events, 2 resyncs", ev.len()));
    let s = t.wait_for_all(&[&format!("live {addr}"), "step 4 forward", "dropped 17"]);
    assert_eq!(s.matches(&addr).count(), 1, "the address once:\n{s}");
    t.keys("2");
    t.wait_for_all(&["where the time went", "Findings"]);
    t.keys("8");
    t.wait_for("Phase timeline");
    t.quit();
}

#[test]
fn follow_plays_a_growing_file_as_it_is_written() {
    let all = std::fs::read_to_string(RUN).expect("fixture");
    let lines: Vec<&str> = all.lines().collect();
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("growing.jsonl");
    // The writer is mid-line: 300 whole events and half of the next one.
    let (half, rest) = lines[300].split_at(lines[300].len() / 2);
    let head: String = lines[..300].iter().map(|l| format!("{l}\n")).collect();
    std::fs::write(&path, format!("{head}{half}")).expect("writes the first part");

    let mut t = Tui::start(&["--replay", path.to_str().expect("utf-8 path"), "--follow"]);
    let s = t.wait_for_all(&["300/300", "read 300 events from 300 lines"]);
    assert!(!s.contains("skipped"), "a line being written is not damage:\n{s}");

    let mut f = std::fs::OpenOptions::new().append(true).open(&path).expect("opens for append");
    let tail: String = lines[301..].iter().map(|l| format!("{l}\n")).collect();
    write!(f, "{rest}\n{tail}").expect("appends the rest");
    f.flush().expect("flushes");
    // "dropped 17" comes from an appended event: the appended part was applied.
    let s = t.wait_for_all(&["813/813", "read 813 events from 813 lines", "dropped 17"]);
    assert!(!s.contains("skipped"), "the line finished later was read whole:\n{s}");
    t.keys("8");
    t.wait_for("Phase timeline");
    t.quit();
}

#[test]
fn a_file_that_is_no_telemetry_never_holds_up_the_keys() {
    // 4 GiB of zeros (a sparse file): the replay says what it is and `q` quits at once.
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("zeros.jsonl");
    std::fs::File::create(&path).and_then(|f| f.set_len(4 << 30)).expect("a sparse file");
    for follow in [false, true] {
        let mut args = vec!["--replay", path.to_str().expect("utf-8 path")];
        if follow {
            args.push("--follow");
        }
        let t = Tui::start(&args);
        t.wait_for("no telemetry in");
        t.quit();
    }
    // A device is refused before the terminal is taken: a replay reads its file more than once.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_stagehand-top"))
        .args(["--replay", "/dev/zero"])
        .output()
        .expect("runs");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a regular file"), "{}", String::from_utf8_lossy(&out.stderr));
}
