//! `stagehand-trace FILE [-o OUT]`: converts a Stagehand telemetry file (JSONL) to a Chrome
//! trace / Perfetto JSON file. Without `-o` the trace is written next to the input as
//! `FILE.trace.json`; `-o -` writes to stdout.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

const USAGE: &str = "usage: stagehand-trace FILE [-o OUT]\n\
  Converts a Stagehand telemetry file (JSONL) to Chrome trace / Perfetto JSON.\n\
  Open the result in https://ui.perfetto.dev or chrome://tracing.\n\
  -o OUT   where to write (default FILE.trace.json; '-' for stdout)";

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
                None => return fail("'-o' needs a file name"),
            },
            _ if a.starts_with('-') && a != "-" => return fail(&format!("unknown option '{a}'")),
            _ if input.is_none() => input = Some(PathBuf::from(a)),
            _ => return fail(&format!("unexpected argument '{a}'")),
        }
    }
    let Some(input) = input else {
        return fail("no telemetry file given");
    };
    let result = match output.as_deref() {
        Some("-") => {
            let stdout = std::io::stdout();
            let mut lock = stdout.lock();
            stagehand_exporter::trace::convert_file(&input, &mut lock)
                .and_then(|r| lock.flush().map(|_| r).map_err(Into::into))
        }
        other => {
            let out = other.map(PathBuf::from).unwrap_or_else(|| {
                let mut p = input.clone().into_os_string();
                p.push(".trace.json");
                PathBuf::from(p)
            });
            match std::fs::File::create(&out) {
                Ok(f) => {
                    let mut w = std::io::BufWriter::new(f);
                    let r = stagehand_exporter::trace::convert_file(&input, &mut w)
                        .and_then(|r| w.flush().map(|_| r).map_err(Into::into));
                    if r.is_ok() {
                        eprintln!("stagehand-trace: wrote {}", out.display());
                    }
                    r
                }
                Err(e) => return fail(&format!("cannot create '{}': {e}", out.display())),
            }
        }
    };
    match result {
        Ok(report) => {
            if !report.skipped.is_empty() {
                eprintln!("stagehand-trace: {}", report.summary());
            }
            ExitCode::SUCCESS
        }
        Err(e) => fail(&format!("'{}': {e}", input.display())),
    }
}

fn fail(msg: &str) -> ExitCode {
    eprintln!("stagehand-trace: {msg}\n{USAGE}");
    ExitCode::from(2)
}
