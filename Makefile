# nnscaler-eval: every target creates or reuses its own virtual environment.
#   make demo    compile a small transformer and show what was captured, guarded, measured
#   make test    build the extension (-Wall -Wextra, no warnings allowed) and run pytest
#   make lint    ruff over the Python tree (pyproject.toml) and the source lints
#                (tests/test_lint.py: C include graph, version tests, ownership notes)
#   make asan    the same tests on an ASan + UBSan build, in .venv-asan
#   make leakcheck  refcount/memory soak of the C paths (the suite's soaks, 3x the rounds)
#   make fuzz    long differential fuzzing of the bytecode rewrite
#   make fuzz-state  the state-mutation fuzzer over five seeds (tests/state_fuzz.py)
#   make test-3.12 / 3.13 / 3.14   the suite on another CPython (3.12 from pyenv, others unpacked
#                from ../shared/python/; skipped with a message when absent)
#   PYV=3.12 / 3.13 / 3.14 with build, test or fuzz: that version's venv (.venv-3.13 ...)
#   make bench / bench-quick  side-by-side benchmarks (benchmarks/)
#   make bench-ir  instructions per call under callgrind, eager / ours / Dynamo
#                (needs valgrind; BENCH_IR_ARGS="--quick --cases inputs,gpt" ...)
#   make test-nnscaler  against the real Microsoft nnScaler (../shared/peers/), in
#                .venv-nnscaler: install order/uninstall checks, parallelize end to end
#   make test-nnscaler-suite  nnScaler's own tests with our capture as its front end
#                (tests/nnscaler_suite/; NNSCALER_SUITE_ARGS="--mode installed" or
#                "--mode alone" to compare with nnScaler's own tracer)
#   make gpu-check  on a machine with a GPU: build with its Python and torch
#                (GPU_PY=python3), run tests/test_gpu.py and benchmarks/gpu.py, one
#                report in GPU_OUT; without a GPU both skip cleanly
PYTHON ?= python3
PYV ?=
ifeq ($(PYV),)
VENV ?= .venv
else
VENV := .venv-$(PYV)
endif
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
RUFF_SPEC ?= ruff==0.17.6
PYTEST_ARGS ?=

.PHONY: all venv build suite demo test asan leakcheck fuzz fuzz-state bench bench-quick bench-ir lint clean sysdeps gpu-check \
	test-nnscaler test-nnscaler-suite nnscaler-env test-3.12 test-3.13 test-3.14 build-3.12 build-3.13 build-3.14

# Microsoft nnScaler's source (a test oracle, never shipped): ../shared/peers in CI's
# fresh clone; ../../shared/peers from a worktree under wt/. Override with NNSCALER_PEERS.
NNSCALER_PEERS ?= $(firstword $(wildcard ../shared/peers ../../shared/peers))
NNSCALER_TARBALL := $(firstword $(wildcard $(NNSCALER_PEERS)/nnscaler-*.tar.gz))
NNS_VENV := .venv-nnscaler
NNS_PY := $(NNS_VENV)/bin/python
NNS_SRC := build/nnscaler-peer/nnscaler
NNS_WHEELS := build/wheels
# nnScaler's requirements.txt pins torch<=2.6: it is installed --no-deps with these.
NNSCALER_DEPS := dill matplotlib more-itertools numpy psutil pulp "pybind11<3" pyyaml tqdm

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
	$(PY) -m pip install -q "$(TORCH_SPEC)" pytest numpy matplotlib "transformers>=5,<6"
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
	@# An editable install does not copy the import hook's .pth (a wheel install does):
	@# put it in site-packages so `import nnscaler` finds our names (_nnscaler_eval_ns.py).
	cp nnscaler_eval_ns.pth "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/"

demo: build
	$(PY) -m nnscaler_eval.tools.demo

# Both suites run; the target fails if either did.
test: build
	@status=0; \
	$(MAKE) --no-print-directory suite || status=$$?; \
	if [ -z "$(PYV)" ]; then $(MAKE) test-nnscaler || status=$$?; fi; \
	exit $$status

# The suite alone, on the build in place (.ci/run builds every version first, one at a
# time, then runs the suites two at a time: builds write shared files, suites do not).
suite:
	$(PY) -m pytest -q -ra $(PYTEST_ARGS)

