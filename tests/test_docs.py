"""The docs cannot drift: every example in README.md and docs/*.md runs, or is checked, here.

* ```python blocks run. The blocks of one file run in order in ONE namespace (a later block may use the
  names an earlier one made, as docs/schedule.md does), in a fresh temporary working directory per file
  holding a copy of examples/ (a block may name ``examples/user_task.py`` as a user in a checkout would),
  with FutureWarning an error (a block shows no deprecated call). A block whose fence has the line
  ``<!-- docs: compile-only -->`` directly above it is only compiled; its ``globalbatch`` imports are
  resolved (every imported name must exist), every ``gb.X.Y`` it reads must exist, and every call of an
  imported globalbatch name must bind to its signature (every keyword a parameter).
* ```console blocks: each ``$ globalbatch ...`` line runs in-process through :func:`globalbatch.cli.main`
  (in a temporary directory holding a copy of examples/; exit 0, or 2 where the doc shows an ``error:``
  line), and the lines shown below it must be in the real output, in order (whitespace and rule lengths
  normalized). Rows of a rich table may be left out next to a row the doc shows; any other line may be
  left out only where the doc has a ``...`` line. A compile-only console block is not run: its flags are
  checked instead. A block with ``$ `` lines must be a console block.
* Every other block (```bash, plain ```): each ``globalbatch <command>`` in it must name a command and
  every ``--flag`` after it must be a flag of that command; ``make X`` must be a Makefile target. The same
  for inline code spans that start with ``globalbatch <command>``.
* Prose: every ``--flag`` anywhere is a flag of some globalbatch command, or appears in a script of
  benchmarks/, examples/ or experiments/, or is one of :data:`OTHER_TOOLS_FLAGS`; every ``globalbatch.x.y``
  name, ``globalbatch/x.py`` path and cited ``tests/…::test_name``, ``benchmarks/…`` or ``examples/…`` file
  exists (a deprecated alias does not count); no deprecated name appears where the text does not say so.
* README.md's layout tree lists every module and package of src/globalbatch, and nothing else.
* History lives in CHANGELOG.md: no issue numbers, stop numbers, dates or "after the review" in src/,
  docs/ or README.md.

Slow blocks are marked compile-only rather than let this file grow slow (it runs in well under a minute).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import shlex
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COMPILE_ONLY = "<!-- docs: compile-only -->"
OTHER_TOOLS_FLAGS = {
    "--nproc_per_node",  # torchrun
    "--rampup-batch-size",  # Megatron-LM, cited as the origin of a schedule
    "--step-batch-size-schedule",  # Megatron-LM / DeepSpeed, cited likewise
}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    compile_only: bool

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def blocks_of(path: Path) -> list[Block]:
    out, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, j = i, i + 1
        while j < len(lines) and not re.match(r"^```\s*$", lines[j]):
            j += 1
        marked = start > 0 and lines[start - 1].strip() == COMPILE_ONLY
        out.append(Block(path, start + 1, m.group(1), "\n".join(lines[start + 1:j]) + "\n", marked))
        i = j + 1
    return out


ALL_BLOCKS = [b for f in DOC_FILES for b in blocks_of(f)]
PY_FILES = sorted({b.path for b in ALL_BLOCKS if b.lang == "python"})


# ---------------------------------------------------------------------------
# python blocks
# ---------------------------------------------------------------------------

def _code(block: Block):
    # padded with newlines so that a traceback names the doc's own line
    return compile("\n" * block.line + block.text, str(block.path.relative_to(REPO)), "exec")


def _imported_globalbatch_names(tree: ast.AST) -> dict[str, object]:
    """Resolve every ``globalbatch`` import of a block; {local name: object}. Fails on any that does not exist."""
    names: dict[str, object] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "globalbatch":
            mod = importlib.import_module(node.module)
            for alias in node.names:
                if hasattr(mod, alias.name):
                    obj = getattr(mod, alias.name)
                else:  # a submodule: from globalbatch import probe
                    obj = importlib.import_module(f"{node.module}.{alias.name}")
                names[alias.asname or alias.name] = obj
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "globalbatch":
                    mod = importlib.import_module(alias.name)
                    names[alias.asname or alias.name.split(".")[0]] = mod if alias.asname else importlib.import_module("globalbatch")
    return names


def _resolve(func: ast.expr, names: dict[str, object]):
    """The globalbatch object a call's function names (``X`` or ``gb.X.Y``), or None."""
    chain = []
    while isinstance(func, ast.Attribute):
        chain.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name) or func.id not in names:
        return None
    obj = names[func.id]
    for attr in reversed(chain):
        obj = getattr(obj, attr)  # a missing attribute of a globalbatch module is drift: let it raise
    return obj


