//! Every layer imports downward only: reads the runtime's sources (`crate::`, `super::` and
//! `self::` paths, test code left out) and fails on an import between its top-level modules
//! that climbs the layer order below, and on an import loop between the files of one module.
//! The events crate (`stagehand-events`, below every module here: the runtime re-exports it as
//! `events`) gets the loop check too, read as if it were the runtime's module `events`.
//! The edges and loops still known to climb are listed; one that goes must leave the list too,
//! so the lists only shrink.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The runtime's top-level modules, lowest layer first: a module may import from its own layer
/// and those before it.
const LAYERS: &[&[&str]] = &[
    &["precision"],
    &["conductor", "oom"],
    &["error"],
    &["torch", "saved", "tensorfile"],
    &["device"],
    &["guards", "pinned", "transfer", "collective"],
    &["activations", "weights"],
    &["checkpoint"],
    &["optim"],
    &["nn"],
    // The builder makes a data-parallel group of handles; the group builds each rank's handle.
    &["session", "parallel"],
];

/// Imports that still climb: none. The list stays, so an exception has to be written down here.
const KNOWN_CLIMBS: &[(&str, &str)] = &[];

/// Loops between the files (or sub-directories) of one module, still there: none. The list
/// stays, so an exception has to be written down here.
const KNOWN_LOOPS: &[(&str, &[&str])] = &[];

/// A crate's sources and the module path they are read under.
struct Sources {
    dir: PathBuf,
    /// Where `crate::` points: nothing for the runtime, `events` for the events crate.
    mount: Vec<String>,
}

fn runtime() -> Sources {
    Sources { dir: Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), mount: Vec::new() }
}

fn events() -> Sources {
    Sources { dir: Path::new(env!("CARGO_MANIFEST_DIR")).join("../events/src"), mount: vec!["events".to_owned()] }
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir).expect("read src").map(|e| e.expect("entry").path()).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// The module path of a file: `activations/state.rs` is `[activations, state]`, `nn/mod.rs` is
/// `[nn]`, `lib.rs` is `[]` (each under the crate's mount).
fn module_of(sources: &Sources, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(&sources.dir).expect("under src");
    let mut parts: Vec<String> = sources.mount.clone();
    parts.extend(rel.iter().map(|c| c.to_string_lossy().into_owned()));
    let last = parts.pop().expect("a file name");
    let stem = last.trim_end_matches(".rs");
    if stem != "mod" && stem != "lib" {
        parts.push(stem.to_owned());
    }
    parts
}

/// The code of a file without its tests and comments: test modules come last in this crate,
/// after their `#[cfg(test)]`, and `tests.rs` files are test code throughout.
fn code(file: &Path) -> String {
    if file.file_name().is_some_and(|n| n == "tests.rs") {
        return String::new();
    }
    let text = std::fs::read_to_string(file).expect("read source");
    let text = text.split("#[cfg(test)]").next().unwrap_or_default();
    text.lines().map(|l| l.split("//").next().unwrap_or_default()).collect::<Vec<_>>().join("\n")
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The first segments of the paths in a `{a, b::c, d::{e, f}}` group starting at `rest`.
fn group_heads(rest: &str) -> Vec<String> {
    let mut heads = Vec::new();
    let (mut depth, mut item) = (0usize, String::new());
    for c in rest.chars() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                heads.push(std::mem::take(&mut item));
                continue;
            }
            _ => {}
        }
        if depth == 0 {
            item.push(c);
        }
    }
    heads.push(item);
    heads
        .iter()
        .filter_map(|i| {
            let head: String = i.trim().chars().take_while(|&c| is_ident(c)).collect();
            (!head.is_empty()).then_some(head)
        })
        .collect()
}

