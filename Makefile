# nnscaler-eval: every target creates or reuses its own virtual environment.
#   make demo    compile a small transformer and show what was captured, guarded, measured
#   make test    build the extension (-Wall -Wextra, no warnings allowed) and run pytest
#   make asan    the same tests on an ASan + UBSan build, in .venv-asan
#   make leakcheck  refcount/memory soak of the C paths
#   make fuzz    long differential fuzzing of the bytecode rewrite
#   make test-3.13 / test-3.14   the suite on another CPython (interpreters unpacked
#                from ../shared/python/; skipped with a message when absent)
#   PYV=3.13 / PYV=3.14 with build, test or fuzz: that version's venv (.venv-3.13 ...)
#   make bench / bench-quick  side-by-side benchmarks (benchmarks/)
PYTHON ?= python3
PYV ?=
ifeq ($(PYV),)
VENV ?= .venv
else
VENV := .venv-$(PYV)
endif
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: all venv build demo test asan leakcheck fuzz bench bench-quick lint clean sysdeps \
	test-3.13 test-3.14

all: build

sysdeps:
	@if [ ! -f /usr/include/xxhash.h ]; then \
	  echo "installing libxxhash-dev (xxHash headers)"; \
	  (apt-get update -qq && apt-get install -y -qq libxxhash-dev) || \
	  { echo "error: libxxhash-dev is missing and could not be installed (run as root, or install it)"; exit 1; }; \
	fi

$(VENV)/.deps: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q "$(TORCH_SPEC)" pytest numpy matplotlib
	touch $@

ifeq ($(PYV),)
venv: $(VENV)/.deps
else
# another CPython: unpack it, make the venv, install PyPI's torch (.ci/pyenv.sh)
venv:
	.ci/pyenv.sh $(PYV) $(VENV)
endif

build: sysdeps venv
	NNSCALER_WERROR=1 $(PY) -m pip install -q --no-build-isolation --no-deps -e .

demo: build
	$(PY) -m nnscaler_eval.demo

test: build
	$(PY) -m pytest -q -ra $(PYTEST_ARGS)

asan: sysdeps
	$(MAKE) VENV=.venv-asan venv
	NNSCALER_SANITIZE=1 .venv-asan/bin/python -m pip install -q --no-build-isolation --no-deps -e . --force-reinstall
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	  .venv-asan/bin/python -m pytest -q -x -p no:faulthandler $(PYTEST_ARGS)
	# leave the normal build in place for the next `make test`
	rm -f nnscaler_eval/_C*.so

leakcheck: build
	$(PY) -m pytest -q tests/test_leaks.py tests/test_rewrite_leaks.py tests/test_cache_entry.py --run-slow

fuzz: build
	NNSCALER_FUZZ_CASES=20000 $(PY) -m pytest -q -s tests/test_rewrite_fuzz.py

# The suite on CPython 3.13 / 3.14; a clear SKIP (success) without the interpreters.
test-3.13 test-3.14:
	@if .ci/pyenv.sh --check $(@:test-%=%); then \
	  $(MAKE) --no-print-directory PYV=$(@:test-%=%) test; \
	fi

bench-quick: build
	$(PY) -m pip install -q matplotlib
	$(PY) -m benchmarks.run --quick

bench: build
	$(PY) -m pip install -q matplotlib
	$(PY) -m benchmarks.run

clean:
	rm -rf build *.egg-info nnscaler_eval/_C*.so