def _check_calls(tree: ast.AST, names: dict[str, object], where: str) -> None:
    """Every ``gb.X.Y`` of an imported globalbatch name exists, and every call of one binds to its signature."""
    sentinel = object()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            try:
                _resolve(node, names)
            except AttributeError as exc:
                raise AssertionError(f"{where}, line {node.lineno}: {ast.unparse(node)}: {exc}") from None
        if not isinstance(node, ast.Call):
            continue
        obj = _resolve(node.func, names)
        if obj is None or not callable(obj):
            continue
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            continue
        try:
            sig = inspect.signature(obj)
        except (TypeError, ValueError):
            continue
        try:
            sig.bind_partial(*[sentinel] * len(node.args), **{k.arg: sentinel for k in node.keywords})
        except TypeError as exc:
            raise AssertionError(f"{where}, line {node.lineno}: {ast.unparse(node.func)}(...) does not match "
                                 f"{getattr(obj, '__qualname__', obj)}{sig}: {exc}") from None


@pytest.mark.parametrize("path", PY_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_python_blocks_run(path, tmp_path, monkeypatch):
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    namespace: dict = {"__name__": "__docs__"}
    for block in (b for b in ALL_BLOCKS if b.path == path and b.lang == "python"):
        code = _code(block)  # a SyntaxError names the doc's line
        tree = ast.parse("\n" * block.line + block.text)
        if block.compile_only:
            _check_calls(tree, _imported_globalbatch_names(tree), block.where)
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", FutureWarning)  # a block must not show a deprecated call
                exec(code, namespace)
        except Exception as exc:
            raise AssertionError(f"the block at {block.where} fails: {type(exc).__name__}: {exc}") from exc


def test_compile_only_marks_sit_on_a_fence():
    """A mark anywhere else would silently mark nothing."""
    for path in DOC_FILES:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() == COMPILE_ONLY:
                assert i + 1 < len(lines) and lines[i + 1].startswith("```"), \
                    f"{path.relative_to(REPO)}:{i + 1}: {COMPILE_ONLY} must be the line directly above a fence"


# ---------------------------------------------------------------------------
# commands: console blocks run, flags everywhere exist
# ---------------------------------------------------------------------------

def _command_flags() -> dict[str, set[str]]:
    from globalbatch.cli.app import _commands

    out = {}
    for name, cmd in _commands().items():
        flags = {"--help", "-h"}
        for p in cmd.params:
            flags.update(getattr(p, "opts", []))
            flags.update(getattr(p, "secondary_opts", []))
        out[name] = {f for f in flags if f.startswith("-")}
    return out


_FLAG = re.compile(r"(?<![\w-])--?[A-Za-z][\w-]*")


def _check_command_text(text: str, where: str, flags: dict[str, set[str]]) -> int:
    """Check one command (continuations joined): ``globalbatch <command> ...`` flags exist. Returns 1 if it was one."""
    m = re.search(r"(?:^|[\s/)])(?:globalbatch|gbs)\)?\s+([a-z][\w-]*)(.*)$", text)  # also $(which globalbatch) noise
    if not m:
        return 0
    command, rest = m.group(1), m.group(2)
    assert command in flags, f"{where}: `globalbatch {command}` is no command (commands: {sorted(flags)})"
    rest = re.split(r"\s#\s", " " + rest, maxsplit=1)[0]  # a trailing comment
    unknown = [f for f in _FLAG.findall(rest) if f not in flags[command]]
    assert not unknown, f"{where}: `globalbatch {command}` has no {', '.join(unknown)}"
    return 1


def _commands_in(block: Block) -> list[tuple[str, int]]:
    """The commands of a shell-like block: a line naming globalbatch, with its continuation lines
    (after a trailing backslash, or indented deeper, as a usage synopsis wraps)."""
    out: list[tuple[str, int]] = []
    lines = block.text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].removeprefix("$ ")
        if not re.search(r"\b(globalbatch|gbs)\b", line) or lines[i].lstrip().startswith("#"):
            i += 1
            continue
        indent, parts, j = len(lines[i]) - len(lines[i].lstrip()), [line.rstrip().removesuffix("\\")], i + 1
        while j < len(lines) and (lines[j - 1].rstrip().endswith("\\") or (
                lines[j].strip() and len(lines[j]) - len(lines[j].lstrip()) > indent
                and lines[j].lstrip()[0] in "[-")):
            parts.append(lines[j].strip().removesuffix("\\"))
            j += 1
        out.append((" ".join(parts), block.line + 1 + i))
        i = j
    return out


