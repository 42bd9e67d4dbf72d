# decoderlab -- every install step lives here, so a fresh clone needs only `make test` or `make demo`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed

.PHONY: install browsers test test-fast demo demo-statquest recipe bench clean

install: $(STAMP)

# torch==2.13.0 first: the CPU build on this machine's disk, so pip never resolves a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	touch $(STAMP)

# The browser tests drive Debian's chromium (Playwright's own browser download does not work here). apt-get
# needs root, so only `make test` asks for it; the library, `make demo` and `make test-fast` need no root (the
# browser tests skip, saying so, where /usr/bin/chromium is absent).
browsers:
	test -x /usr/bin/chromium || (apt-get update && apt-get install -y chromium chromium-driver)

# one pytest worker per core (pytest-xdist; each computes on one thread, see tests/conftest.py)
test: $(STAMP) browsers
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -n 2

# the suite without the training runs marked slow (which `make test` runs too)
test-fast: $(STAMP)
	$(PY) -m pytest -n 2 -m "not slow"

# each run starts afresh (a new run refuses a directory that holds files), so `make demo` can run again
demo: $(STAMP)
	rm -rf runs/statquest
	$(VENV)/bin/decoderlab train --preset statquest --out runs/statquest
	$(VENV)/bin/decoderlab generate --checkpoint runs/statquest "what is statquest"
	$(VENV)/bin/decoderlab generate --checkpoint runs/statquest "statquest is what"
	rm -rf runs/demo
	$(VENV)/bin/decoderlab train --out runs/demo
	$(VENV)/bin/decoderlab sample --checkpoint runs/demo "ROMEO:" --max-new-tokens 300 --seed 1

# the report card from nothing: pretrain a BPE chat base, SFT on the tasks, RL, score every stage (runs/recipe)
recipe: $(STAMP)
	rm -rf runs/recipe
	$(PY) bench/recipe.py --out runs/recipe

bench: $(STAMP)
	@for f in bench/*.py; do echo "== $$f"; $(PY) $$f || exit 1; done

clean:
	rm -rf $(VENV) runs .pytest_cache