/// The module paths `code` (of module `module`, in a crate mounted at `mount`) names:
/// `crate::x::..`, `super::x`, `self::x`, braces included, resolved against `module`.
fn targets(mount: &[String], module: &[String], code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for (at, _) in code.match_indices("::") {
        // The path's first segment, just before this `::`, must start a path.
        let before = &code[..at];
        let start = before.rfind(|c: char| !is_ident(c)).map_or(0, |i| i + 1);
        if before[..start].ends_with("::") {
            continue;
        }
        let from_root = &before[start..] == "crate";
        let mut base: Vec<String> = match &before[start..] {
            "crate" => mount.to_vec(),
            "self" => module.to_vec(),
            "super" => module[..module.len().saturating_sub(1)].to_vec(),
            _ => continue,
        };
        let mut rest = &code[at + 2..];
        while let Some(r) = rest.strip_prefix("super::") {
            base.pop();
            rest = r;
        }
        if let Some(group) = rest.strip_prefix('{') {
            for head in group_heads(group) {
                let mut t = base.clone();
                if head != "self" {
                    t.push(head);
                }
                out.push(t);
            }
        } else {
            let head: String = rest.chars().take_while(|&c| is_ident(c)).collect();
            let next: String = rest[head.len()..].chars().take(2).collect();
            let mut t = base;
            t.push(head.clone());
            // `crate::x::y`: also y, for edges inside module x.
            if from_root && next == "::" {
                let tail = &rest[head.len() + 2..];
                let second: String = tail.chars().take_while(|&c| is_ident(c)).collect();
                if !second.is_empty() {
                    t.push(second);
                }
            }
            out.push(t);
        }
    }
    out
}

/// Names the crate root re-exports (`pub use error::{Error, Result}`), to the module they come
/// from.
fn root_reexports(sources: &Sources) -> BTreeMap<String, String> {
    let lib = std::fs::read_to_string(sources.dir.join("lib.rs")).expect("lib.rs");
    let mut names = BTreeMap::new();
    for line in lib.lines().map(str::trim) {
        let Some(rest) = line.strip_prefix("pub use ") else { continue };
        let Some((module, items)) = rest.split_once("::") else { continue };
        let items = items.trim_end_matches(';');
        let items = items.strip_prefix('{').map_or(items, |i| i.trim_end_matches('}'));
        for item in items.split(',') {
            names.insert(item.trim().to_owned(), module.to_owned());
        }
    }
    names
}

/// The crates the runtime's root re-exports as modules (`pub use stagehand_events as events;`):
/// they sit below every module of the runtime, so an import of them never climbs.
fn lower_crates() -> BTreeSet<String> {
    let lib = std::fs::read_to_string(runtime().dir.join("lib.rs")).expect("lib.rs");
    lib.lines()
        .filter_map(|l| l.trim().strip_prefix("pub use ")?.trim_end_matches(';').split_once(" as "))
        .filter(|(krate, _)| !krate.contains("::"))
        .map(|(_, name)| name.trim().to_owned())
        .collect()
}

/// Every edge between distinct files' modules of a crate: (from module path, to module path).
fn edges(sources: &Sources) -> Vec<(Vec<String>, Vec<String>)> {
    let reexports = root_reexports(sources);
    let mut files = Vec::new();
    rust_files(&sources.dir, &mut files);
    let depth = sources.mount.len();
    let mut out = Vec::new();
    for f in files {
        let module = module_of(sources, &f);
        for mut t in targets(&sources.mount, &module, &code(&f)) {
            if let Some(m) = t.get(depth).and_then(|n| reexports.get(n)) {
                t.truncate(depth);
                t.push(m.clone());
            }
            out.push((module.clone(), t));
        }
    }
    out
}

/// The loops of a directed graph: its strongly connected components of two nodes or more.
fn loops(graph: &BTreeMap<String, BTreeSet<String>>) -> BTreeSet<Vec<String>> {
    let nodes: Vec<&String> = graph.keys().chain(graph.values().flatten()).collect::<BTreeSet<_>>().into_iter().collect();
    let reach = |from: &String| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.clone()];
        while let Some(n) = todo.pop() {
            for m in graph.get(&n).into_iter().flatten() {
                if seen.insert(m.clone()) {
                    todo.push(m.clone());
                }
            }
        }
        seen
    };
    let reached: BTreeMap<&String, BTreeSet<String>> = nodes.iter().map(|n| (*n, reach(n))).collect();
    let mut out = BTreeSet::new();
    for n in &nodes {
        let component: Vec<String> = nodes
            .iter()
            .filter(|m| **m == *n || (reached[*n].contains(**m) && reached[**m].contains(*n)))
            .map(|m| (*m).clone())
            .collect();
        if component.len() > 1 {
            out.insert(component);
        }
    }
    out
}