def test_every_globalbatch_command_in_the_docs_has_its_flags():
    flags = _command_flags()
    makefile = (REPO / "Makefile").read_text()
    checked = 0
    for block in ALL_BLOCKS:
        if block.lang == "python":
            continue
        for text, line in _commands_in(block):
            checked += _check_command_text(text, f"{block.path.relative_to(REPO)}:{line}", flags)
        for target in re.findall(r"^\s*(?:\$ )?make ([\w-]+)", block.text, flags=re.M):
            assert re.search(rf"^{target}:", makefile, flags=re.M), f"{block.where}: no Makefile target {target}"
    for path in DOC_FILES:  # inline code in the prose: `globalbatch plan --memory 80GiB`
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for span in re.findall(r"`((?:[A-Z_]+=\S+ )*(?:globalbatch|gbs) [a-z][^`]*)`", line):
                checked += _check_command_text(span, f"{path.relative_to(REPO)}:{n}", flags)
    assert checked > 10  # the scan found the docs' commands


def test_every_flag_named_in_the_docs_exists():
    ours = set().union(*_command_flags().values())
    scripts = "\n".join(p.read_text() for d in ("benchmarks", "examples", "experiments") for p in (REPO / d).rglob("*.py"))
    bad = []
    for path in DOC_FILES:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for flag in re.findall(r"(?<![\w-])--[A-Za-z][\w-]*", line):
                if flag not in ours and flag not in OTHER_TOOLS_FLAGS and f'"{flag}"' not in scripts:
                    bad.append(f"{path.relative_to(REPO)}:{n}: {flag}")
    assert not bad, "flags no command or script has:\n" + "\n".join(bad)


def _norm(line: str) -> str:
    line = re.sub(r"([━─═]){2,}", r"\1", line)  # rule lengths follow the widest cell
    return " ".join(line.split())


def _is_table_row(line: str) -> bool:
    return line.lstrip()[:1] in ("│", "┃", "┏", "┡", "└", "├", "┗", "┣")


def _assert_shown_in(shown: list[str], real: list[str], where: str) -> None:
    """Every shown line, in order, is a real line; lines skipped between two shown ones must be table rows,
    unless the doc says ``...`` there."""
    real_n = [_norm(x) for x in real]
    pos, gap_ok, prev_row = 0, True, False  # the first shown line may start anywhere
    for line in shown:
        if line.strip() == "...":
            gap_ok = True
            continue
        want, rows_ok = _norm(line), prev_row or _is_table_row(line)  # rows skipped inside a table only
        k = pos
        while k < len(real_n) and real_n[k] != want:
            if not gap_ok and not (rows_ok and _is_table_row(real[k])):
                k = len(real_n)
                break
            k += 1
        assert k < len(real_n), (f"{where}: the line\n  {line.strip()}\nis not in the real output where the doc shows it; "
                                 f"real output:\n" + "\n".join(real))
        pos, gap_ok, prev_row = k + 1, False, _is_table_row(line)


