"""Every flag of every script acts: each field of each script's Args (its own and the shared option
groups nested in it) is read somewhere, as an attribute, in the script or in common/. A static check:
a field only defined, or only logged through asdict(), is a flag parsed and then ignored."""

import ast
import dataclasses
import glob
import os
import typing

import pytest

from conftest import ROOT, load_algo

pytestmark = pytest.mark.quick  # the quick tier (launch/test.sh --quick)

COMMON = glob.glob(os.path.join(ROOT, "common", "**", "*.py"), recursive=True)

SCRIPTS = sorted(os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(ROOT, "algos", "*.py")))


def flags(cls, prefix=""):
    """(dotted path, field name) of every command-line field under the dataclass `cls`."""
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if "Suppress" in repr(hint):  # not on the command line
            continue
        inner = typing.get_args(hint)[0] if typing.get_origin(hint) is typing.Annotated else hint
        if dataclasses.is_dataclass(inner):
            yield from flags(inner, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f.name


def attributes_read(paths):
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                names.add(node.attr)
    return names


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_field_of_args_is_read(script):
    module = load_algo(script)
    sources = [os.path.join(ROOT, "algos", f"{script}.py"), *COMMON]
    read = attributes_read(sources)
    unread = [path for path, name in flags(module.Args) if name not in read]
    assert not unread, f"{script}.py: fields parsed but never read: {unread}"


def test_the_check_sees_an_unread_field():
    @dataclasses.dataclass
    class Forked:
        train: load_algo("sft").TrainArgs = dataclasses.field(default_factory=load_algo("sft").TrainArgs)
        zz_parsed_then_ignored: int = 0
        """A flag nothing reads."""

    fields = dict(flags(Forked))
    assert "train.learning_rate" in fields and len(fields) > 10
    read = attributes_read([os.path.join(ROOT, "algos", "sft.py"), *COMMON])
    assert [p for p, name in fields.items() if name not in read] == ["zz_parsed_then_ignored"]
