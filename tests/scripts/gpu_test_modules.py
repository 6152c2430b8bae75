"""Which test modules launch/gpu_checks.sh can collect here: a module whose imports (its own, or those of the
project modules it imports, at module level) need a package that is not installed (vllm, ray, flash_attn, ...)
would stop pytest's collection of every module, so it is left out by name. Reads the files (ast), imports
nothing. Prints one `--ignore=PATH` per module left out on stdout and the reason on stderr."""

import ast
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OWN = {"common", "algos", "tests", "benchmarks", "conftest", "launch"}


def top_level_imports(source):
    """Module names imported at module level (not inside functions) by `source`."""
    names = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, (ast.If, ast.Try)):  # guarded imports count as needed only outside a try
            if isinstance(node, ast.If):
                names += top_level_imports(ast.unparse(ast.Module(body=node.body, type_ignores=[])))
    return names


def needed_packages(path, read, seen=None):
    """Third-party top-level packages `path` needs at import, through the project modules it imports."""
    seen = set() if seen is None else seen
    if path in seen:
        return set()
    seen.add(path)
    needed = set()
    for name in top_level_imports(read(path)):
        top = name.split(".")[0]
        if top in OWN:
            own = os.path.join(ROOT, *name.split(".")) + ".py"
            if os.path.exists(own):
                needed |= needed_packages(own, read, seen)
            elif top == "conftest":
                needed |= needed_packages(os.path.join(ROOT, "tests", "conftest.py"), read, seen)
        elif os.path.exists(os.path.join(ROOT, "tests", top + ".py")):  # a sibling test module (test_grpo)
            needed |= needed_packages(os.path.join(ROOT, "tests", top + ".py"), read, seen)
        elif top not in sys.stdlib_module_names:
            needed.add(top)
    return needed


def modules_left_out(test_files, installed, read=lambda p: open(p).read()):
    """[(test file, missing packages)] for the test files that need a package `installed(name)` denies."""
    out = []
    for path in test_files:
        missing = sorted(p for p in needed_packages(path, read) if not installed(p))
        if missing:
            out.append((path, missing))
    return out


def main():
    tests = os.path.join(ROOT, "tests")
    files = sorted(os.path.join(tests, f) for f in os.listdir(tests) if f.startswith("test_") and f.endswith(".py"))
    for path, missing in modules_left_out(files, lambda name: importlib.util.find_spec(name) is not None):
        print(f"--ignore={os.path.relpath(path, ROOT)}")
        print(f"LEFT OUT {os.path.relpath(path, ROOT)}: {', '.join(missing)} not installed", file=sys.stderr)


if __name__ == "__main__":
    main()
