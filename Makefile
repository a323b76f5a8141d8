# The two set-up commands: `make demo` and `make test`. Both work on a fresh
# machine with only python3: they create .venv and install globalbatch into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP_RUN := $(VENV)/.installed-run
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test install browser clean

# Bytecode is written when a module is first imported, for the modules that are imported, instead of pip
# compiling every file it installs on one core (half the install's time). Some machines set
# PYTHONDONTWRITEBYTECODE; without bytecode every process would recompile torch on import.
unexport PYTHONDONTWRITEBYTECODE

# `make demo` installs what the demo runs on (the package and matplotlib for the report's plots); `make test` adds
# the dev extras (pytest, Ray Tune, transformers, Lightning, ...), which the demo does not need.
$(STAMP_RUN): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -c constraints.txt -e '.[plot]'
	touch $(STAMP_RUN)

$(STAMP): $(STAMP_RUN)
	$(PY) -m pip install -q --no-compile -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP_RUN)
	$(VENV)/bin/globalbatch demo

# The report test renders the demo's HTML in headless Chromium (Debian's package).
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { echo "installing chromium for the HTML report test (apt-get)"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || \
	    echo "could not install chromium; tests/test_report.py will say how to get it"; }

# The suite runs on every core through pytest-xdist (the longest tests first: tests/conftest.py); TEST_WORKERS=0
# runs it in one process. One intra-op thread per worker unless OMP_NUM_THREADS says otherwise: the tests' tensors
# are tiny, and two workers of two threads each on two cores spin against each other.
TEST_WORKERS ?= auto

test: $(STAMP) browser
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q -n $(TEST_WORKERS)

clean:
	rm -rf $(VENV) demo_out
