"""benchmarks/reading_lines.py on a tiny tree whose A and B were counted by hand (line numbers in the comments)."""

import os
import textwrap

import pytest

from benchmarks import reading_lines

pytestmark = pytest.mark.quick  # the quick tier (launch/test.sh --quick)

TREE = {
    "algos/train.py": '''
        """Fake script."""
        from common.infra.engine import Engine, EngineArgs
        from common.ring_attention import ring_fn
        from common.rows import RowArgs, make_row


        def main():
            if False:
                ring_fn()
            return make_row(Engine(EngineArgs(), RowArgs()))
        ''',
    "common/__init__.py": "",
    "common/infra/__init__.py": "",
    "common/rows.py": '''
        """Rows."""
        from dataclasses import dataclass

        from common.infra.engine import LIMIT, helper


        @dataclass
        class RowArgs:
            size: int = 4


        def make_row(engine):
            return helper(engine) + LIMIT + _pad()


        def _pad():
            return 1


        def unused():
            return 2
        ''',
    "common/infra/engine.py": '''
        """Engine set-up."""
        from dataclasses import dataclass

        from transformers import AttentionInterface

        from common.kernels.attn import attend

        LIMIT = 8


        @dataclass
        class EngineArgs:
            """Engine flags."""
            steps: int = LIMIT


        class Engine:
            """An engine.

            Holds a model."""

            def __init__(self, args, rows):
                """Build it."""
                self.x = helper(self)

            def step(self):
                return attend() + _inner()

            def _private(self):
                """Private."""
                return 0


        def helper(engine):
            """Help."""
            return _inner()


        def _inner():
            return 3


        def _registered():
            return 4


        AttentionInterface.register("fake", _registered)
        ''',
    "common/ckpt.py": '''
        """Checkpoints. Read the faces, trust the body."""


        def save():
            return 0
        ''',
    "common/ring_attention.py": '''
        """Ring attention (opt-in)."""


        def ring_fn():
            return 0
        ''',
    "common/kernels/attn.py": '''
        """A kernel."""


        def attend():
            return 0
        ''',
}


def build(root):
    for rel, text in TREE.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(textwrap.dedent(text).lstrip("\n"))


def test_counts_by_hand(tmp_path):
    build(tmp_path)
    r = reading_lines.measure(str(tmp_path / "algos" / "train.py"), str(tmp_path))
    # A: script 10; rows.py: docstring and imports 3 (lines 1, 2, 4), make_row 2, _pad 2 (unused not reached);
    # faces in engine.py: Engine 7 (class line and docstring 17-20, __init__ 22-23, step 26; _private not public),
    # helper 2 (34-35), LIMIT 1 (reached from EngineArgs); option groups: RowArgs 3, EngineArgs 4 (whole in trust).
    # The opt-in ring_fn is not counted.
    assert r["A"] == {"script": 10, "read": 7, "faces": 10, "option groups": 7, "total": 34}
    # B: rows.py as in A plus RowArgs = 10; engine.py: docstring and imports 4, LIMIT 1, EngineArgs 4, Engine 15,
    # helper 3, _inner 2, the register call 1 and what it registers, _registered 2 = 32; the kernel's attend not.
    assert r["B"]["modules"] == {"common/rows.py": 10, "common/infra/engine.py": 32}
    assert (r["B"]["script"], r["B"]["common"], r["B"]["total"]) == (10, 42, 52)


def test_tier_sizes(tmp_path):
    build(tmp_path)
    assert reading_lines.tier_sizes(str(tmp_path)) == {
        "read": 21, "trust": 47 + 5, "opt-in": 5, "kernel": 5, "core": 21 + 52}
