# dbidx: the two commands in the README are `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-delta-spark lint typecheck spark-cds test-fast fuzz test-cluster pack-env bench bench-smoke bench-smoke-hudi bench-index bench-mdt bench-cache bench-bootstrap bench-spark bench-commit bench-footprint bench-skew bench-restart bench-absorb bench-dv-readers bench-peers bench-scale bench-speed bench-soak check-java clean

demo: check-java $(STAMP)
	$(BIN)/dbidx demo

# Test processes (pytest-xdist). loadgroup keeps the tests of the session's SparkSession in one process (one
# local[2] Spark per run) and a module's tests that share a module-scoped set-up together (tests/conftest.py marks the
# groups and queues the Spark group and the slow tests first, an order --no-loadscope-reorder keeps). The full suite
# runs on 3 processes even on 2 cores: a third keeps the cores busy while a slow test waits on the JVMs and processes
# it starts (2 cores, 2026-11-27: a fresh clone's first pytest run took 802 s on 2 processes and 765 s on 3, a second
# run on 3 took 701 s; with 3, the machine is busy 92 % of the run); the fast tier, CPU-bound, on 2.
XDIST_OPTS := --dist loadgroup --no-loadscope-reorder
XDIST := -n 2 $(XDIST_OPTS)
XDIST_FULL := -n 3 $(XDIST_OPTS)

# The full suite but the packed-environment cluster test (about 70 s, needs PyPI: `make test-cluster` runs that) and
# the benchmark scripts' smoke runs (about a fifth of the suite's CPU: `make bench-smoke`, which CI runs right after
# this). tools/run_tests.py puts the tests' files on tmpfs when there is one; the lint runs beside the one-time build
# of the Spark class-data archive the tests' JVMs start from (tools/spark_cds.py).
test: check-java $(STAMP)
	@$(MAKE) --no-print-directory -j2 lint spark-cds
	$(BIN)/python -m tools.run_tests --spark-cds -m "not packing and not bench_smoke and not delta_tier and not peer_env" $(XDIST_FULL) --durations=15

# Delta Spark's other writes (replaceWhere, auto compaction, clones, a writer in another process) and the Delta table
# features refused or kept (features, kept_features, v2_checkpoint): four modules of 60-120 s each on the tests' one
# SparkSession (27 tests: 443 s on a machine busy with other runs, 2026-12-08), kept out of `make test` to hold it
# near 10 minutes on 2 cores (Delta Spark's reads, writes, maintenance, VACUUM and NOT NULL stay in it); CI runs them.
test-delta-spark: check-java $(STAMP) spark-cds
	$(BIN)/python -m tools.run_tests --spark-cds -m delta_tier $(XDIST_FULL) --durations=10

# The Spark class-data archive of this virtualenv (once; a JDK that cannot build one only costs the speed-up).
spark-cds: $(STAMP)
	@$(BIN)/python -m tools.spark_cds

# Lint (ruff: pycodestyle, pyflakes, no blind except or blanket noqa without a reason; the format check; the type
# check). pyproject.toml [tool.ruff] and [tool.mypy]. `ruff format .` fixes what the format check finds.
lint: $(STAMP) typecheck
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy over the package (the repository root is `dbidx`: mypy sees it through a link named so in a temporary dir).
typecheck: $(STAMP)
	@root=$$(mktemp -d) && ln -s "$(CURDIR)" "$$root/dbidx" && cd "$$root" && \
	  "$(CURDIR)/$(BIN)/mypy" --config-file "$(CURDIR)/pyproject.toml" --cache-dir "$(CURDIR)/.mypy_cache" -p dbidx; \
	  status=$$?; rm -rf "$$root"; exit $$status

# Day-to-day tier: no Spark, nothing marked slow (840 tests: 1 min 16 s on 2 cores, 2026-12-07). A test that takes more
# than about 2.5 s here gets @pytest.mark.slow (make test runs it).
test-fast: $(STAMP)
	$(BIN)/python -m tools.run_tests -m "not spark and not slow" $(XDIST)

# The decoder fuzz tests with 20,000 examples per decoder (make test runs 1,000; a few minutes).
fuzz: $(STAMP)
	DBIDX_FUZZ_EXAMPLES=20000 $(BIN)/python -m pytest tests/test_fuzz_decoders.py

# The standalone-cluster tests alone (a master and two workers in subprocesses; docs/DEPLOY.md), the packed-environment
# one included. `make test` runs all but that one.
test-cluster: check-java $(STAMP)
	$(BIN)/python -m pytest -m cluster

# dbidx and its runtime dependencies (not pyspark) as a packed virtualenv for spark.archives (docs/DEPLOY.md).
pack-env: $(STAMP)
	$(BIN)/python tools/pack_env.py --out dist/dbidx-env.tar.gz

# Every benchmark at full size (tens of minutes); rewrites benchmarks/RESULTS.md and benchmarks/results/*.png.
bench: check-java $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,bench,peers]'
	$(BIN)/python benchmarks/index_bench.py --write-results
	$(BIN)/python benchmarks/cache_bench.py --write-results
	$(BIN)/python benchmarks/bootstrap_bench.py --write-results
	$(BIN)/python benchmarks/footprint_bench.py --write-results
	$(BIN)/python benchmarks/skew_bench.py --write-results
	$(BIN)/python benchmarks/restart_bench.py --write-results
	$(BIN)/python benchmarks/table_bench.py --write-results
	$(BIN)/python benchmarks/spark_bench.py --write-results
	$(BIN)/python benchmarks/commit_bench.py --write-results
	$(BIN)/python benchmarks/speed_bench.py --write-results
	$(BIN)/python benchmarks/projection.py