def _console_runs(block: Block) -> list[tuple[list[str], dict[str, str], list[str], int]]:
    """(argv, env, the output lines shown, line) for each ``$ globalbatch`` command of a console block."""
    out, lines, i = [], block.text.splitlines(), 0
    while i < len(lines):
        if not lines[i].startswith("$ "):
            i += 1
            continue
        line_no, cmd = block.line + 1 + i, lines[i][2:]
        while cmd.rstrip().endswith("\\"):
            i += 1
            cmd = cmd.rstrip()[:-1] + " " + lines[i].strip()
        i += 1
        shown = []
        while i < len(lines) and not lines[i].startswith("$ "):
            shown.append(lines[i])
            i += 1
        tokens, env = shlex.split(cmd), {}
        while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):
            key, _, value = tokens.pop(0).partition("=")
            env[key] = value
        assert tokens and tokens[0] in ("globalbatch", "gbs"), f"{block.where}: a console line runs {tokens[:1]}"
        out.append((tokens[1:], env, shown, line_no))
    return out


CONSOLE_BLOCKS = [b for b in ALL_BLOCKS if b.lang == "console" and not b.compile_only]


@pytest.mark.parametrize("block", CONSOLE_BLOCKS, ids=lambda b: b.where)
def test_console_blocks_show_the_real_output(block, tmp_path, monkeypatch, capsys):
    from globalbatch.cli import main

    shutil.copytree(REPO / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "200")
    runs = _console_runs(block)
    assert runs, f"{block.where}: a console block without a `$ globalbatch` line"
    for argv, env, shown, line in runs:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        captured = capsys.readouterr()
        where = f"{block.path.relative_to(REPO)}:{line}"
        expected = 2 if any(s.startswith("error: ") for s in shown) else 0  # a doc may show a refusal
        assert exit_.value.code == expected, f"{where}: exit {exit_.value.code}, not {expected}: {captured.err}"
        _assert_shown_in(shown, (captured.out + captured.err).splitlines(), where)


def test_console_blocks_are_found():
    assert CONSOLE_BLOCKS and all(_console_runs(b) for b in CONSOLE_BLOCKS)
    unlabeled = [b.where for b in ALL_BLOCKS if b.lang != "console" and re.search(r"^\$ ", b.text, flags=re.M)]
    assert not unlabeled, f"blocks with `$ ` command lines must be ```console (then they run): {unlabeled}"


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        if (obj.__doc__ or "").startswith("Deprecated"):  # a FutureWarning alias of a moved module
            return False
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def test_every_module_and_name_the_docs_cite_exists():
    """``globalbatch.x.y`` names, ``globalbatch/x.py`` paths (a deprecated alias does not count) and the files and
    tests the docs cite (``tests/test_step.py::test_x``, ``benchmarks/…``, ``examples/…``) exist."""
    bad = []
    for path in DOC_FILES:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for name in re.findall(r"(?<![\w/.-])globalbatch(?:\.[A-Za-z_]\w*)+", line):
                if not _resolves(name):
                    bad.append(f"{path.relative_to(REPO)}:{n}: {name}")
            for rel in re.findall(r"(?<![\w.-])(?:src/)?globalbatch/[\w/]+\.py", line):
                f = REPO / "src" / rel.removeprefix("src/")
                if not f.exists() or f.read_text().lstrip('"').startswith("Deprecated"):
                    bad.append(f"{path.relative_to(REPO)}:{n}: {rel}")
            for rel, test in re.findall(r"(?<![\w/.-])((?:tests|benchmarks|examples|experiments)/[\w/.-]*\w)(?:::(\w+))?", line):
                f = REPO / rel
                if not f.exists() or (test and not re.search(rf"def {test}\b", f.read_text())):
                    bad.append(f"{path.relative_to(REPO)}:{n}: {rel}" + (f"::{test}" if test else ""))
    toml = (REPO / "pyproject.toml").read_text()  # tomllib is 3.11+: the section's keys by pattern
    section = toml.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = set(re.findall(r"^([\w-]+)\s*=", section, flags=re.M))
    assert {"hf", "plot"} <= extras, extras
    for path in DOC_FILES:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for group in re.findall(r"globalbatch\[([\w,-]+)\]|`\[([\w-]+)\]`", line):
                bad += [f"{path.relative_to(REPO)}:{n}: extra [{e}]" for e in ",".join(group).split(",") if e and e not in extras]
    assert not bad, "the docs cite what does not exist:\n" + "\n".join(bad)


