"""The shape of the house: no function in src/ over 80 lines (one job each), no issue numbers in src/ or
tests/ (a reader of the repository cannot see them). tests/test_docs.py runs every ```python block of the README
and docs."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "decoderlab"
LIMIT = 80


def _functions(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


def test_no_function_in_src_is_over_80_lines():
    long = [f"{p.relative_to(ROOT)}:{line} {name} ({n} lines)"
            for p in sorted(SRC.rglob("*.py")) for name, line, n in _functions(p) if n > LIMIT]
    assert not long, "functions over 80 lines:\n" + "\n".join(long)


def test_the_length_check_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    f = tmp_path / "m.py"
    f.write_text(f"def long():\n{body}\n")
    assert [n for _, _, n in _functions(f)] == [LIMIT + 1]


ISSUE_RE = re.compile(r"#.*\bissues? \d+|\bissue \d+\b", re.I)


def test_no_issue_numbers_in_src_or_tests():
    found = []
    for base in (SRC, ROOT / "tests"):
        for p in sorted(base.rglob("*.py")):
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
                if ISSUE_RE.search(line) and "ISSUE_RE" not in line:
                    found.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not found, "issue numbers (name the behaviour instead):\n" + "\n".join(found)
