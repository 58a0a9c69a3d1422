//! docs/architecture.md is the map a newcomer reads first, so it must stay true: this fails
//! when a repository path it names in backticks no longer exists, when a workspace crate is
//! missing from its table of crates, or when the dependency edges it lists differ from the
//! Cargo manifests (`cargo metadata`, normal dependencies between workspace crates, optional
//! ones included).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn doc() -> String {
    std::fs::read_to_string(workspace().join("docs/architecture.md")).unwrap()
}

/// The text outside fenced code blocks (the pictures), where backticks delimit code spans.
fn prose(doc: &str) -> String {
    let mut fenced = false;
    let mut out = String::new();
    for line in doc.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

fn code_spans(text: &str) -> impl Iterator<Item = &str> {
    text.split('`').skip(1).step_by(2)
}

/// Crate short names (the folder) → the workspace crates each links, from the manifests.
fn manifest_edges() -> BTreeMap<String, BTreeSet<String>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(workspace())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let packages = meta["packages"].as_array().unwrap();
    let folder = |manifest: &str| {
        Path::new(manifest)
            .parent()
            .unwrap()
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned()
    };
    let by_name: BTreeMap<&str, String> = packages
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap(),
                folder(p["manifest_path"].as_str().unwrap()),
            )
        })
        .collect();
    packages
        .iter()
        .map(|p| {
            let me = &by_name[p["name"].as_str().unwrap()];
            let links = p["dependencies"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|d| d["kind"].is_null())
                .filter_map(|d| by_name.get(d["name"].as_str().unwrap()))
                .filter(|d| *d != me)
                .cloned()
                .collect();
            (me.clone(), links)
        })
        .collect()
}

/// The edges the document states in its paragraph beginning "As edges": `` `a → b, c (feature
/// f)` `` spans, and the sentence naming the crates that "link no kvfabric crate".
fn stated_edges(doc: &str) -> BTreeMap<String, BTreeSet<String>> {
    let prose = prose(doc);
    let start = prose
        .find("As edges")
        .expect("docs/architecture.md: the paragraph beginning \"As edges\"");
    let text = &prose[start..];
    // One line: a code span may be wrapped.
    let text = text[..text.find("\n\n").unwrap_or(text.len())]
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    let mut edges = BTreeMap::new();
    for span in code_spans(&text) {
        let Some((from, to)) = span.split_once(" → ") else {
            continue;
        };
        let mut plain = String::new();
        let mut depth = 0;
        for c in to.chars() {
            match c {
                '(' => depth += 1,
                ')' => depth -= 1,
                _ if depth == 0 => plain.push(c),
                _ => {}
            }
        }
        let targets = plain.split(',').map(|t| t.trim().to_string()).collect();
        assert!(
            edges.insert(from.trim().to_string(), targets).is_none(),
            "docs/architecture.md states the edges of `{from}` twice"
        );
    }
    let at = text
        .find("link no kvfabric crate")
        .expect("docs/architecture.md: the crates that \"link no kvfabric crate\"");
    let clause = &text[text[..at].rfind(';').map_or(0, |i| i + 1)..at];
    for c in code_spans(clause) {
        edges.insert(c.to_string(), BTreeSet::new());
    }
    edges
}

#[test]
fn the_crate_graph_it_states_is_the_manifests_graph() {
    let doc = doc();
    let stated = stated_edges(&doc);
    let real = manifest_edges();
    let mut wrong = Vec::new();
    for (krate, links) in &real {
        match stated.get(krate) {
            None => wrong.push(format!(
                "`{krate}` is not in the edges (it links {links:?})"
            )),
            Some(s) if s != links => wrong.push(format!(
                "`{krate}`: stated {s:?}, the manifest links {links:?}"
            )),
            Some(_) => {}
        }
    }
    for krate in stated.keys().filter(|k| !real.contains_key(*k)) {
        wrong.push(format!("`{krate}` is stated but is no workspace crate"));
    }
    assert!(
        wrong.is_empty(),
        "docs/architecture.md:\n{}",
        wrong.join("\n")
    );
    // Every crate has its row in the table, by folder.
    for krate in real.keys() {
        assert!(
            doc.contains(&format!("| `{krate}/` |")),
            "docs/architecture.md: no row for `{krate}/` in the table of crates"
        );
    }
}

#[test]
fn every_path_it_names_exists() {
    let root = workspace();
    let tops: BTreeSet<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.') && n != "target")
        .collect();
    let file_like = [
        ".rs", ".md", ".proto", ".sh", ".py", ".yaml", ".toml", ".cu", ".ptx",
    ];
    let doc = doc();
    let mut missing = Vec::new();
    let mut checked = 0;
    for span in code_spans(&prose(&doc)) {
        let is_path = span.contains('/')
            && !span.contains(char::is_whitespace)
            && !span.starts_with('/')
            && !span.contains(['<', '*', ':', '{']);
        if !is_path {
            continue;
        }
        let first = span.split('/').next().unwrap();
        let named_file = file_like.iter().any(|e| span.ends_with(e));
        if !tops.contains(first) && !named_file {
            // Not a repository path (`kvfabric.io/v1alpha1`, a registry key).
            continue;
        }
        checked += 1;
        if !root.join(span).exists() {
            missing.push(span.to_string());
        }
    }
    assert!(
        checked > 50,
        "only {checked} paths found: is the parser still right?"
    );
    assert!(
        missing.is_empty(),
        "docs/architecture.md names paths that do not exist: {missing:?}"
    );
}
