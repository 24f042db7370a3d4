//! `stagehand-trace FILE [-o OUT]`: converts a Stagehand telemetry file (JSONL) to a Chrome
//! trace / Perfetto JSON file, streaming (memory does not grow with the file). Without `-o` the
//! trace goes next to the input as `FILE.trace.json`; `-o -` writes to stdout.
//!
//! The trace is written to a temporary file beside the output and renamed over it only when the
//! conversion succeeded, so a failure leaves nothing behind (and an older trace untouched). The
//! input is never the output: the same file by path, link or inode is refused.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

const USAGE: &str = "usage: stagehand-trace FILE [-o OUT]\n\
  Converts a Stagehand telemetry file (JSONL) to Chrome trace / Perfetto JSON.\n\
  Open the result in https://ui.perfetto.dev or chrome://tracing.\n\
  -o OUT   where to write (default FILE.trace.json; '-' for stdout)";

fn usage_error(msg: &str) -> ExitCode {
    eprintln!("stagehand-trace: {msg}\n{USAGE}");
    ExitCode::from(2)
}

fn fail(msg: &str) -> ExitCode {
    eprintln!("stagehand-trace: {msg}");
    ExitCode::from(1)
}

/// Whether `a` and `b` name the same file (the same path once resolved, or the same inode).
fn same_file(a: &Path, b: &Path) -> bool {
    let resolve = |p: &Path| -> Option<PathBuf> {
        if let Ok(c) = p.canonicalize() {
            return Some(c);
        }
        // Not there yet: resolve its folder.
        let parent = p.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        Some(parent.canonicalize().ok()?.join(p.file_name()?))
    };
    if resolve(a).is_some_and(|x| Some(x) == resolve(b)) {
        return true;
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        if let (Ok(x), Ok(y)) = (std::fs::metadata(a), std::fs::metadata(b)) {
            return x.dev() == y.dev() && x.ino() == y.ino();
        }
    }
    false
}

fn report(summary: &stagehand_exporter::trace::Summary) {
    if summary.report.skipped_total > 0 {
        eprintln!("stagehand-trace: {}", summary.report.summary());
    }
    if summary.unpaired > 0 {
        eprintln!("stagehand-trace: {} copies without both their issue and their completion", summary.unpaired);
    }
}

fn main() -> ExitCode {
    let mut input: Option<PathBuf> = None;
    let mut output: Option<String> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "-h" | "--help" => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            "-o" | "--output" => match args.next() {
                Some(o) => output = Some(o),
                None => return usage_error("'-o' needs a file name"),
            },
            _ if a.starts_with('-') && a != "-" => return usage_error(&format!("unknown option '{a}'")),
            _ if input.is_none() => input = Some(PathBuf::from(a)),
            _ => return usage_error(&format!("unexpected argument '{a}'")),
        }
    }
    let Some(input) = input else {
        return usage_error("no telemetry file given");
    };
    // Open the input first: a missing file creates nothing.
    // Plain or zstd-compressed, streamed: memory does not grow with the file.
    let reader = match stagehand::events::jsonl::open(&input) {
        Ok(r) => r,
        Err(e) => return fail(&format!("cannot read '{}': {e}", input.display())),
    };
    if output.as_deref() == Some("-") {
        let stdout = std::io::stdout();
        let mut out = std::io::BufWriter::new(stdout.lock());
        return match stagehand_exporter::trace::convert_events(reader, &mut out).and_then(|s| out.flush().map(|_| s).map_err(Into::into)) {
            Ok(s) => {
                report(&s);
                ExitCode::SUCCESS
            }
            Err(e) => fail(&format!("'{}': {e}", input.display())),
        };
    }
    let out = output.map(PathBuf::from).unwrap_or_else(|| {
        let mut p = input.clone().into_os_string();
        p.push(".trace.json");
        PathBuf::from(p)
    });
    if same_file(&input, &out) {
        return fail(&format!(
            "refusing to write the trace over its input '{}': give another file with -o",
            input.display()
        ));
    }
    let dir = out.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let mut builder = tempfile::Builder::new();
    builder.prefix(".stagehand-trace-").suffix(".tmp");
    // A trace is a plain output file: readable as any file the user writes (the umask applies),
    // not private like a temporary one.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        builder.permissions(std::fs::Permissions::from_mode(0o644));
    }
    let tmp = match builder.tempfile_in(dir) {
        Ok(t) => t,
        Err(e) => return fail(&format!("cannot write in '{}': {e}", dir.display())),
    };
    let mut w = std::io::BufWriter::new(tmp);
    let summary = match stagehand_exporter::trace::convert_events(reader, &mut w) {
        Ok(s) => s,
        // The temporary file is removed when dropped: nothing is left behind.
        Err(e) => return fail(&format!("'{}': {e}", input.display())),
    };
    let tmp = match w.into_inner() {
        Ok(t) => t,
        Err(e) => return fail(&format!("writing '{}': {}", out.display(), e.error())),
    };
    if let Err(e) = tmp.as_file().sync_all() {
        return fail(&format!("writing '{}': {e}", out.display()));
    }
    if let Err(e) = tmp.persist(&out) {
        return fail(&format!("cannot move the trace to '{}': {}", out.display(), e.error));
    }
    report(&summary);
    eprintln!(
        "stagehand-trace: wrote {} ({} events into {} trace events)",
        out.display(),
        summary.report.events,
        summary.trace_events
    );
    ExitCode::SUCCESS
}