#[test]
fn every_top_level_module_imports_from_its_layer_or_below() {
    let layer_of = |m: &str| LAYERS.iter().position(|l| l.contains(&m));
    let lower = lower_crates();
    assert!(lower.contains("events"), "the runtime re-exports the events crate as `events`: {lower:?}");
    let mut climbs = BTreeSet::new();
    let mut unplaced = BTreeSet::new();
    for (from, to) in edges(&runtime()) {
        let (Some(f), Some(t)) = (from.first(), to.first()) else { continue };
        if f == t || lower.contains(t) {
            continue;
        }
        match (layer_of(f), layer_of(t)) {
            (Some(lf), Some(lt)) if lt > lf => {
                climbs.insert((f.clone(), t.clone()));
            }
            (Some(_), Some(_)) => {}
            (None, _) => {
                unplaced.insert(f.clone());
            }
            (_, None) => {
                unplaced.insert(t.clone());
            }
        }
    }
    assert!(unplaced.is_empty(), "modules missing from LAYERS (place each in its layer): {unplaced:?}");
    let known: BTreeSet<(String, String)> = KNOWN_CLIMBS.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect();
    let new: Vec<_> = climbs.difference(&known).collect();
    assert!(new.is_empty(), "imports that climb the layers (import downward, or move the type down): {new:?}");
    let gone: Vec<_> = known.difference(&climbs).collect();
    assert!(gone.is_empty(), "these no longer climb: remove them from KNOWN_CLIMBS: {gone:?}");
}

#[test]
fn the_files_of_a_module_import_without_loops() {
    let mut graphs: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for (from, to) in edges(&runtime()).into_iter().chain(edges(&events())) {
        if from.len() < 2 || to.len() < 2 || from[0] != to[0] || from[1] == to[1] {
            continue;
        }
        graphs.entry(from[0].clone()).or_default().entry(from[1].clone()).or_default().insert(to[1].clone());
    }
    let found: BTreeSet<(String, Vec<String>)> =
        graphs.iter().flat_map(|(m, g)| loops(g).into_iter().map(move |l| (m.clone(), l))).collect();
    let known: BTreeSet<(String, Vec<String>)> = KNOWN_LOOPS
        .iter()
        .map(|(m, l)| (m.to_string(), l.iter().map(|s| s.to_string()).collect()))
        .collect();
    let new: Vec<_> = found.difference(&known).collect();
    assert!(new.is_empty(), "import loops between the files of a module: {new:?}");
    let gone: Vec<_> = known.difference(&found).collect();
    assert!(gone.is_empty(), "these loops are gone: remove them from KNOWN_LOOPS: {gone:?}");
}

#[test]
fn the_reader_sees_what_the_tests_rely_on() {
    let m = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let t = targets(&[], &m(&["activations", "state"]), "use super::record::{A, B};\nuse crate::{error::{Error, Result}, events::Bus};\nlet x = crate::torch::f();");
    assert_eq!(t, [m(&["activations", "record"]), m(&["error"]), m(&["events"]), m(&["torch", "f"])]);
    let t = targets(&[], &m(&["weights", "scheduler", "room"]), "use super::super::loads::Loads; use self::x::Y;");
    assert_eq!(t, [m(&["weights", "loads"]), m(&["weights", "scheduler", "room", "x"])]);
    // In the events crate, read as the module `events`, `crate::` is that module.
    let t = targets(&m(&["events"]), &m(&["events", "jsonl", "sink"]), "use crate::bus::EventSink; use super::zst;");
    assert_eq!(t, [m(&["events", "bus", "EventSink"]), m(&["events", "jsonl", "zst"])]);
    // A loop is found, and a chain is not one.
    let g = |e: &[(&str, &str)]| {
        let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        e.iter().for_each(|(a, b)| {
            g.entry(a.to_string()).or_default().insert(b.to_string());
        });
        g
    };
    assert_eq!(loops(&g(&[("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")])), BTreeSet::from([m(&["a", "b", "c"])]));
    assert!(loops(&g(&[("a", "b"), ("b", "c")])).is_empty());
}
