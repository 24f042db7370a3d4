//! Every example program runs and does what its doc says.

use std::process::Command;

fn run(bin: &str, args: &[&str]) -> String {
    let out = Command::new(bin).args(args).output().expect("the example starts");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{bin} failed: {text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

fn losses(text: &str) -> Vec<String> {
    text.lines().filter(|l| l.starts_with("step")).map(str::to_owned).collect()
}

#[test]
fn wrapping_a_loop_changes_memory_not_results() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("run.jsonl");
    let before = run(env!("CARGO_BIN_EXE_train-before"), &["20"]);
    let after = run(env!("CARGO_BIN_EXE_train-after"), &["20", file.to_str().expect("utf-8 path")]);
    assert_eq!(losses(&before).len(), 2);
    assert_eq!(losses(&before), losses(&after), "streamed training is exact");
    assert!(after.contains("evictions"), "{after}");
    assert!(file.exists());

    let replay = run(env!("CARGO_BIN_EXE_replay"), &[file.to_str().expect("utf-8 path"), "--serve-secs", "0"]);
    assert!(replay.contains("stagehand-top --replay"), "{replay}");
    let trace: serde_json::Value = serde_json::from_slice(
        &std::fs::read(format!("{}.trace.json", file.display())).expect("trace written"),
    )
    .expect("trace json");
    stagehand_exporter::trace::validate(&trace).expect("a valid Chrome/Perfetto trace");
}

#[test]
fn inference_streams_a_model_larger_than_its_budget() {
    let text = run(env!("CARGO_BIN_EXE_inference"), &["3"]);
    let last = text.lines().last().expect("a summary line");
    let resident: u64 = last
        .split(" bytes resident")
        .next()
        .and_then(|s| s.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .expect("resident bytes");
    let budget: u64 = last
        .rsplit("budget ")
        .next()
        .and_then(|s| s.trim_end_matches(')').parse().ok())
        .expect("budget");
    assert!(resident <= budget, "{last}");
    assert!(last.contains("evictions") && !last.starts_with("last pass: 0 evictions"), "{last}");
    // From the third pass (the first traces the itinerary, whose end the second's first block
    // enters unannounced) every block is prefetched: the room holds enough slots to
    // stream through (a room of one slot would make every block a miss).
    assert!(last.contains(" 0 misses"), "{last}");
}

#[test]
fn adapters_train_over_a_quantized_base_as_over_the_full_width_base() {
    let text = run(env!("CARGO_BIN_EXE_adapter-finetune"), &["--steps", "40", "--layers", "8", "--d", "64", "--cpu"]);
    // Each base block's quantization error, the curves side by side, the final losses within 2%.
    let errors = text.lines().filter(|l| l.contains("max error") && l.contains("base.blocks.")).count();
    assert_eq!(errors, 8, "{text}");
    let curve: Vec<(f64, f64)> = text
        .lines()
        .filter(|l| l.trim_start().starts_with("step"))
        .filter_map(|l| {
            let (a, b) = l.split_once('|')?;
            Some((a.split_whitespace().last()?.parse().ok()?, b.trim().parse().ok()?))
        })
        .collect();
    assert!(curve.len() >= 10, "{text}");
    let (first, last) = (curve[0], curve[curve.len() - 1]);
    assert!(last.1 < first.1 * 0.9, "the adapters learn over the quantized base: {text}");
    let within: f64 = text
        .split("within ")
        .nth(1)
        .and_then(|s| s.split('%').next())
        .and_then(|s| s.parse().ok())
        .expect("the final losses compared");
    assert!(within <= 2.0, "{text}");
    let less: f64 = text
        .split(" MiB (")
        .nth(1)
        .and_then(|s| s.split('x').next())
        .and_then(|s| s.parse().ok())
        .expect("the bytes moved compared");
    // A float32 block's matrices move at a quarter of their bytes, its biases at full width.
    assert!(less > 2.5, "an INT8 base moves far fewer bytes than a float32 one: {text}");
}

/// distill's "last step: X MiB moved against a Belady minimum of Y MiB ..." line, and its two
/// figures.
fn last_step_mib(text: &str) -> (&str, Vec<f64>) {
    let last = text.lines().find(|l| l.starts_with("last step:")).expect("the last step's bytes");
    (last, last.split_whitespace().filter_map(|w| w.parse().ok()).collect())
}

/// `distill` printed a loss curve of finite values ("step N  loss | cross-entropy").
fn assert_distils(text: &str) {
    let curve: Vec<f64> = text
        .lines()
        .filter(|l| l.trim_start().starts_with("step") && l.contains('|'))
        .filter_map(|l| l.split_whitespace().nth(2)?.parse().ok())
        .collect();
    assert!(curve.len() >= 5 && curve.iter().all(|l| l.is_finite()), "{text}");
}

#[test]
fn a_student_distils_from_a_frozen_teacher_on_one_handle() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("distill.jsonl");
    let args = [
        "--cpu", "--teacher-steps", "20", "--steps", "20", "--teacher-layers", "4", "--teacher-d", "64", "--student-layers", "2",
        "--student-d", "32", "--seq", "16", "--batch", "4", "--budget-mib", "2", "--out", file.to_str().expect("utf-8 path"),
    ];
    let text = run(env!("CARGO_BIN_EXE_distill"), &args);
    assert!(text.contains("model 'teacher'") && text.contains("model 'main'"), "one plan for both models: {text}");
    assert!(text.contains("quantized to int8"), "{text}");
    assert!(text.contains("cut from the handed pool"), "{text}");
    assert!(text.contains("handing the pool over"), "{text}");
    assert_distils(&text);
    // The telemetry the dashboards read names both models and the teacher's quantization.
    let jsonl = std::fs::read_to_string(&file).expect("telemetry written");
    for kind in ["\"kind\":\"model_registered\"", "\"kind\":\"model_memory\"", "\"kind\":\"quantized\"", "\"models\":[{\"model\":\"main\""] {
        assert!(jsonl.contains(kind), "{kind} in the telemetry");
    }
    let replay = run(env!("CARGO_BIN_EXE_replay"), &[file.to_str().expect("utf-8 path"), "--serve-secs", "0"]);
    assert!(replay.contains("stagehand-top --replay"), "{replay}");
}

#[test]
fn a_student_distils_over_micro_batches_at_the_belady_minimum() {
    // No --budget-mib: the default, read off both phases' budget guides, streams the teacher.
    let args = [
        "--cpu", "--teacher-steps", "10", "--steps", "10", "--teacher-layers", "4", "--teacher-d", "64", "--student-layers", "2",
        "--student-d", "32", "--seq", "16", "--batch", "4", "--micro-batches", "2",
    ];
    let text = run(env!("CARGO_BIN_EXE_distill"), &args);
    assert_distils(&text);
    // "last step: X MiB moved against a Belady minimum of Y MiB ...": both passes of each step
    // go over the combined itinerary, and the weights move no more than its minimum (a long-run
    // average, which a single step may come under).
    let (last, mib) = last_step_mib(&text);
    assert!(mib.len() == 2 && mib[0] > 0.0 && mib[0] <= mib[1], "the teacher streams, at or under the minimum: {last}");
    // A count that does not divide the batch is refused before anything trains.
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_distill"))
        .args(["--cpu", "--batch", "4", "--micro-batches", "3"])
        .env_remove("RUST_BACKTRACE")
        .output()
        .expect("runs");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("does not split --batch 4"), "{err}");
}

