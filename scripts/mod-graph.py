#!/usr/bin/env python3
"""A crate's module graph: which top-level module of its src imports which, and any circle.

For checking the layering by hand or in CI. Every `crate::Y` path in a file of module X
(SRC/X.rs or SRC/X/), every `super::Y` path that climbs to the crate root, and every
`ringmux_demux::Y` path of the demux's binary (shown as `main`) is an edge X -> Y between two
top-level modules; a module the crate root re-exports (`pub use sys::alloc;`,
`pub use dataplane::{forward, tickets};`) counts as its owner's. Comments are skipped; test
code counts. Prints one edge a line with the files that make it, then every pair of modules
that import each other and every circle (a strongly connected set of modules), and exits with
1 if there is either: .ci/run runs it over every crate so that their modules stay layered.

Usage: scripts/mod-graph.py [SRC_DIR]   (default: demux/src)
"""

import re
import sys
from pathlib import Path

PATH = re.compile(r"\b(crate|super|ringmux_demux)((?:::super)*)::")


def top_module(src, file):
    """The top-level module a file belongs to, and its depth below the crate root."""
    parts = file.relative_to(src).with_suffix("").parts
    if parts[-1] == "mod":
        parts = parts[:-1]
    if parts in [("lib",), ("main",)]:
        return parts[0], 0
    return parts[0], len(parts)


def group_at(code, start):
    """The `{...}` group (braces balanced) or the name that starts at `start`."""
    if code.startswith("{", start):
        depth = 0
        for end in range(start, len(code)):
            depth += {"{": 1, "}": -1}.get(code[end], 0)
            if depth == 0:
                return code[start:end + 1]
    return re.match(r"\w*", code[start:]).group()


def heads(rest):
    """The first name of a path's rest, or of each item of a `{a, b::c, d::{e}}` group."""
    if not rest.startswith("{"):
        return [rest]
    items, depth, item = [], 0, ""
    for ch in rest[1:-1] + ",":
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(item)
            item = ""
        else:
            item += ch
    return [m.group() for m in (re.search(r"\w+", i) for i in items) if m]


def targets(src, file, code):
    """The top-level modules `code`, the text of `file`, names by path."""
    module, depth = top_module(src, file)
    for m in PATH.finditer(code):
        root, supers = m.group(1), m.group(2)
        # `super` from depth d names depth d - 1 (a `mod.rs` is its folder's module).
        if root == "super" and depth - 1 - supers.count("super") > 0:
            continue
        if root == "ringmux_demux" and module != "main":
            continue
        yield from heads(group_at(code, m.end()))


def edges(src):
    """{(from, to): {files}} among the top-level modules of `src`."""
    known = {p.stem for p in src.glob("*.rs")} | {p.name for p in src.iterdir() if p.is_dir()}
    lib = src / "lib.rs"
    lib_code = lib.read_text() if lib.exists() else ""
    owner = {}
    for a, names in re.findall(r"^pub use (\w+)::((?:\w+::)*\w+|\{[^}]*\});", lib_code, re.M):
        for name in re.findall(r"\w+(?=\s*(?:,|\}|$))", names):
            owner[name] = a
    found = {}
    for file in sorted(src.rglob("*.rs")):
        code = re.sub(r"//[^\n]*", "", file.read_text())
        module, _ = top_module(src, file)
        for target in targets(src, file, code):
            target = owner.get(target, target)
            if target in known and target not in (module, "lib", "main"):
                found.setdefault((module, target), set()).add(str(file.relative_to(src)))
    return found


def circles(graph):
    """The strongly connected sets of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on.discard(group[-1])
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main():
    src = Path(sys.argv[1] if len(sys.argv) > 1 else "demux/src")
    found = edges(src)
    graph = {}
    for (a, b), files in sorted(found.items()):
        graph.setdefault(a, set()).add(b)
        print(f"{a} -> {b}  ({', '.join(sorted(files))})")
    mutual = [(a, b) for a, b in sorted(found) if a < b and (b, a) in found]
    for a, b in mutual:
        print(f"mutual: {a} <-> {b}")
    cycles = circles(graph)
    for group in cycles:
        print("circle: " + " <-> ".join(group))
    if mutual or cycles:
        print(f"{src}: {len(mutual)} mutual import(s), {len(cycles)} circle(s)", file=sys.stderr)
        return 1
    print("no circle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
