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

Inside every module folder as well (a folder with a `mod.rs`, or a `name.rs` beside a `name/`:
demux/src/dataplane/, server/src/files/), its files make a graph of their own, checked the same
way. Its nodes are the folder's children (`x.rs`, or a folder `x/` with all it holds, as at the
top) and the parent, the module's own file (`mod.rs` or `name.rs`). A path is resolved to the
item it names: `crate::`, `super::` (as many as written), `self::`, and in the parent a child's
bare name (`forward::Forward`); a path inside an inline `mod tests { .. }` starts from that
inline module, so a test's `use super::*` names its own file. A `pub use` (any `pub(..)`) is
followed to the item it re-exports, in the crate root and in every module's file. Then:
  * a child naming a sibling's item (`super::x::Y`, `crate::a::x::Y`, a re-export of it) is an
    edge child -> sibling;
  * a child naming an item defined in the parent (`super::Y`, `use super::*`) is an edge
    child -> parent: the children sit on top of what their parent defines;
  * the parent naming a child's item in its code or a private `use` is an edge parent -> child.
    Declaring a child (`mod x;`) and re-exporting its items (`pub use x::{A, B};`) is not: that
    is the parent as the children's facade, the normal shape. So a parent that imports a
    child's item while that child imports one the parent defines is a mutual pair, and the fix
    is to move the shared item down into a child of its own (or the importing code up).
Names used without a path (an item the parent re-exports, then uses by name) are not seen: the
script reads paths. Strings and comments are skipped. Folders in ALLOWED are still printed, but
their mutual pairs and circles do not fail the check.

Usage: scripts/mod-graph.py [SRC_DIR]   (default: demux/src)
"""

import re
import sys
from pathlib import Path

PATH = re.compile(r"\b(crate|super|ringmux_demux)((?:::super)*)::")

# Module folders (relative to the repository) whose inner mutual pairs and circles are reported
# but do not fail the check. Each entry is temporary and says why; remove it with the fix.
ALLOWED = set()


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


# The graph inside module folders (see the docstring).

# Comments, strings and character literals, skipped whole (a `//` in a string is no comment).
NOISE = re.compile(
    r"//[^\n]*|/\*.*?\*/|r(#*)\".*?\"\1|b?\"(?:\\.|[^\"\\])*\"|b?'(?:\\.|[^'\\\n])'", re.S
)
ROOT = re.compile(r"(?<![\w:])(\$?crate|self|super)((?:\s*::\s*super)*)\s*::\s*")
PUB_USE = re.compile(r"\bpub\s*(?:\([^)]*\))?\s*use\s*$")


def strip(code):
    """`code` without comments and literals (kept as blanks, so offsets and braces hold)."""
    return NOISE.sub(lambda m: " " * len(m.group()), code)


def module_of(src, file):
    """A file's module path below the crate root (`lib.rs`, `main.rs`: the root)."""
    parts = list(file.relative_to(src).with_suffix("").parts)
    if parts[-1] == "mod" or parts in [["lib"], ["main"]]:
        parts = parts[:-1]
    return tuple(parts)


def tree(code, pos):
    """The paths of a `use` tree or path starting at `pos`: ([(segments, local name)], end)."""
    while pos < len(code) and code[pos].isspace():
        pos += 1
    if code.startswith("{", pos):
        depth, end = 0, pos
        for end in range(pos, len(code)):
            depth += {"{": 1, "}": -1}.get(code[end], 0)
            if depth == 0:
                break
        out, depth, start = [], 0, pos + 1
        for i in range(pos + 1, end + 1):
            depth += {"{": 1, "}": -1}.get(code[i], 0)
            if (code[i] == "," and depth == 0) or i == end:
                out += tree(code[:i], start)[0]
                start = i + 1
        return out, end + 1
    if code.startswith("*", pos):
        return [(["*"], None)], pos + 1
    m = re.compile(r"\w+").match(code, pos)
    if not m:
        return [([], None)], pos
    name, pos = m.group(), m.end()
    sep = re.compile(r"\s*::\s*").match(code, pos)
    if sep and sep.end() < len(code) and re.match(r"[\w{*]", code[sep.end()]):
        rest, end = tree(code, sep.end())
        return [([name] + segs, local) for segs, local in rest], end
    alias = re.compile(r"\s+as\s+(\w+)").match(code, pos)
    return [([name], alias.group(1) if alias else name)], alias.end() if alias else pos


def inline_mods(code):
    """[(start, end, name)] of every inline `mod name { .. }` in `code` (stripped)."""
    out = []
    for m in re.finditer(r"\bmod\s+(\w+)\s*\{", code):
        depth = 0
        for end in range(m.end() - 1, len(code)):
            depth += {"{": 1, "}": -1}.get(code[end], 0)
            if depth == 0:
                break
        out.append((m.end(), end, m.group(1)))
    return out


