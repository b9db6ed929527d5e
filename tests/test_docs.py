"""The ```python blocks of README.md and docs/**/*.md run. Nothing else executes the docs' code,
so an op or argument renamed, a default changed or an output added would leave the examples
wrong unnoticed; here each block runs alone, in a fresh namespace (as a reader pastes it): on
the CPU with its device string "cuda" replaced by "cpu", and (marked gpu) as written on a GPU.

Two conventions in the markdown:

- `<!-- docs-test: skip (why) -->` on the line just above a block's fence: the block is not
  run (a fragment in the prose's names, a signature, a sketch of fusedops' internals, a setup
  this test cannot give). It is reported skipped, with its place and the reason, never
  dropped.
- `<!-- docs-test: signature -->` above a block whose first statement is
  `name = fusedops.<callable>(<parameters>)`, written as a def's parameter list (a bare `*`,
  defaults): the block is not run; its parameters, their kinds and their defaults must be the
  callable's own (test_signature_block_matches).
- A block whose last lines are a comment naming an exception, as a traceback's last line reads
  (`# NotImplementedError: the message`, which may go on over further comment lines), shows
  an error: its last statement must raise that exception, with that message.

A block's tracebacks name the markdown file and the block's own line numbers in it."""

import ast
import functools
import inspect
import linecache
import re
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import CodeType
from typing import List, Optional, Tuple

import pytest
import torch

import fusedops

from conftest import device_params

ROOT = Path(__file__).resolve().parents[1]

FENCE = re.compile(r"(?P<indent> *)(?P<fence>`{3,}|~{3,})\s*(?P<info>.*)")
MARKER = re.compile(r"\s*<!--\s*docs-test:\s*(?P<directive>.*?)\s*-->\s*")
SKIP = re.compile(r"skip \((?P<reason>.+)\)")
SIGNATURE = "signature"
ERROR_COMMENT = re.compile(r"#\s*(?:\w+\.)*(?P<name>\w+(?:Error|Exception)):\s*(?P<message>.*)")
DEVICE_STRING = re.compile(r"""(["'])cuda\1""")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # the opening fence's line (1-based); the code starts on the next
    source: str
    skip: Optional[str]  # the reason given by a skip marker
    signature: bool = False  # under a signature marker: checked against the callable, not run

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT).as_posix()}:{self.line}"


def _pages() -> List[Path]:
    """README.md and every page under docs/ (an sdist carries README.md alone)."""
    docs = ROOT / "docs"
    return [ROOT / "README.md", *(sorted(docs.rglob("*.md")) if docs.is_dir() else [])]


def _dedent(line: str, indent: int) -> str:
    """The line less its fence's indentation (a fence in a list item is indented; its code
    lines by as much, or by less where they are blank)."""
    return line[min(indent, len(line) - len(line.lstrip(" "))) :]


