# The two set-up commands: `make demo` and `make test`. Both work on a fresh
# machine with only python3: they create .venv and install globalbatch into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test install clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/globalbatch demo

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) demo_out
