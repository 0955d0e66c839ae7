//! Dependencies between the library's top-level modules run one way: no
//! cycle (docs/design.md §3). The graph is read from the sources: every
//! `crate::module` path in code (comments and `#[cfg(test)] mod tests`
//! left out) is an edge from the module of the file it is in.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

type Graph = BTreeMap<String, BTreeSet<String>>;

/// The top-level module a file under `src/` belongs to (`None` for lib.rs).
fn module_of(rel: &Path) -> Option<String> {
    let first = rel.components().next()?.as_os_str().to_str()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    (name != "lib").then(|| name.to_owned())
}

/// The code of a file: comments dropped, and the test module at its end.
fn code_of(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let t = line.trim_start();
        if t.starts_with("#[cfg(test)]")
            && lines
                .peek()
                .is_some_and(|next| next.trim_start().starts_with("mod tests"))
        {
            break;
        }
        if t.starts_with("//") {
            continue;
        }
        out.push_str(line.split(" // ").next().unwrap_or(line));
        out.push('\n');
    }
    out
}

/// The top-level modules `code` names through `crate::`, including each of
/// a `crate::{a, b::c}` group.
fn uses_of(code: &str) -> BTreeSet<String> {
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let mut out = BTreeSet::new();
    for (i, _) in code.match_indices("crate::") {
        let rest = &code[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 0;
            let mut item_start = true;
            for (j, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => item_start = true,
                    c if c.is_whitespace() => {}
                    _ if item_start => {
                        item_start = false;
                        out.insert(ident(&group[j..]));
                    }
                    _ => {}
                }
            }
        } else {
            out.insert(ident(rest));
        }
    }
    out.retain(|m| !m.is_empty() && m != "self");
    out
}

fn graph() -> Graph {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut graph = Graph::new();
    let mut stack = vec![src.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let Some(module) = module_of(path.strip_prefix(&src).unwrap()) else {
                continue;
            };
            let rel = path.strip_prefix(&src).unwrap();
            let mut code = code_of(&std::fs::read_to_string(&path).unwrap());
            // In `src/m.rs` and `src/m/mod.rs`, `super::` is the crate root.
            if rel.components().count() == 1
                || rel.ends_with("mod.rs") && rel.components().count() == 2
            {
                code = code.replace("super::", "crate::");
            }
            let deps = graph.entry(module.clone()).or_default();
            deps.extend(uses_of(&code).into_iter().filter(|d| *d != module));
        }
    }
    graph
}

/// The strongly connected components of more than one module (Tarjan).
fn cycles(graph: &Graph) -> Vec<Vec<String>> {
    struct State<'g> {
        graph: &'g Graph,
        index: BTreeMap<&'g str, usize>,
        low: BTreeMap<&'g str, usize>,
        stack: Vec<&'g str>,
        on_stack: BTreeSet<&'g str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'g>(s: &mut State<'g>, v: &'g str) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        for w in s.graph.get(v).into_iter().flatten() {
            let w = w.as_str();
            if !s.graph.contains_key(w) {
                continue; // not a module of this crate (a macro path, say)
            }
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if s.on_stack.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut scc = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                scc.push(w.to_owned());
                if w == v {
                    break;
                }
            }
            if scc.len() > 1 {
                scc.sort();
                s.out.push(scc);
            }
        }
    }
    let mut s = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.out
}

#[test]
fn the_reader_finds_grouped_uses_and_skips_comments_and_tests() {
    let code = code_of(
        "use crate::{a::X, b, c::{d, e}};\n// use crate::f;\nfn g() { crate::h::i(); }\n\
         #[cfg(test)]\nmod tests {\n    use crate::j;\n}\n",
    );
    let found: Vec<String> = uses_of(&code).into_iter().collect();
    assert_eq!(found, ["a", "b", "c", "h"]);
}

#[test]
fn a_cycle_is_found() {
    let mut g = Graph::new();
    for (from, to) in [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")] {
        g.entry(from.into()).or_default().insert(to.into());
        g.entry(to.into()).or_default();
    }
    assert_eq!(cycles(&g), [["a", "b", "c"]]);
}

#[test]
fn no_top_level_module_depends_on_itself_through_another() {
    let graph = graph();
    assert!(graph.contains_key("engine") && graph.contains_key("ledger"));
    let found = cycles(&graph);
    let explain: Vec<String> = found
        .iter()
        .map(|scc| {
            let edges: Vec<String> = scc
                .iter()
                .flat_map(|m| {
                    graph[m]
                        .iter()
                        .filter(|d| scc.contains(d))
                        .map(move |d| format!("{m} -> {d}"))
                })
                .collect();
            format!("{{{}}}: {}", scc.join(", "), edges.join(", "))
        })
        .collect();
    assert!(
        found.is_empty(),
        "import cycles between top-level modules:\n{}",
        explain.join("\n")
    );
}
