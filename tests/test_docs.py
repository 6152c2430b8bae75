"""The project's text agrees with itself: no text narrates the project's own development, the README stays
short, relative links in README.md and docs/ point to files (and headings) that exist, and every flag a page
names exists in the --help of the script(s) the page is about. Fast: no torchrun, no subprocess."""

import dataclasses
import os
import re
import typing

import pytest
import tyro

from conftest import ROOT, load_algo

pytestmark = pytest.mark.quick  # the quick tier (launch/test.sh --quick)

README_MAX_LINES = 300
SKIP_DIRS = {".git", ".venv", "assets", "outputs", "runs", "wandb", "__pycache__", ".pytest_cache", "node_modules"}
TEXT_SUFFIXES = (".md", ".py", ".sh", ".txt", ".toml", ".ini", ".sbatch")

# Wording that narrates development (numbered or relative periods of work, diaries of changes). Each pattern is
# written so that this file's own text does not match it (a \s or a group between the words).
_PERIOD = "(?:sess" + "ion|peri" + "od)"
NARRATION = [
    (re.compile(r"\b" + _PERIOD + r"\s\d+", re.I), "a numbered period of work"),
    (re.compile(r"\b(?:this|last|next|previous|earlier)\s" + _PERIOD + r"\b", re.I), "a relative period of work"),
    (re.compile(r"\bwhat\schanged\b", re.I), "a diary of changes"),
    (re.compile(r"\b(?:before|after)\sthe\smove\sto\b", re.I), "a before / after story"),
]

ALL_SCRIPTS = ["sft", "rm", "dpo", "kto", "distill", "generate", "grpo", "ppo"]
TRAINING_SCRIPTS = [s for s in ALL_SCRIPTS if s != "generate"]
SERVER = "launch.reward_server"  # the reward server's CLI (its ServeArgs), run as python -m launch.reward_server
# which scripts' flags a page may name in its prose
PAGE_SCRIPTS = {
    "README.md": ALL_SCRIPTS,
    "docs/sft.md": ["sft"],
    "docs/preference.md": ["dpo", "kto", "rm"],
    "docs/rl.md": ["grpo", "ppo"],
    "docs/distill.md": ["distill"],
    "docs/generate.md": ["generate", SERVER],
    "docs/long-context.md": TRAINING_SCRIPTS,
    "docs/scale-out.md": ALL_SCRIPTS,
    "docs/performance.md": ALL_SCRIPTS,
    "docs/testing.md": ALL_SCRIPTS,
    "docs/differences-from-openrlhf.md": ALL_SCRIPTS,
}
# flags of the launchers and installers the pages show (torchrun, sbatch, pip), not of our scripts
LAUNCHER_FLAGS = {"--nproc_per_node", "--nnodes", "--standalone", "--nodes", "--wait", "--no-build-isolation",
                  "--no-deps", "--extra-index-url", "--dry-run", "--help"}

FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*\*?")
INVOKES = re.compile(r"algos/(\w+)\.py|" + re.escape(SERVER))
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
OTHER_COMMAND = re.compile(r"`\s*(?:[A-Z_]+=\S*\s+)*(?:python|pip|pytest|bash|sbatch|srun|torchrun|ray)\b")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def text_files():
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".venv"))
        for name in sorted(filenames):
            if name.endswith(TEXT_SUFFIXES):
                yield os.path.join(dirpath, name)


def doc_pages():
    pages = [os.path.join(ROOT, "README.md")]
    docs = os.path.join(ROOT, "docs")
    if os.path.isdir(docs):
        pages += sorted(os.path.join(docs, n) for n in os.listdir(docs) if n.endswith(".md"))
    return pages


def rel(path):
    return os.path.relpath(path, ROOT)


# ---- (a) no development narration ----------------------------------------------------------------
def narration_hits(lines):
    return [(i, why, m.group(0)) for i, line in enumerate(lines, 1) for pattern, why in NARRATION
            for m in pattern.finditer(line)]


