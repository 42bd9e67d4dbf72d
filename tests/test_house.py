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


#: a name kept for compatibility promises to stay "for one release" or warns that it is deprecated; decoderlab was
#: never released, so a moved or renamed thing leaves nothing behind
KEPT_RE = re.compile(r"for one release", re.I)
DEPRECATIONS = {"DeprecationWarning", "PendingDeprecationWarning", "FutureWarning"}


def _deprecation_warnings(path: Path):
    """Line numbers of ``warnings.warn(..., DeprecationWarning)`` (or its kin) in ``path``."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "warn":
            named = {a.id for a in [*node.args, *(k.value for k in node.keywords)] if isinstance(a, ast.Name)}
            if named & DEPRECATIONS:
                yield node.lineno


def test_no_alias_is_kept_for_compatibility():
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
             for p in sorted(SRC.rglob("*.py")) for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if KEPT_RE.search(line)]
    found += [f"{p.relative_to(ROOT)}:{n}: warns of a deprecation" for p in sorted(SRC.rglob("*.py"))
              for n in _deprecation_warnings(p)]
    assert not found, "aliases or old forms kept for compatibility (remove them, update every use):\n" + \
        "\n".join(found)


def test_the_alias_check_sees_a_deprecation(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import warnings\nwarnings.warn('old', DeprecationWarning)\nwarnings.warn('x', UserWarning)\n")
    assert list(_deprecation_warnings(f)) == [2]


def import_circles(package: str = "decoderlab") -> list[list[str]]:
    """Every circle of imports between ``package``'s modules, deferred (function-level) imports included, as the
    shortest chain from a module back to itself; a package's ``__init__`` is the module of its name. Built by
    grimp, the graph import-linter checks the layers on."""
    import grimp

    graph = grimp.build_graph(package, cache_dir=None)
    circles = {}
    for module in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if imported.split(".")[0] != package:
                continue
            back = graph.find_shortest_chain(importer=imported, imported=module)
            if back:
                chain = [module, *back]
                circles.setdefault(frozenset(chain), chain)
    return list(circles.values())


def test_no_import_circles():
    """Two modules that import each other (even inside a function) make the import order matter and the layers
    a lie: move what both need below them, or the user of it up."""
    circles = import_circles()
    assert not circles, "import circles (untie each: move the shared part to a module both import):\n" + \
        "\n".join(" -> ".join(c) for c in circles)


def test_the_circle_check_sees_a_deferred_import(tmp_path, monkeypatch):
    pkg = tmp_path / "circly"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n")
    (pkg / "c.py").write_text("from . import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_circles("circly") == [["circly.a", "circly.b", "circly.a"]]


def test_no_two_test_modules_share_an_import_name():
    """pytest imports a test file outside a package by its bare name: two such files of one name (tests/gguf and
    tests/export each had a test_init.py) make a whole-suite run fail to collect one of them, which a run of one
    folder never shows. A folder without ``__init__.py`` (tests/gguf must have none: it would shadow the PyPI
    ``gguf``) needs names of its own."""
    import collections

    tests = Path(__file__).resolve().parent
    names = collections.defaultdict(list)
    for path in tests.rglob("test_*.py"):
        parts, folder = [path.stem], path.parent
        while (folder / "__init__.py").exists():
            parts.insert(0, folder.name)
            folder = folder.parent
        names[".".join(parts)].append(str(path.relative_to(tests)))
    assert {k: v for k, v in names.items() if len(v) > 1} == {}