class Crate:
    """A crate's files, the module each holds, its children, and every `pub use` alias."""

    def __init__(self, src):
        self.src = src
        self.files = {f: strip(f.read_text()) for f in sorted(src.rglob("*.rs"))}
        self.children = {}
        for f in self.files:
            mod = module_of(src, f)
            if mod:
                self.children.setdefault(mod[:-1], set()).add(mod[-1])
        self.alias = {}
        for f, code in self.files.items():
            for segs, local, at, _ in self.paths(f, code):
                if local and local != "*" and PUB_USE.search(code[:at]):
                    here = module_of(self.src, f) + tuple(n for s, e, n in inline_mods(code) if s <= at < e)
                    self.alias.setdefault(here + (local,), segs)

    def paths(self, file, code):
        """(absolute segments, local name, offset, in a `pub use`) of every path in `file`."""
        mod = module_of(self.src, file)
        inline = inline_mods(code)
        roots = [ROOT]
        kids = self.children.get(mod, ())
        if kids:
            names = "|".join(sorted(kids))
            roots.append(re.compile(rf"(?<![\w:$])({names})()\s*::\s*"))
        found = sorted((m.start(), m) for r in roots for m in r.finditer(code))
        done = 0
        for at, m in found:
            if at < done:
                continue
            here = mod + tuple(n for s, e, n in inline if s <= at < e)
            root, supers = m.group(1), m.group(2).count("super")
            if root.endswith("crate"):
                base = ()
            elif root == "self":
                base = here
            elif root == "super":
                if supers + 1 > len(here):
                    continue
                base = here[: len(here) - supers - 1]
            elif here == mod:
                base = mod + (root,)
            else:
                continue
            items, done = tree(code, m.end())
            for segs, local in items:
                if segs and segs[-1] == "self":
                    segs = segs[:-1]
                yield base + tuple(segs), local, at, bool(PUB_USE.search(code[:at]))

    def resolve(self, segs):
        """`segs` with every re-exported prefix replaced by what it re-exports."""
        for _ in range(16):
            for n in range(len(segs), 0, -1):
                target = self.alias.get(segs[:n])
                if target is not None and target != segs[:n]:
                    segs = tuple(target) + segs[n:]
                    break
            else:
                return segs
        return segs


def module_folders(src):
    """Every folder below `src` that is a module's: with a `mod.rs`, or beside a `name.rs`."""
    for d in sorted(p for p in src.rglob("*") if p.is_dir()):
        if (d / "mod.rs").exists() or d.with_suffix(".rs").exists():
            yield d


def inner_edges(src):
    """[(folder, {(from, to): {files}})] for every module folder of the crate at `src`."""
    crate = Crate(src)
    uses = []
    for f, code in crate.files.items():
        for segs, _, _, reexport in crate.paths(f, code):
            uses.append((f, module_of(src, f), crate.resolve(segs), reexport))
    out = []
    for folder in module_folders(src):
        parent = "mod.rs" if (folder / "mod.rs").exists() else folder.name + ".rs"
        prefix = folder.relative_to(src).parts
        kids = crate.children.get(prefix, set())
        found = {}
        for f, mod, segs, reexport in uses:
            if mod[: len(prefix)] != prefix or segs[: len(prefix)] != prefix:
                continue
            a = mod[len(prefix)] if len(mod) > len(prefix) else parent
            if len(segs) == len(prefix):
                continue
            b = segs[len(prefix)] if segs[len(prefix)] in kids else parent
            if a == b or (a == parent and reexport):
                continue
            found.setdefault((a, b), set()).add(str(f.relative_to(src)))
        out.append((folder, found))
    return out


def report(found, label=""):
    """Prints a graph's edges, mutual pairs and circles; returns (mutual pairs, circles)."""
    graph = {}
    for (a, b), files in sorted(found.items()):
        graph.setdefault(a, set()).add(b)
        print(f"{label}{a} -> {b}  ({', '.join(sorted(files))})")
    mutual = [(a, b) for a, b in sorted(found) if a < b and (b, a) in found]
    for a, b in mutual:
        print(f"mutual: {label}{a} <-> {b}")
    cycles = circles(graph)
    for group in cycles:
        print(f"circle: {label}" + " <-> ".join(group))
    return mutual, cycles


def main():
    src = Path(sys.argv[1] if len(sys.argv) > 1 else "demux/src")
    mutual, cycles = report(edges(src))
    bad = [f"{len(mutual)} mutual import(s), {len(cycles)} circle(s)"] if mutual or cycles else []
    for folder, found in inner_edges(src):
        name = folder.relative_to(src).as_posix()
        inner_mutual, inner_cycles = report(found, f"{name}/: ")
        if not (inner_mutual or inner_cycles):
            continue
        counts = f"{len(inner_mutual)} mutual import(s), {len(inner_cycles)} circle(s)"
        if allowed(folder):
            print(f"{name}/: {counts}, allowed for now (ALLOWED in {Path(__file__).name})")
        else:
            bad.append(f"{counts} in {name}/")
    if bad:
        print(f"{src}: {'; '.join(bad)}", file=sys.stderr)
        return 1
    print("no circle")
    return 0


def allowed(folder):
    """Whether `folder` is one of ALLOWED (named relative to the repository)."""
    root = Path(__file__).resolve().parent.parent
    return any((root / entry).resolve() == folder.resolve() for entry in ALLOWED)


if __name__ == "__main__":
    sys.exit(main())
