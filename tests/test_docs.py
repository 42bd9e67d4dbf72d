"""The README and docs/*.md as a reader meets them: every ```python block runs, every relative link points to a
file that exists, and the README stays a five-minute read (at most 12 KB).

Each ```python block runs in a fresh namespace with a temporary directory as its working directory, so a block
holds everything it needs (a tiny model, a short run). A block that cannot run here (it needs a server or a
network) is preceded by the line ``<!-- no-run: why -->``. Blocks that train a model, start a server or write a
GPT-2 directory (several seconds each) are marked slow, so ``make test-fast`` skips them and ``make test`` runs
them."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_LIMIT = 12_288

# a fence opening at the start of a line, its language, the body, the closing fence; the line before it
FENCE_RE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
NO_RUN = "<!-- no-run"
# calls that take seconds to tens of seconds on a shared CPU: training, a server, transformers' import
SLOW_CALLS = ("train_pairs(", "train_lm(", "finetune(", "ServerThread(", "to_hf(")


def python_blocks(page: Path, root: Path = ROOT):
    """(label, code, runnable) for every ```python block of ``page``; label is page:line (page relative to
    ``root``)."""
    text = page.read_text(encoding="utf-8")
    for m in FENCE_RE.finditer(text):
        if m.group(1) != "python":
            continue
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        line = text.count("\n", 0, m.start()) + 1
        yield f"{page.relative_to(root)}:{line}", m.group(2), not before.strip().startswith(NO_RUN)


def _cases():
    for page in PAGES:
        for label, code, runnable in python_blocks(page):
            if not runnable:
                continue
            marks = [pytest.mark.slow] if any(call in code for call in SLOW_CALLS) else []
            yield pytest.param(code, id=label, marks=marks)


@pytest.mark.parametrize("code", list(_cases()))
def test_python_block_runs(code, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "<doc block>", "exec"), {"__name__": "__doc_block__"})


def test_the_block_reader_finds_python_blocks_and_the_opt_out(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("text\n\n```python\nx = 1\n```\n\n<!-- no-run: needs a server -->\n```python\ny = 2\n```\n\n"
                    "```bash\nls\n```\n```python\nz = 3\n```\n", encoding="utf-8")
    found = list(python_blocks(page, root=tmp_path))
    assert [(code, runnable) for _, code, runnable in found] == [("x = 1\n", True), ("y = 2\n", False),
                                                                ("z = 3\n", True)]
    assert [label for label, _, _ in found] == ["p.md:3", "p.md:8", "p.md:15"]


def test_every_page_has_runnable_python_and_opt_outs_are_rare():
    blocks = [b for page in PAGES for b in python_blocks(page)]
    runnable = [b for b in blocks if b[2]]
    assert any(label.startswith("README.md") for label, _, _ in runnable)
    assert len(blocks) - len(runnable) <= max(1, len(blocks) // 4), [b[0] for b in blocks if not b[2]]


def test_readme_is_a_five_minute_read():
    size = len(README.read_bytes())
    assert size <= README_LIMIT, f"README.md is {size:,} bytes; at most {README_LIMIT:,}: move detail to docs/"


LINK_RE = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def relative_links(page: Path):
    """Every link target of ``page`` that is not a URL or an in-page anchor, without its #fragment."""
    text = FENCE_RE.sub("", page.read_text(encoding="utf-8"))  # code blocks hold no links
    for target in LINK_RE.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue
        yield target.split("#", 1)[0]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files(page):
    missing = [t for t in relative_links(page) if not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


def test_the_link_check_sees_a_broken_link(tmp_path):
    page = tmp_path / "p.md"
    (tmp_path / "there.md").write_text("x", encoding="utf-8")
    page.write_text("[a](there.md) [b](gone.md#part) ![c](img/none.png) [d](https://x.org/y) [e](#here)\n"
                    "```\n[f](inside-code.md)\n```\n", encoding="utf-8")
    targets = list(relative_links(page))
    assert targets == ["there.md", "gone.md", "img/none.png"]
    assert [t for t in targets if not (page.parent / t).exists()] == ["gone.md", "img/none.png"]


def test_the_readme_links_every_guide():
    text = README.read_text(encoding="utf-8")
    for guide in ("training", "generation", "finetuning", "serving", "glassbox", "design", "benchmarks"):
        assert f"(docs/{guide}.md)" in text, guide
        assert (ROOT / "docs" / f"{guide}.md").exists(), guide


# --------------------------------------------------------------------------------------------------------------
# docs/design.md's annotated source tree is the tree on disk, floor by floor as pyproject.toml's layers
# --------------------------------------------------------------------------------------------------------------

SRC = ROOT / "src" / "decoderlab"
INDENT = 4


def design_tree(text: str) -> tuple[list[str], list[str]]:
    """(paths, floors) of the first ```text block under "## The source tree": every entry's path relative to
    the package (folders end in "/"), and every "# floor N: a | b" line's layer, in order."""
    section = text[text.index("## The source tree"):]
    block = FENCE_RE.search(section).group(2)
    paths, floors, stack = [], [], []
    for line in block.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            floors.append(line.split(":", 1)[1].strip())
            continue
        depth = (len(line) - len(line.lstrip(" "))) // INDENT
        name = line.split()[0]
        stack[depth:] = [name]
        paths.append("".join(stack))
    return paths, floors


