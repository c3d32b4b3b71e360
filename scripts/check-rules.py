#!/usr/bin/env python3
"""The code-shape rules of issue #55 that a script can hold: exits 1, listing each breach, if

  * a product function (in a product crate's src/, outside `#[cfg(test)]` modules) is over
    160 lines, or over its own tighter limit in LIMITS (the demux's receive loop);
  * a signature in demux, worker, proto or acme (outside tests) returns `Result<_, String>`
    (errors are typed there: thiserror; anyhow at a binary's edge).

A function's length counts from the line of `fn` to the line of its closing brace. Comments,
strings and character literals are blanked before the braces are counted.

Usage: scripts/check-rules.py   (from anywhere; reads the repository it lives in)
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ["demux", "worker", "server", "proto", "acme", "lb", "ring", "quic-lb", "inherit"]
TYPED_ERRORS = ["demux", "worker", "proto", "acme"]
MAX_LINES = 160
# (file, function): a tighter limit.
LIMITS = {("demux/src/dataplane/mod.rs", "run"): 120}

NOISE = re.compile(
    r"//[^\n]*|/\*.*?\*/|r(#*)\".*?\"\1|b?\"(?:\\.|[^\"\\])*\"|b?'(?:\\.|[^'\\\n])'", re.S
)
TEST_MOD = re.compile(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{")
FN = re.compile(
    r"(?m)^[ \t]*(?:pub(?:\([^)]*\))?\s+)?(?:const\s+)?(?:async\s+)?(?:unsafe\s+)?"
    r"(?:extern\s+\"C\"\s+)?fn\s+(\w+)"
)
RESULT_STRING = re.compile(r"Result<[^;{]*?,\s*String\s*>", re.S)


def blank(code):
    """`code` with comments and literals blanked, lines kept."""
    return NOISE.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), code)


def close(code, open_at):
    """The offset of the brace that closes the one at `open_at`."""
    depth = 0
    for end in range(open_at, len(code)):
        depth += {"{": 1, "}": -1}.get(code[end], 0)
        if depth == 0:
            return end
    return len(code) - 1


def line_of(code, at):
    """The line number of offset `at`."""
    return code.count("\n", 0, at) + 1


def body_start(code, at):
    """The offset of a function's `{` after its name at `at`; None for a declaration (`;`)."""
    depth = 0
    for i in range(at, len(code)):
        c = code[i]
        if c in "([<":
            depth += 1
        elif c in ")]" or (c == ">" and code[i - 1] != "-"):
            depth -= 1
        elif c == ";" and depth <= 0:
            return None
        elif c == "{" and depth <= 0:
            return i
    return None


def breaches(crate, rel):
    """Each breach of the rules in file `rel` (relative to the repository) of `crate`."""
    code = blank((ROOT / rel).read_text())
    tests = [(m.start(), close(code, m.end() - 1)) for m in TEST_MOD.finditer(code)]

    def in_tests(at):
        return any(s <= at <= e for s, e in tests)

    for m in FN.finditer(code):
        brace = body_start(code, m.end())
        if in_tests(m.start()) or brace is None:
            continue
        first = line_of(code, m.start())
        lines = line_of(code, close(code, brace)) - first + 1
        limit = LIMITS.get((rel, m.group(1)), MAX_LINES)
        if lines > limit:
            yield f"{rel}:{first}: fn {m.group(1)} is {lines} lines (at most {limit})"
    if crate in TYPED_ERRORS:
        for m in RESULT_STRING.finditer(code):
            if not in_tests(m.start()):
                what = " ".join(m.group().split())
                yield f"{rel}:{line_of(code, m.start())}: {what}: give it a typed error"


def main():
    found = []
    for crate in PRODUCT:
        for file in sorted((ROOT / crate / "src").rglob("*.rs")):
            found += breaches(crate, file.relative_to(ROOT).as_posix())
    for line in found:
        print(line)
    if found:
        print(f"check-rules: {len(found)} breach(es) of the rules above", file=sys.stderr)
        return 1
    print("check-rules: functions within their limits, no Result<_, String>")
    return 0


if __name__ == "__main__":
    sys.exit(main())