def _deprecated_names() -> set[str]:
    """Public classes, functions and methods (as ``Class.method``) of the package whose docstring starts
    with "Deprecated" (a method by its bare name would match every other use of a common word)."""
    def deprecated(node) -> bool:
        return not node.name.startswith("_") and (ast.get_docstring(node) or "").lower().startswith("deprecated")

    out = set()
    for f in (REPO / "src" / "globalbatch").rglob("*.py"):
        for node in ast.parse(f.read_text()).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and deprecated(node):
                out.add(node.name)
            if isinstance(node, ast.ClassDef):
                out |= {rf"{node.name}\.{m.name}" for m in node.body
                        if isinstance(m, ast.FunctionDef) and deprecated(m)}
    return out


def test_docs_show_no_deprecated_name_unless_they_say_so():
    """A deprecated name in code spans only where the line, or one next to it, says it is deprecated."""
    names = _deprecated_names()
    bad = []
    for path in DOC_FILES:
        lines = path.read_text().splitlines()
        for n, line in enumerate(lines):
            near = " ".join(lines[max(n - 1, 0):n + 2])
            if "deprecat" in near.lower() or "FutureWarning" in near:
                continue
            bad += [f"{path.relative_to(REPO)}:{n + 1}: {name}" for span in re.findall(r"`([^`]+)`", line)
                    for name in names if re.search(rf"\b{name}\b", span)]
    assert not bad, "deprecated names in the docs (say the current name):\n" + "\n".join(bad)


# ---------------------------------------------------------------------------
# the README's layout tree is the package's
# ---------------------------------------------------------------------------

def _readme_tree() -> set[str]:
    """The modules and packages the README's layout tree lists, as paths under src/globalbatch."""
    block = next(b for b in ALL_BLOCKS if b.path.name == "README.md" and b.text.startswith("src/globalbatch/"))
    out, stack = set(), []  # stack: (indent, directory name)
    for line in block.text.splitlines()[1:]:
        if not line.startswith("  ") or line.strip().startswith("#"):
            continue  # the top-level docs/, benchmarks/ ... lines and the layer comments
        indent, name = len(line) - len(line.lstrip()), line.split()[0]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "/".join([d for _, d in stack] + [name.rstrip("/")])
        out.add(path + ("/" if name.endswith("/") else ""))
        if name.endswith("/"):
            stack.append((indent, name.rstrip("/")))
    return out


def test_readme_layout_tree_lists_every_module_and_no_other():
    pkg = REPO / "src" / "globalbatch"
    real = set()
    for f in pkg.rglob("*.py"):
        rel = f.relative_to(pkg)
        if "__pycache__" in rel.parts:
            continue
        if rel.name == "__init__.py" and len(rel.parts) > 1:
            real.add(rel.parent.as_posix() + "/")  # a package is its own line
        else:
            real.add(rel.as_posix())
    listed = _readme_tree()
    assert not real - listed, f"README.md's layout tree misses {sorted(real - listed)}"
    assert not listed - real, f"README.md's layout tree lists what does not exist: {sorted(listed - real)}"


# ---------------------------------------------------------------------------
# history lives in CHANGELOG.md
# ---------------------------------------------------------------------------

HISTORY = re.compile(r"issue [0-9]+|\(issue|stop [0-9]+|20[0-9]{2}-[0-9]{2}-[0-9]{2}"  # issue numbers, dates
                     r"|after the review|review fix|this session|earlier session|final code|previous version"
                     r"|first version|the issue('s)? |\bthis stop\b", re.IGNORECASE)


def test_no_history_in_docs_and_docstrings():
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "src").rglob("*.py"))]
    hits = [f"{f.relative_to(REPO)}:{n}: {line.strip()}" for f in files
            for n, line in enumerate(f.read_text().splitlines(), 1) if HISTORY.search(line)]
    assert not hits, "history belongs in CHANGELOG.md:\n" + "\n".join(hits)