#[test]
fn distill_trains_at_its_default_sizes_and_budget() {
    // The default budget was once a fixed count of teacher blocks, under what the plan needs.
    let text = run(env!("CARGO_BIN_EXE_distill"), &["--cpu", "--teacher-steps", "2", "--steps", "2"]);
    let (last, mib) = last_step_mib(&text);
    assert!(mib.len() == 2 && mib[0] > 0.0, "the teacher streams: {last}");
}

#[test]
fn adapters_train_over_a_frozen_base_streamed_from_its_file() {
    let text = run(env!("CARGO_BIN_EXE_file-adapters"), &["40", "--full-check"]);
    let last = text.lines().last().expect("a summary line");
    let nums: Vec<f64> = last
        .trim_start_matches("loss ")
        .split(" -> ")
        .map(|s| s.split(';').next().unwrap_or(s).trim().parse().expect("a loss"))
        .collect();
    assert!(nums[1] < nums[0] * 0.9, "the adapters learn: {last}");
    let evictions: Vec<u64> = text
        .lines()
        .filter_map(|l| l.split("evictions ").nth(1))
        .filter_map(|s| s.split_whitespace().next()?.parse().ok())
        .collect();
    assert!(!evictions.is_empty() && evictions.iter().all(|e| *e > 0), "blocks stream from the file: {text}");
}

#[test]
fn every_example_answers_help_with_its_usage() {
    for bin in [
        env!("CARGO_BIN_EXE_train-before"),
        env!("CARGO_BIN_EXE_train-after"),
        env!("CARGO_BIN_EXE_inference"),
        env!("CARGO_BIN_EXE_adapter-finetune"),
        env!("CARGO_BIN_EXE_distill"),
        env!("CARGO_BIN_EXE_file-adapters"),
        env!("CARGO_BIN_EXE_replay"),
        env!("CARGO_BIN_EXE_stagehand-demo"),
    ] {
        let o = std::process::Command::new(bin).arg("--help").output().expect("runs");
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success() && text.contains("Usage:"), "{bin} --help: {text}{}", String::from_utf8_lossy(&o.stderr));
        let o = std::process::Command::new(bin).arg("not-a-number").output().expect("runs");
        if !bin.ends_with("replay") {
            assert!(!o.status.success(), "{bin} accepted a bad argument");
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(!err.contains("panicked") && !err.contains("backtrace"), "{bin}: {err}");
        }
    }
}
