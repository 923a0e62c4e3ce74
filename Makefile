# aiosnap developer tasks. `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
# torch is installed first, pinned, in the build you choose. From PyPI, torch==2.13.0 on Linux
# x86_64 is the CUDA build (several GB of CUDA libraries); macOS and Windows get a CPU build.
# Pick a build with PyTorch's own index:
#   make TORCH_INDEX=https://download.pytorch.org/whl/cpu install     # CPU only (small)
#   make TORCH_INDEX=https://download.pytorch.org/whl/cu128 install   # a CUDA 12.8 build; the
#     suffixes each torch release has (cu126, cu128, ...) are on pytorch.org's install page
# or name any requirement yourself: make TORCH_SPEC="torch==2.5.1" install.
TORCH_VERSION ?= 2.13.0
TORCH_SPEC ?= torch==$(TORCH_VERSION)
TORCH_INDEX ?=
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A local wheel cache, when this machine has one (this project's build machines keep the CPU
# torch build there, which pip then prefers: 2.13.0+cpu sorts above 2.13.0).
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
TORCH_FROM := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),)
STAMP := $(VENV)/.installed-$(TORCH_VERSION)
# LocalStack's S3 (a second test server, one that checks request checksums) in a virtualenv
# of its own: its dependencies would clash with the project's. 4.12 is the last release
# that runs on Python 3.11.
LOCALSTACK_VENV ?= .venv-localstack
LOCALSTACK_SPEC ?= "localstack-core[runtime]==4.12.0" "cbor2<6" "pyopenssl<24.3"
LOCALSTACK_STAMP := $(LOCALSTACK_VENV)/.installed-4.12.0

.PHONY: install localstack demo test lint docs bench soak gpu-check clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet $(FIND_LINKS) $(TORCH_FROM) "$(TORCH_SPEC)"
	$(PIP) install --quiet $(FIND_LINKS) -e ".[dev]"
	touch $@

localstack: $(LOCALSTACK_STAMP)

$(LOCALSTACK_STAMP):
	$(PYTHON) -m venv $(LOCALSTACK_VENV)
	$(LOCALSTACK_VENV)/bin/python -m pip install --quiet $(LOCALSTACK_SPEC)
	touch $@

demo: install
	$(PY) examples/train_loop.py

lint: install
	$(VENV)/bin/ruff check aiosnap tests examples
	$(VENV)/bin/ruff format --check aiosnap tests examples
	$(VENV)/bin/mypy

# The documentation site (Material for MkDocs, API pages from the docstrings), warnings as errors.
docs: install
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet --site-dir site

# The suite in TEST_WORKERS processes (pytest-xdist; 0: in this one). Most tests wait on
# child processes, servers and timers, so two workers finish sooner even on two cores;
# LocalStack's tests share one worker (one server, see tests/conftest.py).
TEST_WORKERS ?= 2

test: lint docs localstack
	TEST_LOCALSTACK_PYTHON=$(LOCALSTACK_VENV)/bin/python TEST_REQUIRE_LOCALSTACK=1 \
		$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup

# The fault soak and the fuzzers, long: many saves through failing storage, the fault proxy
# and SIGKILLed trainers, then the invariant (a short version runs inside `make test`).
soak: install
	$(PY) -m pytest tests/test_soak.py tests/test_fuzz.py -s -p no:cacheprovider \
		--soak-rounds 300 --soak-kills 20 --fuzz-cases 50000 --timeout 3000

# Every benchmark, then one table of the headline figures against their floors and goals:
# each benchmark appends its figures to BENCH_RESULTS (JSON lines, see aiosnap/bench/results.py).
BENCH_RESULTS ?= bench-results.jsonl

bench: install
	rm -f $(BENCH_RESULTS)
	$(PY) -m aiosnap.bench local --results $(BENCH_RESULTS)
	$(PY) -m aiosnap.bench s3
	$(PY) -m aiosnap.bench s3 --cap-mb-s 50
	$(PY) -m aiosnap.bench s3 --cap-mb-s 40 --size-mb 100 --results $(BENCH_RESULTS)
	$(PY) -m aiosnap.bench spool --results $(BENCH_RESULTS)
	$(PY) -m aiosnap.bench executor --results $(BENCH_RESULTS)
	$(PY) -m aiosnap.bench lightning
	$(PY) -m aiosnap.bench load
	$(PY) -m aiosnap.bench many
	$(PY) -m aiosnap.bench interference --results $(BENCH_RESULTS)
	$(PY) -m aiosnap.bench distributed --results $(BENCH_RESULTS)
	$(PY) -m aiosnap.bench distributed --simulate
	$(PY) -m aiosnap.bench incremental --base-mb 256 --full-mb 256 --results $(BENCH_RESULTS)
	$(PY) -m aiosnap.bench summary $(BENCH_RESULTS)

# The CUDA tests and the D2H staging benchmark (pinned staging: aiosnap against DCP's pinned
# stager), one table, within 8 minutes on one GPU. Without CUDA the tests skip, the benchmark
# says so, and it exits 0 (CI may run it anywhere). `make gpu-check PY=python3` uses an
# interpreter that already has torch and aiosnap's requirements, and installs nothing.
gpu-check: $(if $(filter command line,$(origin PY)),,install)
	@$(PY) -c "import torch; print('CUDA device:', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none (torch ' + torch.__version__ + '): the gpu tests skip, the benchmark measures nothing')"
	timeout 240 $(PY) -m pytest -m gpu -p no:cacheprovider -q -rs --timeout 200 tests/test_gpu.py tests/test_bench_gpu.py
	timeout 230 $(PY) -m aiosnap.bench gpu

clean:
	rm -rf $(VENV) $(LOCALSTACK_VENV) build site *.egg-info .pytest_cache .mypy_cache .ruff_cache checkpoints
