"""Lines a forker must read to follow a training script, counted two ways, and the size of each tier of common/.

    python -m benchmarks.reading_lines [--detail] [algos/sft.py ...]

Tiers of common/, by path (the constants below): opt-in = OPT_IN; kernel = under KERNEL_DIRS; trust = under
TRUST_DIRS or a module whose docstring's first line contains TRUST_MARK; read = every other module of common/.
Both counts start from every common/ import in the script, lazy ones included, and never enter opt-in or kernel
modules (opt-in code is read when its flag is on; a kernel is a dependency, like flash-attn).

A, must-read: the script whole; each read-tier definition reached, whole, followed through the names and imports
in its body; each trust-tier definition reached, at its face only (decorators and signature through the docstring;
a class: its header, docstring and the faces of its public methods; a constant: whole), not followed; option groups
(a @dataclass named *Args) whole and followed, in either tier; each read-tier module's docstring and imports.

B, strict: each definition reached, whole, followed through every tier it may enter; each entered module's
docstring and imports. Registry dispatch: entering a module runs its top-level imports (those modules are entered)
and its top-level statements that call one of REGISTRY_CALLS (e.g. `AttentionInterface.register(NAME, fn)`): those
statements count, and the names in them are reached. A dict of name -> function needs no rule: the dict is reached
where it is used, and the functions named in it with it.

Physical lines, blank lines included; a definition reached twice counts once.
"""

import argparse
import ast
import functools
import os
import sys
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRUST_DIRS = ("common/infra/",)
TRUST_MARK = "read the faces, trust the body"
KERNEL_DIRS = ("common/kernels/",)
OPT_IN = {"common/ring_attention.py", "common/episodes.py", "common/async_rollouts.py"}
REGISTRY_CALLS = {"register", "register_engine"}
PUBLIC_DUNDERS = {"__init__", "__call__"}  # methods whose face a class shows, besides those not starting with _
SCRIPTS = ["algos/sft.py", "algos/dpo.py", "algos/grpo.py", "algos/ppo.py"]
TARGETS = {"algos/sft.py": (650, 1450), "algos/dpo.py": (765, 1600), "algos/grpo.py": (1235, 3350),
           "algos/ppo.py": (1390, 3600)}  # script -> (A, B): the must-read promise, the default-path ceiling
TIER_TARGETS = {"read": 900, "core": 3700}  # core = common/ without opt-in and kernel modules


def first_line(node):
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])


def span(node):
    return node.end_lineno - first_line(node) + 1


def is_docstring(node):
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def is_option_group(node):
    """A @dataclass whose name ends in Args."""
    def name(d):
        d = d.func if isinstance(d, ast.Call) else d
        return d.id if isinstance(d, ast.Name) else getattr(d, "attr", None)
    return (isinstance(node, ast.ClassDef) and node.name.endswith("Args")
            and "dataclass" in map(name, node.decorator_list))


def face_lines(node):
    """Decorators and signature through the docstring; a class adds the faces of its public methods."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return span(node)
    body = node.body
    end = body[0].end_lineno if is_docstring(body[0]) else max(node.lineno, first_line(body[0]) - 1)
    n = end - first_line(node) + 1
    if isinstance(node, ast.ClassDef):
        n += sum(face_lines(s) for s in body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and (not s.name.startswith("_") or s.name in PUBLIC_DUNDERS))
    return n


def tier_of(rel, docstring):
    if rel in OPT_IN:
        return "opt-in"
    if rel.startswith(KERNEL_DIRS):
        return "kernel"
    if rel.startswith(TRUST_DIRS) or TRUST_MARK in (docstring or "").strip().split("\n")[0].lower():
        return "trust"
    return "read" if rel.startswith("common/") else "script"


class Module:
    """One parsed file: tier, top-level definitions, import bindings, header and registry statements."""

    def __init__(self, path, root):
        self.path, self.root = path, root
        self.rel = os.path.relpath(path, root).replace(os.sep, "/")
        self.package = os.path.dirname(self.rel).replace("/", ".")
        source = open(path).read()
        self.lines, self.tree = len(source.splitlines()), ast.parse(source)
        self.tier = tier_of(self.rel, ast.get_docstring(self.tree))
        self.defs, self.imports, self.header, self.registry = {}, {}, 0, []
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defs[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    self.defs.update({n.id: node for n in ast.walk(target) if isinstance(n, ast.Name)})
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                self.imports.update(self.resolve(node))
            if isinstance(node, (ast.Import, ast.ImportFrom)) or is_docstring(node):
                self.header += span(node)
            elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and any(
                    isinstance(c, ast.Call) and call_name(c) in REGISTRY_CALLS for c in ast.walk(node)):
                self.registry.append(node)

    def file_of(self, dotted):
        parts = dotted.split(".")
        for path in (os.path.join(self.root, *parts) + ".py", os.path.join(self.root, *parts, "__init__.py")):
            if parts[0] == "common" and os.path.isfile(path):
                return path

    def resolve(self, node):
        """{bound name: (file, name), or (file, None) for a module} for the common/ targets of an import."""
        if isinstance(node, ast.Import):
            return {a.asname or a.name: (self.file_of(a.name), None) for a in node.names if self.file_of(a.name)}
        base = node.module or ""
        if node.level:
            parts = self.package.split(".")
            base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
        out = {}
        for a in node.names:
            if self.file_of(f"{base}.{a.name}"):
                out[a.asname or a.name] = (self.file_of(f"{base}.{a.name}"), None)
            elif self.file_of(base) and a.name != "*":
                out[a.asname or a.name] = (self.file_of(base), a.name)
        return out

    def references(self, node):
        """What a body reaches: every import in it, and the names it uses (definitions, imports, `module.name`)."""
        lazy = {}
        for sub in ast.walk(node):
            if isinstance(sub, (ast.Import, ast.ImportFrom)):
                lazy.update(self.resolve(sub))
        bound, refs = {**self.imports, **lazy}, set(lazy.values())
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and sub.id in bound:
                refs.add(bound[sub.id])
            elif isinstance(sub, ast.Name) and sub.id in self.defs:
                refs.add((self.path, sub.id))
            elif isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id in bound:
                path, name = bound[sub.value.id]
                refs.add((path, sub.attr) if name is None else (path, name))
        return refs


def call_name(call):
    return call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", None)


def walk(script, root, strict, modules):
    """{(module, first line): (lines, tier, kind, label)} for what one script's reader counts; strict: B, else A."""
    counted, entered, seen = {}, set(), set()
    todo = [t for t in modules(script).references(modules(script).tree) if t[0] != script]
    while todo:
        target = todo.pop()
        if target in seen:
            continue
        seen.add(target)
        m = modules(target[0])
        if m.tier in ("opt-in", "kernel"):
            continue
        if m.path not in entered:
            entered.add(m.path)
            if strict or m.tier == "read":
                counted[(m.rel, 0)] = (m.header, m.tier, "header", "docstring and imports")
            if strict:
                todo += [(path, None) for path, _ in m.imports.values()]
                for node in m.registry:
                    counted[(m.rel, first_line(node))] = (span(node), m.tier, "registry", "registry call")
                    todo += m.references(node)
        name = target[1]
        if name is not None and name not in m.defs and name in m.imports:  # a re-export
            todo.append(m.imports[name])
        if name is None or name not in m.defs:
            continue
        node = m.defs[name]
        kind = "option group" if is_option_group(node) else "whole" if strict or m.tier == "read" else "face"
        lines = face_lines(node) if kind == "face" else span(node)
        counted[(m.rel, first_line(node))] = (lines, m.tier, kind, getattr(node, "name", name))
        if kind != "face":
            todo += m.references(node)
    return counted