# .venv-nnscaler: torch (kept at TORCH_SPEC), nnScaler's wheel --no-deps, nnscaler-eval
# editable; build/wheels: both wheels, for the install-order tests' throwaway venvs.
$(NNS_VENV)/.deps: pyproject.toml
	@test -x $(NNS_PY) || $(PYTHON) -m venv $(NNS_VENV)
	$(NNS_PY) -m pip install -q --upgrade pip setuptools wheel
	$(NNS_PY) -m pip install -q "$(TORCH_SPEC)" pytest $(NNSCALER_DEPS)
	touch $@

$(NNS_SRC)/.unpacked: $(NNSCALER_TARBALL)
	rm -rf build/nnscaler-peer && mkdir -p build/nnscaler-peer
	tar xzf $(NNSCALER_TARBALL) -C build/nnscaler-peer
	touch $@

nnscaler-env: sysdeps $(NNS_VENV)/.deps $(NNS_SRC)/.unpacked
	mkdir -p $(NNS_WHEELS)
	@if [ ! -f $(NNS_WHEELS)/.nnscaler-built ] || [ $(NNS_SRC)/.unpacked -nt $(NNS_WHEELS)/.nnscaler-built ]; then \
	  rm -f $(NNS_WHEELS)/nnscaler-*.whl && \
	  $(NNS_PY) -m pip wheel -q --no-deps --no-build-isolation -w $(NNS_WHEELS) $(NNS_SRC) && \
	  touch $(NNS_WHEELS)/.nnscaler-built; fi
	rm -f $(NNS_WHEELS)/nnscaler_eval-*.whl
	NNSCALER_WERROR=1 $(NNS_PY) -m pip wheel -q --no-deps --no-build-isolation -w $(NNS_WHEELS) .
	$(NNS_PY) -m pip install -q --no-deps --force-reinstall $(NNS_WHEELS)/nnscaler-*.whl
	NNSCALER_WERROR=1 $(NNS_PY) -m pip install -q --no-build-isolation --no-deps -e .
	cp nnscaler_eval_ns.pth "$$($(NNS_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/"

test-nnscaler:
	@if [ -z "$(NNSCALER_TARBALL)" ]; then \
	  echo "SKIPPED test-nnscaler: ../shared/peers/nnscaler-*.tar.gz (Microsoft nnScaler's source) not found"; \
	else \
	  $(MAKE) nnscaler-env && \
	  NNSCALER_PEERS="$(abspath $(NNSCALER_PEERS))" NNSCALER_PEER_SRC="$(abspath $(NNS_SRC))" \
	  NNSCALER_WHEELS="$(abspath $(NNS_WHEELS))" \
	  $(NNS_PY) -m pytest -q -ra -p no:cacheprovider tests/test_nnscaler_install.py tests/test_nnscaler_parallelize.py tests/test_nnscaler_saveload.py tests/test_nnscaler_values.py \
	    tests/test_nnscaler_dynamic.py; \
	fi

# nnScaler's own test files that build a graph, run against our capture
# (tests/nnscaler_suite/run.py says how; expected_failures.txt says which may fail).
NNSCALER_SUITE_ARGS ?=
test-nnscaler-suite:
	@if [ -z "$(NNSCALER_TARBALL)" ]; then \
	  echo "SKIPPED test-nnscaler-suite: ../shared/peers/nnscaler-*.tar.gz (Microsoft nnScaler's source) not found"; \
	else \
	  $(MAKE) nnscaler-env && \
	  $(NNS_PY) tests/nnscaler_suite/run.py --tarball "$(NNSCALER_TARBALL)" $(NNSCALER_SUITE_ARGS); \
	fi

asan: sysdeps
	$(MAKE) VENV=.venv-asan venv
	NNSCALER_SANITIZE=1 .venv-asan/bin/python -m pip install -q --no-build-isolation --no-deps -e . --force-reinstall
	cp nnscaler_eval_ns.pth "$$(.venv-asan/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/"
	# PYTHONMALLOC=malloc: without it pymalloc recycles small objects in its own
	# arenas and ASan cannot see a use after free of one.  The variables reach the
	# subprocesses that the crash tests (tests/test_hardening*.py) start.
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  PYTHONMALLOC=malloc \
	  LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	  .venv-asan/bin/python -m pytest -q -x -p no:faulthandler $(PYTEST_ARGS)
	# leave the normal build in place for the next `make test`
	rm -f nnscaler_eval/_C*.so

