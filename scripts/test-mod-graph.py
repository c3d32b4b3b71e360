#!/usr/bin/env python3
"""Tests of scripts/mod-graph.py over small crates written to a temporary folder.

Run by .ci/run next to mod-graph.py itself: python3 scripts/test-mod-graph.py
"""

import contextlib
import importlib.util
import io
import sys
import tempfile
import unittest
from pathlib import Path

SPEC = importlib.util.spec_from_file_location("mod_graph", Path(__file__).with_name("mod-graph.py"))
mod_graph = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(mod_graph)


def run(files, allowed=()):
    """Writes `files` ({path: text}) below a fresh src/, runs the script on it: (exit, stdout)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        for name, text in files.items():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_text(text)
        saved = sys.argv, mod_graph.ALLOWED
        sys.argv = ["mod-graph.py", str(src)]
        mod_graph.ALLOWED = {str(src / a) for a in allowed}
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
                code = mod_graph.main()
        finally:
            sys.argv, mod_graph.ALLOWED = saved
        return code, out.getvalue()


# A module folder in the normal shape: the parent declares its children and re-exports their
# items, the children use what the parent defines and each other, one way.
LAYERED = {
    "lib.rs": "pub mod low;\npub mod m;\n",
    "low.rs": "pub struct Low;\n",
    "m/mod.rs": "mod a;\nmod b;\nmod c;\npub use a::A;\npub use self::b::{B, Bee as Bees};\npub struct Shared;\n",
    "m/a.rs": "use super::Shared;\nuse crate::low::Low;\npub struct A(Shared, Low);\n",
    "m/b.rs": "use super::{a::A, Shared};\npub struct B(A, Shared);\npub struct Bee;\n",
    # Its test module's `super` is c itself; a comment and a string name no module.
    "m/c.rs": "pub struct C;\n#[cfg(test)]\nmod tests {\n    use super::*;\n"
    "    // use crate::m::a::A;\n    const S: &str = \"crate::m::b::B\";\n}\n",
}


class ModGraph(unittest.TestCase):
    def test_layered_folder_passes(self):
        code, out = run(LAYERED)
        self.assertEqual(code, 0, out)
        self.assertIn("m/: a -> mod.rs  (m/a.rs)", out)
        self.assertIn("m/: b -> a  (m/b.rs)", out)
        self.assertIn("m -> low  (m/a.rs)", out)
        self.assertNotIn("mod.rs -> a", out)  # a re-export is no edge
        self.assertNotIn("m/: c ->", out)
        self.assertTrue(out.endswith("no circle\n"), out)

    def test_parent_using_a_child_that_uses_the_parent_is_mutual(self):
        files = dict(LAYERED)
        files["m/mod.rs"] += "fn make() -> a::A { todo!() }\n"
        code, out = run(files)
        self.assertEqual(code, 1, out)
        self.assertIn("m/: mod.rs -> a  (m/mod.rs)", out)
        self.assertIn("mutual: m/: a <-> mod.rs", out)

    def test_re_exported_item_counts_as_its_owner(self):
        # b names A through the parent's re-export: still b -> a; a naming it back is a pair.
        files = dict(LAYERED)
        files["m/b.rs"] = "use super::A;\npub struct B(A);\npub struct Bee;\n"
        files["m/a.rs"] = "use crate::m::b::Bee;\npub struct A(Bee);\n"
        code, out = run(files)
        self.assertEqual(code, 1, out)
        self.assertIn("mutual: m/: a <-> b", out)

    def test_circle_of_siblings_in_a_nested_folder(self):
        files = {
            "lib.rs": "mod outer;\n",
            "outer.rs": "mod inner;\n",
            "outer/inner/mod.rs": "mod x;\nmod y;\nmod z;\n",
            "outer/inner/x.rs": "use super::y::Y;\npub struct X(Y);\n",
            "outer/inner/y.rs": "pub struct Y(crate::outer::inner::z::Z);\n",
            "outer/inner/z.rs": "pub struct Z(Box<super::super::inner::x::X>);\n",
        }
        code, out = run(files)
        self.assertEqual(code, 1, out)
        self.assertIn("circle: outer/inner/: x <-> y <-> z", out)
        self.assertNotIn("mutual", out)

    def test_allowed_folder_is_reported_but_passes(self):
        files = dict(LAYERED)
        files["m/mod.rs"] += "fn make() -> a::A { todo!() }\n"
        code, out = run(files, allowed=["m"])
        self.assertEqual(code, 0, out)
        self.assertIn("mutual: m/: a <-> mod.rs", out)
        self.assertIn("allowed for now", out)

    def test_top_level_mutual_import_still_fails(self):
        files = {
            "lib.rs": "mod p;\nmod q;\n",
            "p.rs": "use crate::q::Q;\npub struct P;\n",
            "q.rs": "use crate::p::P;\npub struct Q;\n",
        }
        code, out = run(files)
        self.assertEqual(code, 1, out)
        self.assertIn("mutual: p <-> q", out)


if __name__ == "__main__":
    unittest.main()