def measure(script, root=ROOT):
    """A and B for one script: {"A": {"script", "read", "faces", "option groups", "total"},
    "B": {"script", "common", "modules": {module: lines}, "total"}, "detail": {"A": walk, "B": walk}}."""
    modules = functools.cache(lambda path: Module(path, root))
    script = os.path.abspath(script)
    a, b = walk(script, root, False, modules), walk(script, root, True, modules)
    own = modules(script).lines
    kinds = Counter()
    for lines, _, kind, _ in a.values():
        kinds[{"whole": "read", "header": "read", "face": "faces"}.get(kind, "option groups")] += lines
    per_module = Counter()
    for (rel, _), (lines, *_) in b.items():
        per_module[rel] += lines
    common = sum(per_module.values())
    return {"A": {"script": own, "read": kinds["read"], "faces": kinds["faces"],
                  "option groups": kinds["option groups"], "total": own + sum(kinds.values())},
            "B": {"script": own, "common": common, "modules": dict(per_module), "total": own + common},
            "detail": {"A": a, "B": b}}


def tier_sizes(root=ROOT):
    """Lines of common/ per tier, and core (every tier but opt-in and kernel)."""
    sizes = Counter({"read": 0, "trust": 0, "opt-in": 0, "kernel": 0})
    for folder, _, files in os.walk(os.path.join(root, "common")):
        for f in sorted(files):
            if f.endswith(".py"):
                m = Module(os.path.join(folder, f), root)
                sizes[m.tier] += m.lines
    sizes["core"] = sizes["read"] + sizes["trust"]
    return dict(sizes)


def verdict(value, target):
    return f"target {target:,}: {'met' if value <= target else 'not met'}"


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("scripts", nargs="*", default=SCRIPTS)
    parser.add_argument("--detail", action="store_true", help="list each counted definition, its tier and lines")
    args = parser.parse_args(argv)
    sizes = tier_sizes()
    print("common/ tiers: " + ", ".join(
        f"{t} {n:,}" + (f" ({verdict(n, TIER_TARGETS[t])})" if t in TIER_TARGETS else "") for t, n in sizes.items()))
    for script in args.scripts:
        path = script if os.path.isfile(script) else os.path.join(ROOT, script)
        rel = os.path.relpath(os.path.abspath(path), ROOT).replace(os.sep, "/")
        r = measure(path)
        a, b = r["A"], r["B"]
        target_a, target_b = TARGETS.get(rel, (None, None))
        modules = ", ".join(f"{m} {n:,}" for m, n in sorted(b["modules"].items(), key=lambda kv: -kv[1]))
        print(f"{rel}: A {a['total']:,} (script {a['script']:,}, read {a['read']:,}, faces {a['faces']:,}, "
              f"option groups {a['option groups']:,})" + (f" [{verdict(a['total'], target_a)}]" if target_a else "")
              + f" | B {b['total']:,} (common/ {b['common']:,}: {modules})"
              + (f" [{verdict(b['total'], target_b)}]" if target_b else ""))
        if args.detail:
            for which, counted in r["detail"].items():
                for (module, line), (lines, tier, kind, name) in sorted(counted.items()):
                    print(f"    {which}  {f'{module}:{line}' if line else module}  {name}  {tier} {kind}  {lines}")


if __name__ == "__main__":
    main(sys.argv[1:])
