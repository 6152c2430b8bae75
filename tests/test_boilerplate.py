"""The boilerplate the training scripts share is the same text in each of them: blocks marked
`# ---- boilerplate: <name> ...` / `# ---- end of boilerplate: <name> ----` (as CleanRL marks the
parts a forker need not read) must be identical wherever they appear, so a fix made in one script
is made in all, and a reader who read them once can skip them."""

import glob
import os
import re

import pytest

from conftest import ROOT

pytestmark = pytest.mark.quick  # the quick tier (launch/test.sh --quick)

BLOCK = re.compile(r"# ---- boilerplate: (?P<name>[\w ]+) \(.*?\n(?P<body>.*?)[ ]*"
                   r"# ---- end of boilerplate: (?P=name) ----", re.S)


def marked_blocks():
    blocks = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "algos", "*.py"))):
        for m in BLOCK.finditer(open(path).read()):
            blocks.setdefault(m.group("name"), {})[os.path.basename(path)] = m.group("body")
    return blocks


def test_marked_boilerplate_is_identical_across_scripts():
    blocks = marked_blocks()
    torchrun = {"sft.py", "dpo.py", "kto.py", "rm.py", "distill.py"}
    required = {"log and save": torchrun, "actor loss terms": {"grpo.py", "ppo.py"}}
    assert set(required) <= set(blocks), sorted(blocks)
    for name, bodies in blocks.items():
        assert required.get(name, set()) <= set(bodies) and len(bodies) >= 2, (name, sorted(bodies))
        first = next(iter(bodies.values()))
        differing = [script for script, body in bodies.items() if body != first]
        assert not differing, f"boilerplate {name!r} differs in {differing} from {next(iter(bodies))}"


def test_every_script_finds_common_the_same_way():
    """The lines that put the checkout on sys.path and stop with one error line where common/ is not found
    (README: Forking a script) are the same in every script."""
    preamble = re.compile(r"^sys\.path\.insert\(.*?\n    sys\.exit\(.*?\n", re.S | re.M)
    found = {os.path.basename(p): preamble.findall(open(p).read())
             for p in sorted(glob.glob(os.path.join(ROOT, "algos", "*.py")))}
    assert all(len(blocks) == 1 for blocks in found.values()), found
    assert len({blocks[0] for blocks in found.values()}) == 1, found
