"""The code in README.md and docs/*.md runs as pasted, so the documentation cannot rot.

Every ```python block runs in a fresh interpreter, unless the line before it says otherwise:

* ``<!-- torchrun: --nproc-per-node N -->``: the block calls ``init_process_group()`` and runs
  as N ranks, as torchrun starts them;
* ``<!-- excerpt: examples/x.py -->``: the block shows lines of an example (which
  ``tests/docs/test_examples.py`` runs): each of its code lines must be one of the example's,
  comments aside;
* ``<!-- not-run: why -->``: the block needs what a test cannot give it (a GPU, a model of the
  reader's, a checkpoint); the reason is shown to the reader too.

Shell blocks are checked, not run (they start trainings and benchmarks): every script or
module they name exists, and every ``--flag`` after a script (its comment included) is one the
script defines.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.docs.ranks import ROOT, failures, run_ranks

DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*(?P<kind>torchrun|excerpt|not-run):\s*(?P<value>.*?)\s*-->\s*$")
LOOKS_LIKE_MARKER = re.compile(r"\s*<!--\s*(not[-_ ]?run|excerpt|torchrun)")


@dataclass
class Block:
    path: str  # relative to the repository root
    line: int  # of the opening fence
    lang: str
    code: str
    marker: tuple[str, str] | None  # (kind, value) from the line before the fence

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def code_blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, dedented, with the marker line before each."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        before = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
        marker = MARKER.match(before)
        blocks.append(
            Block(
                str(path.relative_to(ROOT)),
                i + 1,
                opened["lang"],
                textwrap.dedent("\n".join(lines[i + 1 : end])) + "\n",
                (marker["kind"], marker["value"]) if marker else None,
            )
        )
        i = end + 1
    return blocks


BLOCKS = [block for path in DOCUMENTS for block in code_blocks(path)]
PYTHON = [b for b in BLOCKS if b.lang == "python"]
SHELL = [b for b in BLOCKS if b.lang in ("bash", "sh", "shell")]


@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
def test_python_block_runs_as_pasted(block: Block, tmp_path: Path):
    kind, value = block.marker or ("", "")
    if kind == "not-run":
        assert value, f"{block.id}: say what the block needs"
        pytest.skip(f"{block.id}: {value}")
    if kind == "excerpt":
        _check_excerpt(block, ROOT / value)
        return
    nproc = 0
    if kind == "torchrun":
        found = re.fullmatch(r"--nproc-per-node (\d+)", value)
        assert found, f"{block.id}: expected '--nproc-per-node N', got {value!r}"
        nproc = int(found[1])
    script = tmp_path / "block.py"
    script.write_text(block.code)
    if failed := failures(run_ranks([str(script)], nproc, cwd=tmp_path)):
        pytest.fail(f"{block.id} fails as pasted:\n{failed}", pytrace=False)


def _code(line: str) -> str:
    """A line without its comment and surrounding blanks (a ``#`` inside a string is kept)."""
    return re.sub(r"(^|\s+)#(?=(?:[^\"']|\"[^\"]*\"|'[^']*')*$).*$", "", line).strip()


def _check_excerpt(block: Block, example: Path):
    assert example.is_file(), f"{block.id}: no example {example}"
    shown = {_code(line) for line in example.read_text().splitlines()}
    missing = [ln for ln in map(_code, block.code.splitlines()) if ln and ln not in shown]
    assert not missing, f"{block.id}: lines not in {example.name}: {missing}"


# ----------------------------------------------------------------------------- shell blocks
SCRIPT = re.compile(r"(?:^|\s)(?P<path>[\w./-]+\.py)\b(?P<rest>[^|;&]*)")
MODULE = re.compile(r"(?:^|\s)-m\s+(?P<module>[\w.]+)")


def _commands(code: str) -> list[str]:
    """The block's commands, continuation lines joined and prompts dropped. A comment after a
    command stays: it lists more of that command's options, which are checked too."""
    joined = re.sub(r"\\\n\s*", " ", code)
    lines = (line.strip().removeprefix("$ ") for line in joined.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def _module_exists(module: str) -> bool:
    if not module.startswith(("raggedfsdp", "recipes", "benchmarks", "tests")):
        return True  # pytest, torch.distributed.run: not ours to check
    path = ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


@pytest.mark.parametrize("block", SHELL, ids=[b.id for b in SHELL])
def test_shell_block_names_real_scripts_and_flags(block: Block):
    problems = []
    for command in _commands(block.code):
        for found in MODULE.finditer(command):
            if not _module_exists(found["module"]):
                problems.append(f"no module {found['module']}")
        for found in SCRIPT.finditer(command):
            script = ROOT / found["path"]
            if not script.is_file():
                problems.append(f"no script {found['path']}")
                continue
            source = script.read_text()
            for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", found["rest"]):
                if f'"{flag}"' not in source:
                    problems.append(f"{found['path']} defines no {flag}")
    assert not problems, f"{block.id}: {problems}"


def test_markers_are_spelled_right():
    """A misspelt marker would silently leave a block unmarked (and run it, or fail it)."""
    bad = []
    for path in DOCUMENTS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if LOOKS_LIKE_MARKER.match(line) and not MARKER.match(line):
                bad.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not bad, bad