def _read_page(path: Path) -> Tuple[List[Block], List[str]]:
    """The page's python blocks, and what is wrong with its docs-test markers. A fence of
    another language is passed over whole, so a ```python line inside it opens nothing."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, problems = [], []
    where = path.relative_to(ROOT).as_posix()
    marker_at = {}  # line index -> the marker's directive
    i = 0
    while i < len(lines):
        marker = MARKER.fullmatch(lines[i])
        if marker:
            marker_at[i] = marker["directive"]
        elif lines[i].lstrip().startswith("<!--") and "docs-test" in lines[i]:
            problems.append(f"{where}:{i + 1}: not a docs-test marker: {lines[i].strip()!r}")
        fence = FENCE.fullmatch(lines[i])
        if not fence:
            i += 1
            continue
        closing = re.compile(rf"\s*{re.escape(fence['fence'][0])}{{{len(fence['fence'])},}}\s*")
        end = next((j for j in range(i + 1, len(lines)) if closing.fullmatch(lines[j])), len(lines))
        if fence["info"].split()[:1] in (["python"], ["py"]):
            code = [_dedent(line, len(fence["indent"])) for line in lines[i + 1 : end]]
            directive = marker_at.pop(i - 1, None)
            skip = SKIP.fullmatch(directive) if directive is not None else None
            if directive not in (None, SIGNATURE) and not skip:
                problems.append(
                    f"{where}:{i}: unknown docs-test directive {directive!r} (known: skip (why), {SIGNATURE})"
                )
            blocks.append(Block(path, i + 1, "\n".join(code) + "\n", skip["reason"] if skip else None,
                                directive == SIGNATURE))
        i = end + 1
    problems += [f"{where}:{i + 1}: docs-test marker not on the line just above a ```python fence"
                 for i in marker_at]
    return blocks, problems


def _collect() -> Tuple[List[Block], List[str]]:
    blocks, problems = [], []
    for page in _pages():
        page_blocks, page_problems = _read_page(page)
        blocks += page_blocks
        problems += page_problems
    return blocks, problems


BLOCKS, MARKER_PROBLEMS = _collect()


def _block_params():
    """One param a block, named file:line; a block with a skip marker is skipped with its reason,
    a signature block as one that test_signature_block_matches checks."""

    def skipped(block: Block, reason: str):
        return pytest.param(block, id=block.id, marks=[pytest.mark.skip(reason=f"{block.id}: {reason}")])

    return [
        skipped(block, block.skip) if block.skip
        else skipped(block, "a signature, checked by test_signature_block_matches") if block.signature
        else pytest.param(block, id=block.id)
        for block in BLOCKS
    ]


def _expected_error(block: Block) -> Optional[Tuple[str, str]]:
    """For a block that ends in a comment naming an exception: the exception's name and its
    message (the comment's lines joined, spaces collapsed). None for any other block."""
    lines = block.source.rstrip().splitlines()
    last = len(lines)
    while last and (not lines[last - 1].strip() or lines[last - 1].lstrip().startswith("#")):
        last -= 1
    comment = [line.strip() for line in lines[last:] if line.strip()]
    error = ERROR_COMMENT.fullmatch(comment[0]) if comment else None
    if not error:
        return None
    message = " ".join([error["message"], *(line.lstrip("#") for line in comment[1:])])
    return error["name"], " ".join(message.split())


def _last_statement(block: Block) -> range:
    """The page's lines of the block's last statement."""
    node = ast.parse(block.source).body[-1]
    return range(block.line + node.lineno, block.line + node.end_lineno + 1)


def _at_line(code: CodeType, first: int) -> CodeType:
    """`code`, compiled from a block alone, moved to the block's lines in its page: each code
    object's lines count from its co_firstlineno. (Compiling the block after that many blank
    lines would number it so too, but then a traceback shows the blank lines from line 1 on.)"""
    nested = tuple(_at_line(c, first) if isinstance(c, CodeType) else c for c in code.co_consts)
    return code.replace(co_firstlineno=code.co_firstlineno + first - 1, co_consts=nested)


def _run(block: Block, device: str) -> None:
    """Runs the block in a namespace of its own, with "cuda" (either quotes) made `device`. A
    traceback names the page and the line in it, and shows the block's code."""
    source = DEVICE_STRING.sub(lambda m: f"{m[1]}{device}{m[1]}", block.source)
    filename = str(block.path)
    lines = ["\n"] * block.line + source.splitlines(keepends=True)  # (what linecache reads there)
    linecache.cache[filename] = (len(source), None, lines, filename)
    try:
        code = _at_line(compile(source, filename, "exec"), block.line + 1)
    except SyntaxError as error:  # numbered in the block alone, its text read from the page's line
        error.text = source.splitlines()[error.lineno - 1]
        error.lineno += block.line
        error.end_lineno = error.end_lineno and error.end_lineno + block.line
        raise
    torch.manual_seed(0)
    exec(code, {"__name__": "__docs__"})


def _raising_line(error: BaseException, block: Block) -> Optional[int]:
    """The page's line of the block's statement that was running when `error` was raised (the
    outermost of the block's frames: a function the block defines may have raised it)."""
    frames = traceback.extract_tb(error.__traceback__)
    return next((frame.lineno for frame in frames if frame.filename == str(block.path)), None)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("block", _block_params())
def test_python_block_runs(block, device):
    """The block runs without raising, or, when it ends in a comment naming an exception, its
    last statement raises that exception with that message (and nothing before it raises)."""
    expected = _expected_error(block)
    if expected is None:
        _run(block, device)
        return
    name, message = expected
    try:
        _run(block, device)
    except Exception as error:  # (compared below with the block's closing comment)
        raised = error
    else:
        pytest.fail(f"{block.id}: the block ends in '# {name}: {message}' but ran without raising")
    if isinstance(raised, SyntaxError):
        raise raised  # (the block does not parse: none of it ran)
    names = [cls.__name__ for cls in type(raised).__mro__]
    actual = " ".join(str(raised).split())
    line, statement = _raising_line(raised, block), _last_statement(block)
    if name not in names or message not in actual or line not in statement:
        raise AssertionError(
            f"{block.id}: expected {name} from the last statement (line {statement[0]}) with the "
            f"message {message!r}; got {type(raised).__name__} from line {line}: {actual!r}"
        ) from raised


def test_docs_test_markers_are_well_formed():
    """Every `<!-- docs-test: ... -->` marker is a known directive on the line just above a
    ```python fence: a misspelt or misplaced one would otherwise be ignored, and its block run
    (or, worse, another block skipped)."""
    assert not MARKER_PROBLEMS, "\n".join(MARKER_PROBLEMS)


def test_blocks_are_found():
    """The extraction finds README.md's quick start (at least one block on every run, also
    from an sdist): a parser broken into finding nothing would pass every other test here."""
    assert any(block.path.name == "README.md" for block in BLOCKS), [block.id for block in BLOCKS]


def _documented_signature(block: Block) -> Tuple[str, List[Tuple[str, object, object]]]:
    """The callable a signature block names and its parameters as written: (name, kind,
    default), the default inspect.Parameter.empty where none is given."""
    head, _, rest = block.source.partition("(")
    depth = 1
    for end, char in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            break
    else:
        raise AssertionError(f"{block.id}: a signature block opens a call it does not close")
    args = ast.parse(f"def _({rest[:end]}): pass").body[0].args
    empty, kind = inspect.Parameter.empty, inspect.Parameter
    positional = [(a, kind.POSITIONAL_ONLY) for a in args.posonlyargs]
    positional += [(a, kind.POSITIONAL_OR_KEYWORD) for a in args.args]
    defaults = [empty] * (len(positional) - len(args.defaults)) + [ast.literal_eval(d) for d in args.defaults]
    params = [(a.arg, k, d) for (a, k), d in zip(positional, defaults)]
    params += [(a.arg, kind.KEYWORD_ONLY, empty if d is None else ast.literal_eval(d))
               for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    return head.rpartition("=")[2].strip(), params


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in BLOCKS if b.signature])
def test_signature_block_matches(block):
    """A signature block lists the callable's parameters in order, each of the same kind
    (positional, keyword-only) and with the same default: a parameter added, renamed or given
    another default shows here, where the block itself never runs."""
    name, documented = _documented_signature(block)
    assert name.startswith("fusedops."), f"{block.id}: a signature block names a fusedops callable: {name!r}"
    target = functools.reduce(getattr, name.split(".")[1:], fusedops)
    actual = [(p.name, p.kind, p.default) for p in inspect.signature(target).parameters.values()]
    assert documented == actual, f"{block.id}: {name} is documented as\n  {documented}\nbut is\n  {actual}"