def files_on_disk() -> list[str]:
    found = []
    for p in SRC.rglob("*"):
        rel = p.relative_to(SRC)
        if "__pycache__" in rel.parts or p.suffix == ".pyc":
            continue
        found.append(f"{rel.as_posix()}/" if p.is_dir() else rel.as_posix())
    return sorted(found)


def pyproject_layers() -> list[str]:
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    (layers,) = [c["layers"] for c in config["tool"]["importlinter"]["contracts"]
                 if c["type"] == "layers" and c.get("containers") == ["decoderlab"]]
    return layers


def test_the_design_tree_lists_every_file_of_the_package():
    paths, _ = design_tree((ROOT / "docs" / "design.md").read_text(encoding="utf-8"))
    assert len(paths) == len(set(paths)), sorted({p for p in paths if paths.count(p) > 1})
    disk = files_on_disk()
    assert sorted(set(disk) - set(paths)) == [], "on disk but not in docs/design.md's tree"
    assert sorted(set(paths) - set(disk)) == [], "in docs/design.md's tree but not on disk"


def test_the_design_tree_floors_are_the_import_linter_layers():
    _, floors = design_tree((ROOT / "docs" / "design.md").read_text(encoding="utf-8"))
    assert floors == pyproject_layers()


def test_the_tree_reader_builds_nested_paths():
    text = ("## The source tree\n\n```text\ntop.py    a\n# floor 1: a | b\npkg/      b\n    m.py  c\n"
            "    sub/\n        n.py\nlast.py\n```\n")
    assert design_tree(text) == (["top.py", "pkg/", "pkg/m.py", "pkg/sub/", "pkg/sub/n.py", "last.py"], ["a | b"])


def test_the_readme_lesson_prints_the_numbers_it_shows(tmp_path, monkeypatch, capsys):
    (code,) = [code for _, code, _ in python_blocks(README) if "SelfAttention(" in code]
    (shown,) = [line for line in code.splitlines() if line.startswith("# tensor(")]
    numbers = re.findall(r"-?\d+\.\d+", shown)
    assert len(numbers) == 6
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "<README lesson>", "exec"), {"__name__": "__doc_block__"})
    printed = re.findall(r"-?\d+\.\d+", capsys.readouterr().out)
    assert printed[:6] == numbers


def test_the_readme_names_every_command():
    """The README's command line lists every command the parser has (a command added later is listed too)."""
    from decoderlab.cli.parser import COMMANDS

    text = README.read_text(encoding="utf-8")
    missing = [name for name in COMMANDS if f"`{name}`" not in text]
    assert not missing, f"README.md does not name the command(s) {missing}"