def test_the_narration_patterns_catch_what_they_should_and_leave_technical_uses():
    period = "sess" + "ion"
    caught = [f"measured in {period} 16", f"as {period.title()} 9 found", f"the last {period}'s figures",
              "peri" + "od 3 of the work", "what " + "changed: engines", "after " + "the move to common/rollout.py"]
    fine = ['@pytest.fixture(scope="session")', "ray's session_latest/logs", "a session fixture",
            "periodic evaluation", "torchrun puts workers in sessions of their own"]
    assert [i for i, *_ in narration_hits(caught)] == list(range(1, len(caught) + 1))
    assert narration_hits(fine) == []


def test_no_text_narrates_development():
    bad = []
    for path in text_files():
        with open(path, encoding="utf-8", errors="replace") as f:
            for i, why, found in narration_hits(f.read().splitlines()):
                bad.append(f"{rel(path)}:{i}: '{found}' ({why})")
    assert not bad, ("text that narrates the project's development; state what the code does and why, and move a "
                     "figure worth keeping to docs/performance.md with its date, machine and command:\n"
                     + "\n".join(bad))


# ---- (b) a short README ----------------------------------------------------------------------------
def test_readme_is_short():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        n = len(f.read().splitlines())
    assert n <= README_MAX_LINES, (f"README.md has {n} lines, more than {README_MAX_LINES}: move detail to a page "
                                   f"in docs/ and link it")


def test_readme_shows_the_test_command_ci_runs():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    assert any(re.match(r"bash launch/test\.sh(\s|$)", line) for b in blocks for line in b.splitlines()), \
        "README.md: keep the line `bash launch/test.sh` in a ```bash block (CI runs the README's test command)"


# ---- (c) relative links point to files and headings that exist -------------------------------------
def slug(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path):
    found, fenced = set(), False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if FENCE.match(line):
                fenced = not fenced
            elif not fenced and line.startswith("#"):
                found.add(slug(line.lstrip("#")))
    return found


