"""Lines a reader must read to understand a script end to end: the script itself plus every `common/`
definition it reaches, transitively (a function, class or constant of common/ that the script uses,
then every common/ name those use, and so on), and each reached module's imports and docstring.

    python benchmarks/reading_lines.py algos/sft.py algos/dpo.py algos/grpo.py

Counted as physical lines, blank lines included, as a reader scrolls them; a definition reached twice
counts once. Lazy imports inside a reached function are followed like top-level ones.
"""

import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def module_definitions(path):
    """name -> (first line, last line, ast node) of every top-level def, class and assignment."""
    tree = ast.parse(open(path).read())
    out = {}
    for node in tree.body:
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = (start, node.end_lineno, node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for name in ast.walk(t):
                    if isinstance(name, ast.Name):
                        out[name.id] = (start, node.end_lineno, node)
    return tree, out


def header_lines(tree):
    """The module docstring and its top-level imports: what a reader sees before any definition."""
    n = 0
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)) or (
                isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            n += node.end_lineno - node.lineno + 1
    return n


def common_imports(node):
    """(module file, name) for every `from common.x import name` inside node."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.ImportFrom) and sub.module and sub.module.startswith("common."):
            path = os.path.join(ROOT, *sub.module.split(".")) + ".py"
            for alias in sub.names:
                yield path, alias.name


def used_names(node):
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def reading_lines(script):
    """(script lines, common lines, {module: lines}) for one script."""
    parsed = {}

    def defs(path):
        if path not in parsed:
            parsed[path] = module_definitions(path)
        return parsed[path]

    script_tree = ast.parse(open(script).read())
    seen, todo = set(), list(common_imports(script_tree))
    while todo:
        path, name = todo.pop()
        if (path, name) in seen or name not in defs(path)[1]:
            continue
        seen.add((path, name))
        _, _, node = defs(path)[1][name]
        todo += list(common_imports(node))
        todo += [(path, n) for n in used_names(node) if n in defs(path)[1]]
    per_module = {}
    for path in {p for p, _ in seen}:
        tree, table = defs(path)
        spans = {table[n][:2] for p, n in seen if p == path}
        per_module[os.path.relpath(path, ROOT)] = header_lines(tree) + sum(b - a + 1 for a, b in spans)
    return len(open(script).read().splitlines()), sum(per_module.values()), per_module


def main(scripts):
    for script in scripts:
        own, common, per_module = reading_lines(script)
        detail = ", ".join(f"{m} {n}" for m, n in sorted(per_module.items(), key=lambda kv: -kv[1]))
        print(f"{script}: {own + common} lines = {own} in the script + {common} in common/ ({detail})")


if __name__ == "__main__":
    main(sys.argv[1:] or ["algos/sft.py", "algos/dpo.py", "algos/grpo.py"])