# Every benchmark at smoke size (under a minute); the test suite runs the same.
# Every benchmark script at tiny sizes, each checked to run to its results table (tests/test_bench_smoke.py; CI runs
# this after `make test`).
bench-smoke: check-java $(STAMP) spark-cds
	$(BIN)/python -m tools.run_tests --spark-cds -m bench_smoke $(XDIST_FULL)

# peer_bench.py's Hudi systems at smoke size (2-4 min on 2 cores): Hudi 1.2.0 runs on Spark 3.5, in a virtualenv the
# benchmark builds from PyPI and Maven Central on first use (about a minute, cached under ~/.cache/dbidx-bench), so it
# is kept out of `make bench-smoke`, which needs no network.
bench-smoke-hudi: check-java $(STAMP)
	$(BIN)/python -m pytest -m peer_env tests/test_bench_smoke.py

bench-footprint: $(STAMP)
	$(BIN)/python benchmarks/footprint_bench.py --write-results

bench-skew: $(STAMP)
	$(BIN)/python benchmarks/skew_bench.py --write-results

bench-restart: $(STAMP)
	$(BIN)/python benchmarks/restart_bench.py --write-results

bench-absorb: $(STAMP)
	$(BIN)/python benchmarks/absorb_bench.py --write-results

bench-dv-readers: $(STAMP)
	$(BIN)/python benchmarks/dv_reader_bench.py --write-results

bench-index: $(STAMP)
	$(BIN)/python benchmarks/index_bench.py

bench-mdt: bench-index  # 0.1's name of bench-index, kept for 0.2 only

bench-cache: $(STAMP)
	$(BIN)/python benchmarks/cache_bench.py

bench-bootstrap: $(STAMP)
	$(BIN)/python benchmarks/bootstrap_bench.py --write-results

bench-spark: check-java $(STAMP)
	$(BIN)/python benchmarks/spark_bench.py --write-results

bench-commit: check-java $(STAMP)
	$(BIN)/python benchmarks/commit_bench.py --write-results

# dbidx vs delta-rs, pyiceberg (and pypaimon if installed by hand) vs a Spark join, one process per system with a time
# cap (hours at 10 M keys); writes one RESULTS.md section per size and the batch-time chart.
bench-peers: check-java $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,bench,peers]'
	$(BIN)/python benchmarks/peer_bench.py --keys 200000 --write-results
	$(BIN)/python benchmarks/peer_bench.py --keys 2000000 --write-results \
	  --systems dbidx,delta-id,delta-dt-id,pyiceberg,pypaimon,spark-join,delta-spark,hudi-cow,hudi-mor
	$(BIN)/python benchmarks/peer_bench.py --keys 10000000 --write-results

# dbidx's curve on one machine: index build, one-shard bootstrap and Spark tagging at 10 M and 100 M UUID keys.
# Estimated from 1 M / 10 M runs: ~10 min, ~4 GB of disk under the current directory at peak (the script wants 9 GB
# free), ~10 GB of RAM at peak (the cold first batch loads both shards' caches on demand).
# Every row of the speed issue's table beside its anchor (Spark floor, Spark's own write), in one run.
bench-speed: check-java $(STAMP)
	$(BIN)/python benchmarks/speed_bench.py --write-results

# The soak of issue 44 (table services on): 1,000 batches of 10 k rows on 1 M keys, then 200 batches of 100 k rows on
# 10 M keys (reads every 50 batches there: the goals compare batches 151-200 with 51-100), through Spark upsert; one
# RESULTS.md section and chart per run. Hours on 2 cores; the data sets are
# generated under soak-work/ once and reused. Stops at once if dbidx has no table services (--services off runs
# today's behaviour: python benchmarks/soak_bench.py --services off ...).
bench-soak: check-java $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,bench,peers]'
	$(BIN)/python benchmarks/soak_bench.py --keys 1000000 --batches 1000 --batch 10000 --work soak-work --write-results
	$(BIN)/python benchmarks/soak_bench.py --keys 10000000 --batches 200 --batch 100000 --read-every 50 --work soak-work \
	  --write-results

bench-scale: check-java $(STAMP)
	$(BIN)/python benchmarks/scale_bench.py --write-results

check-java:
	@command -v java >/dev/null 2>&1 || { \
	  echo "dbidx needs Java 17 for PySpark, and 'java' is not on PATH."; \
	  echo "Install it, e.g. 'sudo apt-get install -y openjdk-17-jre-headless' (Debian/Ubuntu)"; \
	  echo "or 'brew install openjdk@17' (macOS), or set JAVA_HOME and add \$$JAVA_HOME/bin to PATH."; \
	  exit 1; }
	@java -version 2>&1 | grep -Eq 'version "(17|18|19|2[0-9])' || { \
	  echo "dbidx needs Java 17 or newer for PySpark 4; found: $$(java -version 2>&1 | head -1)"; exit 1; }

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required"' || \
	  { echo "dbidx needs Python 3.11 or newer as '$(PYTHON)'"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache
