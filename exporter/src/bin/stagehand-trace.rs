//! `stagehand-trace FILE [-o OUT]`: converts a Stagehand telemetry file (JSONL) to a Chrome
//! trace / Perfetto JSON file, streaming (memory does not grow with the file). Without `-o` the
//! trace goes next to the input as `FILE.trace.json`; `-o -` writes to stdout.
//!
//! A regular file (or a new one) is written as a temporary file beside it and renamed over it
//! only when the conversion succeeded, so a failure, Ctrl-C or SIGTERM leave nothing behind
//! (and an older trace untouched). A symbolic link to a regular file keeps being the link: the
//! file it names is replaced. Anything else (`/dev/null`, `/dev/stdout`, a pipe, a link to one)
//! is written in place and never renamed over: renaming would replace a device node with a
//! file. The input is never the output: the same file by path, link or inode is refused.

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
    let r = &summary.report;
    // Whatever was not read (skipped, damaged, blank) is said.
    if r.skipped_total > 0 || r.damaged > 0 || r.blank > 0 {
        eprintln!("stagehand-trace: {}", r.summary());
    }
    if summary.unpaired > 0 {
        eprintln!("stagehand-trace: {} copies without both their issue and their completion", summary.unpaired);
    }
}

/// Where the trace goes.
#[derive(Debug)]
enum Output {
    /// A regular file (existing or not): written beside it and renamed over it.
    Replace(PathBuf),
    /// A device, a pipe, or a link to one: written in place.
    InPlace(PathBuf),
}

/// How to write `out`: replaced through a rename only where that leaves no device, pipe or
/// link changed into a plain file.
fn plan_output(out: &Path) -> Result<Output, String> {
    let shown = out.display();
    match std::fs::symlink_metadata(out) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Output::Replace(out.to_path_buf())),
        Err(e) => Err(format!("cannot use '{shown}': {e}")),
        Ok(m) if m.file_type().is_symlink() => match std::fs::metadata(out) {
            // The link stays; the regular file it names is replaced.
            Ok(t) if t.is_file() => out
                .canonicalize()
                .map(Output::Replace)
                .map_err(|e| format!("cannot resolve the link '{shown}': {e}")),
            Ok(t) if t.is_dir() => Err(format!("'{shown}' is a link to a folder: give a file name with -o")),
            Ok(_) => Ok(Output::InPlace(out.to_path_buf())),
            Err(e) => Err(format!(
                "'{shown}' is a symbolic link to '{}', which cannot be used ({e}); give another file with -o",
                std::fs::read_link(out).map(|p| p.display().to_string()).unwrap_or_default()
            )),
        },
        Ok(m) if m.is_file() => Ok(Output::Replace(out.to_path_buf())),
        Ok(m) if m.is_dir() => Err(format!("'{shown}' is a folder: give a file name with -o")),
        Ok(_) => Ok(Output::InPlace(out.to_path_buf())),
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
    let reader = match stagehand_events::jsonl::open(&input) {
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
    let target = match plan_output(&out) {
        Ok(Output::InPlace(path)) => return write_in_place(reader, &input, &path),
        Ok(Output::Replace(path)) => path,
        Err(e) => return fail(&e),
    };
    let dir = target.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
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
    // Ctrl-C or SIGTERM mid-way: the temporary file goes, and the exit says it was interrupted.
    let tmp_path = tmp.path().to_path_buf();
    let interrupted = ctrlc::set_handler(move || {
        let _ = std::fs::remove_file(&tmp_path);
        eprintln!("stagehand-trace: interrupted; nothing was written");
        std::process::exit(130);
    });
    if let Err(e) = interrupted {
        eprintln!("stagehand-trace: warning: cannot watch for Ctrl-C ({e}): an interrupted run may leave a .tmp file");
    }
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
    if let Err(e) = tmp.persist(&target) {
        return fail(&format!("cannot move the trace to '{}': {}", target.display(), e.error));
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

/// Writes the trace straight into `path` (a device, a pipe): nothing is renamed over it.
fn write_in_place<S: stagehand_events::jsonl::ByteSource>(
    reader: stagehand_events::jsonl::Reader<S>,
    input: &Path,
    path: &Path,
) -> ExitCode {
    let file = match std::fs::OpenOptions::new().write(true).open(path) {
        Ok(f) => f,
        Err(e) => return fail(&format!("cannot write to '{}': {e}", path.display())),
    };
    let mut w = std::io::BufWriter::new(file);
    match stagehand_exporter::trace::convert_events(reader, &mut w).and_then(|s| w.flush().map(|_| s).map_err(Into::into)) {
        Ok(s) => {
            report(&s);
            eprintln!(
                "stagehand-trace: wrote {} ({} events into {} trace events)",
                path.display(),
                s.report.events,
                s.trace_events
            );
            ExitCode::SUCCESS
        }
        Err(e) => fail(&format!("'{}' to '{}': {e}", input.display(), path.display())),
    }
}