def test_relative_links_resolve():
    bad = []
    for page in doc_pages():
        with open(page, encoding="utf-8") as f:
            lines = f.read().splitlines()
        fenced = False
        for i, line in enumerate(lines, 1):
            if FENCE.match(line):
                fenced = not fenced
                continue
            if fenced:
                continue
            for target in LINK.findall(line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
                if not os.path.exists(dest):
                    bad.append(f"{rel(page)}:{i}: link to '{target}': no file {rel(dest)}; fix the path")
                elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
                    bad.append(f"{rel(page)}:{i}: link to '{target}': {rel(dest)} has no heading with the anchor "
                               f"'#{anchor}'; fix the anchor or the heading")
    assert not bad, "relative links that point nowhere:\n" + "\n".join(bad)


# ---- (d) every flag a page names exists in its script's --help -------------------------------------
def dataclass_flags(cls):
    """Every flag tyro gives the dataclass `cls` (as the scripts call it: option groups' prefixes omitted,
    underscores): a field's name (or its configured name) and aliases, `--no_<name>` for booleans."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out = set()
    for f in dataclasses.fields(cls):
        hint, marks = hints[f.name], ()
        if typing.get_origin(hint) is typing.Annotated:
            hint, *marks = typing.get_args(hint)
        if dataclasses.is_dataclass(hint):
            out |= dataclass_flags(hint)
            continue
        if tyro.conf.Suppress in marks:
            continue
        config = next((m for m in marks if hasattr(m, "aliases") and hasattr(m, "name")), None)
        name = (config and config.name) or f.name
        out.add(f"--{name}")
        out |= set((config and config.aliases) or ())
        if hint is bool or hint == typing.Optional[bool]:
            out.add(f"--no_{name}")
    return out


@pytest.fixture(scope="module")
def flags():
    from launch.reward_server import ServeArgs

    table = {script: dataclass_flags(load_algo(script).Args) for script in ALL_SCRIPTS}
    table[SERVER] = dataclass_flags(ServeArgs)
    return table


def help_flags(text):
    """The flags in the option column of a tyro --help."""
    found = set()
    for line in text.splitlines():
        option = re.match(r"│? {1,2}(--?[A-Za-z].*)", line)  # an option's first line; descriptions are indented further
        if not option:
            continue
        names = re.split(r"\s{2,}", option.group(1).strip())[0]  # the description follows after 2+ spaces
        for part in names.split(", "):  # "--x, --no_x" or "--prompt_key STR, --input_key STR"
            found.add(part.split()[0])
    return found - {"-h", "--help"}


def printed_help(parse, monkeypatch, capsys):
    """What `python algos/X.py --help` prints, from the script's own parser run in this process."""
    monkeypatch.setenv("COLUMNS", "80")  # one column of options
    with pytest.raises(SystemExit) as exit_:
        parse(["--help"])
    assert exit_.value.code in (0, None)
    return capsys.readouterr().out


@pytest.mark.parametrize("module", ALL_SCRIPTS + [SERVER])
def test_the_flags_checked_are_those_of_the_help(module, flags, monkeypatch, capsys):
    """The table the page checks use equals the option column `--help` prints."""
    from launch import reward_server

    parse = reward_server.main if module == SERVER else load_algo(module).parse_args
    printed = help_flags(printed_help(parse, monkeypatch, capsys))
    assert printed == flags[module], f"{module}: in --help only {printed - flags[module]}, in Args only " \
                                     f"{flags[module] - printed}: update dataclass_flags in tests/test_docs.py"


def named_flags(text, page_scripts):
    """(flag, scripts it must belong to) for each flag `text` names: after `algos/X.py` (or the reward server's
    module) X's; before it, a launcher's (not checked); with no script named, the page's (None: not checked)."""
    invocations = list(INVOKES.finditer(text))
    if not invocations:
        return [(f, page_scripts) for f in FLAG.findall(text)] if page_scripts else []
    last = invocations[-1]
    return [(f, [last.group(1) or SERVER]) for f in FLAG.findall(text[last.end():])]


def check_flag(flag, scripts, flags):
    if flag in LAUNCHER_FLAGS:
        return True
    if flag.endswith("*") or flag.endswith("_"):  # a family: --vllm_*, --colocate_*, --no_
        prefix = flag.rstrip("*")
        return any(f.startswith(prefix) for s in scripts for f in flags[s])
    return any(flag in flags[s] for s in scripts)


def page_flag_problems(page, flags):
    rel_page = rel(page)
    page_scripts = PAGE_SCRIPTS.get(rel_page, ALL_SCRIPTS)
    with open(page, encoding="utf-8") as f:
        lines = f.read().splitlines()
    problems, fenced, i = [], False, 0
    while i < len(lines):
        line, start = lines[i], i + 1
        i += 1
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            while line.endswith("\\") and i < len(lines):  # one command over continued lines
                line, i = line[:-1] + " " + lines[i], i + 1
            comment = re.search(r"(?:^|\s)#", line)  # a shell comment names the page's flags
            command = line[:comment.start()] if comment else line
            named = named_flags(command, None)
            if comment and (not command.strip() or INVOKES.search(command)):  # not another program's comment
                named += named_flags(line[comment.end():], page_scripts)
        else:
            named = []
            for span in INLINE_CODE.findall(line):
                if not INVOKES.search(span) and OTHER_COMMAND.match(span):
                    continue  # another program's command line: a benchmark's, the launcher's, the installer's
                named += named_flags(span, page_scripts)
            named += named_flags(INLINE_CODE.sub(" ", line), page_scripts)
        for flag, scripts in named:
            if not check_flag(flag, scripts, flags):
                where = ", ".join("python -m launch.reward_server" if s == SERVER else f"algos/{s}.py" for s in scripts)
                problems.append(f"{rel_page}:{start}: {flag} is not a flag of {where}: fix the name (see --help), "
                                f"or say which script it belongs to")
    return problems


def test_every_flag_a_page_names_exists(flags):
    problems = [p for page in doc_pages() for p in page_flag_problems(page, flags)]
    assert not problems, "flags the docs name that the scripts do not have:\n" + "\n".join(problems)


def test_the_flag_check_sees_a_wrong_flag(flags, tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Use `--learning_rate` and `--lerning_rate`.\n\n```bash\n"
                    "torchrun --nproc_per_node 2 algos/dpo.py --beta 0.1 \\\n    --kd_coef 0.5   # --ipo\n```\n")
    problems = page_flag_problems(str(page), flags)
    assert len(problems) == 2 and "--lerning_rate" in problems[0] and ":1:" in problems[0], problems
    assert "--kd_coef is not a flag of algos/dpo.py" in problems[1] and ":4:" in problems[1], problems