# The source lints read files only: no build, and no conftest (it imports _C).
lint: venv
	@[ "$$($(PY) -m ruff --version 2>/dev/null)" = "$(subst ==, ,$(RUFF_SPEC))" ] || \
	  $(PY) -m pip install -q "$(RUFF_SPEC)"
	$(PY) -m ruff check .
	$(PY) -m pytest -q --noconftest tests/test_lint.py

leakcheck: build
	$(PY) -m pytest -q tests/test_leaks.py tests/test_rewrite_leaks.py tests/test_cache_entry.py --run-slow

fuzz: build
	NNSCALER_FUZZ_CASES=20000 $(PY) -m pytest -q -s tests/test_rewrite_fuzz.py

# The state-mutation fuzzer (tests/state_fuzz.py) over several seeds: each seed orders
# the mutations differently, so each change lands on other state left by the last.
fuzz-state: build
	@status=0; for seed in 0 1 2 3 4; do \
	  $(PY) tests/state_fuzz.py --mutations 5000 --seed $$seed || status=1; \
	done; exit $$status

# The suite on CPython 3.12 / 3.13 / 3.14; a clear SKIP (success) without the interpreters.
# build-3.X: that version's build only (.ci/run).
build-3.12 build-3.13 build-3.14:
	@if .ci/pyenv.sh --check $(@:build-%=%); then \
	  $(MAKE) --no-print-directory PYV=$(@:build-%=%) build; \
	fi

test-3.12 test-3.13 test-3.14:
	@if .ci/pyenv.sh --check $(@:test-%=%); then \
	  $(MAKE) --no-print-directory PYV=$(@:test-%=%) test; \
	fi

bench-quick: build
	$(PY) -m pip install -q matplotlib
	$(PY) -m benchmarks.run --quick

bench: build
	$(PY) -m pip install -q matplotlib
	$(PY) -m benchmarks.run

# benchmarks/results/bench_ir-<date>.{md,json}; the figures README.md quotes.
BENCH_IR_ARGS ?=
bench-ir: build
	@command -v valgrind >/dev/null 2>&1 || { \
	  echo "error: bench-ir runs under valgrind's callgrind: apt-get install valgrind"; exit 1; }
	$(PY) -m benchmarks.bench_ir $(BENCH_IR_ARGS)

# The device machine has its own Python and torch and no package registry: GPU_PY
# names its interpreter; a .devdeps folder (libxxhash-dev unpacked: `apt-get download
# libxxhash-dev libxxhash0` and `dpkg -x` each into .devdeps, carried along) stands in
# for the system headers.  The report: GPU_OUT/gpu-check.md.
GPU_PY ?= $(PY)
GPU_OUT ?= build/gpu-check
gpu-check:
	@mkdir -p $(GPU_OUT)
	@deps=$(abspath .devdeps); \
	if [ -d "$$deps" ]; then \
	  export CPATH="$$deps/usr/include:$${CPATH:-}" \
	         LIBRARY_PATH="$$deps/usr/lib/x86_64-linux-gnu:$${LIBRARY_PATH:-}" \
	         LD_LIBRARY_PATH="$$deps/usr/lib/x86_64-linux-gnu:$${LD_LIBRARY_PATH:-}"; \
	fi; \
	if [ "$(GPU_PY)" = "$(PY)" ]; then $(MAKE) --no-print-directory build || exit 1; \
	else $(GPU_PY) -m pip install -q --no-build-isolation --no-deps -e . || exit 1; \
	  cp nnscaler_eval_ns.pth "$$($(GPU_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/"; fi; \
	report=$(GPU_OUT)/gpu-check.md; \
	{ echo "# make gpu-check ($$(date -u +%FT%TZ))"; echo; \
	  $(GPU_PY) -c 'import platform, torch; print("Python", platform.python_version(), "torch", torch.__version__, "CUDA", torch.version.cuda, "device", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")'; \
	  echo; echo "## tests/test_gpu.py"; echo; echo '```'; } > $$report; \
	{ $(GPU_PY) -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py 2>&1; \
	  echo $$? > $(GPU_OUT)/tests.rc; } | tail -40 >> $$report; \
	status=$$(cat $(GPU_OUT)/tests.rc); echo '```' >> $$report; echo >> $$report; \
	$(GPU_PY) -m benchmarks.gpu $(GPU_ARGS) --out $(GPU_OUT)/gpu-bench.md > /dev/null || status=1; \
	cat $(GPU_OUT)/gpu-bench.md >> $$report; cat $$report; exit $$status

clean:
	rm -rf build *.egg-info nnscaler_eval/_C*.so
