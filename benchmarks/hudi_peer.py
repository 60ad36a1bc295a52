"""Apache Hudi as a peer of peer_bench.py: its upsert with the record index, on a Spark of its own.

Why an environment of its own: dbidx's environment runs Spark 4.2 (Delta Spark 4.4 needs it), and Hudi's jars are
built for one Spark minor version each. The newest Hudi bundle that Maven Central serves here is
`org.apache.hudi:hudi-spark3.5-bundle_2.12:1.2.0` (2026-12-08: the Spark 4 bundles `hudi-spark4.0-bundle_2.13` and
`hudi-spark4.1-bundle_2.13` answer 404 for every 1.1.x and 1.2.x version, and the 1.2.1 Spark 3.5 bundle has its POM
but no jar), built against Spark 3.5.5 and Scala 2.12 (Hudi 1.2.0's POM: `spark35.version`), which is what PyPI's
`pyspark==3.5.5` ships. So the benchmark builds, once per (Hudi, Spark, Python) version, a virtualenv with that pyspark,
pyarrow and psutil, and resolves the bundle from Maven Central into an Ivy dir beside it (Spark's own resolver:
`spark.jars.packages` with `spark.jars.ivy`), under `$DBIDX_BENCH_ENV_DIR`, else `$XDG_CACHE_HOME/dbidx-bench`, else
`~/.cache/dbidx-bench`. Later runs reuse it without the network (the sessions name the resolved jar files).
The Hudi child runs peer_bench.py's `--run-one` with that virtualenv's Python (and PYSPARK_PYTHON): nothing of dbidx
is importable there (the repository is not installed in it), so no Delta Spark set-up can load by accident.

The system (record key `id`, partition path `dt`, ordering field `ver`, like the other systems' (dt, id) merges):
  the load with `bulk_insert`, each batch with `upsert`; the metadata table on (`hoodie.metadata.enable`), and the
  record index: global (`hoodie.index.type=GLOBAL_RECORD_LEVEL_INDEX`, 1.2.0's name for RECORD_INDEX, which it keeps
  as a deprecated alias; `hoodie.metadata.global.record.level.index.enable`, alias `hoodie.metadata.record.index.
  enable`: one key -> file group map for the whole table, Hudi's index since 0.14) or partitioned
  (`RECORD_LEVEL_INDEX`, `hoodie.metadata.record.level.index.enable`, since 1.1: keys unique per partition, looked
  up by (dt, id) like the (dt, id) merges); copy-on-write or merge-on-read. The names were checked in the 1.2.0
  bundle's classes (HoodieIndex.IndexType, HoodieMetadataConfig). Every other setting is Hudi's default as shipped,
  table services included: automatic cleaning (keeps the last 10 commits), the metadata table's default partitions
  (files, column stats, partition stats beside the record index), and for merge-on-read the inline compaction that
  Hudi's Spark datasource turns on for batch writes (every 5 delta commits: with the default 5 batches the fifth
  batch compacts every file group, so the compaction figure's run_compaction after the reads finds nothing left;
  measured at 2 M keys, 2026-12-08: the merge-on-read timeline held 2 commits, the load's and the compaction's, and 5
  delta commits). peer_bench.py prints, per Hudi system, the table type, the index and the timeline's completed
  actions (what the table services did).
Peak RSS caveat: the Hudi JVM starts short-lived child processes (seen in the sampled tree under the names of the JVM
threads that started them, e.g. "Executor task launch", with 1.3-2 GB resident each: a spawned child shares the
JVM's pages until it execs), which the process-tree sampler adds to the JVM's own. In a 2 M-key run of hudi-cow the
JVM's own peak was 4.7 GB; the table's peak RSS of a Hudi system can be up to one JVM larger than what it holds.
  Reads: `spark.read.format("hudi").load(path)` (a snapshot read: merge-on-read merges the log files); the full read
  writes every column to Spark's `noop` sink; `compact()` (merge-on-read only) runs Hudi's `run_compaction` procedure
  (schedule and execute) so the read after it is of base files alone.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import _report  # beside this module (peer_bench.py puts its folder on sys.path first)

HUDI_VERSION = "1.2.0"
SPARK_VERSION = "3.5.5"  # Hudi 1.2.0's spark35.version: the Spark its Spark 3.5 bundle is compiled against
SCALA_VERSION = "2.12"  # PyPI's pyspark 3.5 ships Scala 2.12 jars
HUDI_BUNDLE = f"org.apache.hudi:hudi-spark3.5-bundle_{SCALA_VERSION}:{HUDI_VERSION}"
# What --run-one needs in the Hudi environment: peer_bench.py imports pyarrow; _report's tree sampling uses psutil.
REQUIREMENTS = [f"pyspark=={SPARK_VERSION}", "pyarrow>=16,<22", "psutil"]

# The settings Hudi's quick start gives a Spark session (Kryo with Hudi's registrar, its SQL extension and catalog:
# the `CALL run_compaction` procedure needs the extension).
SESSION_CONF = {
    "spark.serializer": "org.apache.spark.serializer.KryoSerializer",
    "spark.kryo.registrator": "org.apache.spark.HoodieSparkKryoRegistrar",
    "spark.sql.extensions": "org.apache.spark.sql.hudi.HoodieSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.hudi.catalog.HoodieCatalog",
}


# ---------------------------------------------------------------------------------------------------------------
# The environment: built by the benchmark on first use, keyed by the versions, reused after.


def env_root() -> Path:
    """Where the Hudi environments live: $DBIDX_BENCH_ENV_DIR, else the user cache dir's dbidx-bench."""
    configured = os.environ.get("DBIDX_BENCH_ENV_DIR")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dbidx-bench"


def env_dir() -> Path:
    """This version pairing's environment (the Python minor version too: a venv is bound to its interpreter)."""
    python = f"py{sys.version_info.major}.{sys.version_info.minor}"
    return env_root() / f"hudi-{HUDI_VERSION}-spark-{SPARK_VERSION}-{python}"


def python_of(env: Path) -> Path:
    return env / "venv" / "bin" / "python"


def ready(env: Path) -> dict[str, Any] | None:
    """The environment's stamp (its jars and versions) if it was built to the end, else None."""
    stamp = env / "ready.json"
    return json.loads(stamp.read_text()) if stamp.exists() else None


_RESOLVE = """
import sys
from pyspark.sql import SparkSession
spark = (SparkSession.builder.master("local[1]").appName("hudi-env-resolve")
         .config("spark.ui.enabled", "false")
         .config("spark.jars.packages", sys.argv[1]).config("spark.jars.ivy", sys.argv[2]).getOrCreate())
print(spark.version)
spark.stop()
"""


def ensure_env(log: Any = sys.stderr) -> Path:
    """The Hudi environment's Python, building the environment first if it is not there: a virtualenv with REQUIREMENTS
    from PyPI, then the bundle and its dependencies resolved by Spark from Maven Central into the environment's Ivy
    dir. A file lock makes a second benchmark wait for the first's build; a build that died is started over. Raises
    RuntimeError naming the step and its output when a step fails."""
    env = env_dir()
    env.parent.mkdir(parents=True, exist_ok=True)
    with open(env.parent / f"{env.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if ready(env) is None:
            shutil.rmtree(env, ignore_errors=True)
            env.mkdir()
            print(f"hudi: building its environment in {env} (once: pyspark {SPARK_VERSION}, {HUDI_BUNDLE})", file=log)
            _step([sys.executable, "-m", "venv", str(env / "venv")], "create the virtualenv")
            python = str(python_of(env))
            _step([python, "-m", "pip", "install", "--quiet", "--upgrade", "pip"], "upgrade pip")
            _step([python, "-m", "pip", "install", "--quiet", *REQUIREMENTS], "pip install " + " ".join(REQUIREMENTS))
            clean = child_env(env)
            version = _step(
                [python, "-c", _RESOLVE, HUDI_BUNDLE, str(env / "ivy")], f"resolve {HUDI_BUNDLE}", clean
            ).split()[-1]
            jars = sorted(str(p) for p in (env / "ivy" / "jars").glob("*.jar"))
            if version != SPARK_VERSION or not any("hudi-spark3.5-bundle" in j for j in jars):
                raise RuntimeError(f"hudi environment: Spark {version}, jars {jars}: not the pairing asked for")
            stamp = {"hudi": HUDI_VERSION, "spark": version, "bundle": HUDI_BUNDLE, "jars": jars}
            (env / "ready.json").write_text(json.dumps(stamp, indent=1))
    return python_of(env)


def _step(command: list[str], what: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"hudi environment: {what} failed (exit {done.returncode}): {done.stderr.strip()[-1500:]}")
    return done.stdout


def child_env(env: Path) -> dict[str, str]:
    """The process environment of a child on the Hudi virtualenv (isolated_env of its Python)."""
    return isolated_env(python_of(env))


def isolated_env(python: Path) -> dict[str, str]:
    """The process environment of a child on a virtualenv of its own: its Python for the Spark workers too, and
    nothing that would put the parent's packages (PYTHONPATH: the test suite passes its own sys.path, pyspark 4
    included) or the parent's Spark (SPARK_HOME) on the child's path."""
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPARK_HOME", "PYTHONHOME")}
    clean.update(PYSPARK_PYTHON=str(python), PYSPARK_DRIVER_PYTHON=str(python), VIRTUAL_ENV=str(python.parent.parent))
    return clean


def describe() -> str | None:
    """'Hudi <version> on pyspark <version> (bundle)' when the environment is built, else None."""
    stamp = ready(env_dir())
    return None if stamp is None else f"Hudi {stamp['hudi']} on pyspark {stamp['spark']} ({stamp['bundle']})"


# ---------------------------------------------------------------------------------------------------------------
# The system, run inside the Hudi environment by peer_bench.py's run_one.


class HudiPeer(_report.CachedFrames):
    """A Hudi table upserted through the Spark datasource; peer_bench.py's system protocol (prepare, load, upsert,
    release, read_all, files, counts, close, note; compact for merge-on-read: peer_bench.py calls it when it is
    there, so a copy-on-write peer has none)."""

    table_type = "COPY_ON_WRITE"

    def __init__(self, root: Path, work: Path, shards: int, partitioned_index: bool) -> None:
        stamp = ready(env_dir())
        if stamp is None or Path(sys.prefix).resolve() != (env_dir() / "venv").resolve():
            raise RuntimeError("the Hudi system runs in its own environment (peer_bench.py starts it there)")
        extra = {**SESSION_CONF, "spark.jars": ",".join(stamp["jars"])}
        self.spark = _report.spark_session(work / "spark-local", shards, "dbidx-peer-bench-hudi", extra=extra)
        self.path = str(root)
        index = (
            {"hoodie.index.type": "RECORD_LEVEL_INDEX", "hoodie.metadata.record.level.index.enable": "true"}
            if partitioned_index
            else {
                "hoodie.index.type": "GLOBAL_RECORD_LEVEL_INDEX",
                "hoodie.metadata.global.record.level.index.enable": "true",
            }
        )
        self.options = {
            "hoodie.table.name": "peer",
            "hoodie.datasource.write.table.type": self.table_type,
            "hoodie.datasource.write.recordkey.field": "id",
            "hoodie.datasource.write.partitionpath.field": "dt",
            "hoodie.table.ordering.fields": "ver",
            "hoodie.metadata.enable": "true",
            **index,
        }

    def _write(self, data: Any, operation: str, mode: str) -> None:
        writer = data.write.format("hudi").options(**self.options)
        writer.option("hoodie.datasource.write.operation", operation).mode(mode).save(self.path)

    def load(self, data: Any) -> None:
        self._write(data, "bulk_insert", "overwrite")

    def upsert(self, data: Any) -> None:
        self._write(data, "upsert", "append")

    def _snapshot(self) -> Any:
        return self.spark.read.format("hudi").load(self.path)

    def counts(self) -> tuple[int, int]:
        """(rows, sum of ver) of a snapshot read; rows is -1 (the check says WRONG) when a key is there twice."""
        from pyspark.sql import functions as F

        row = self._snapshot().agg(F.count("*"), F.countDistinct("id"), F.sum("ver")).first()
        rows, keys = int(row[0]), int(row[1])
        if rows != keys:
            print(f"hudi: {rows - keys} duplicate keys read back", file=sys.stderr)
            return -1, int(row[2] or 0)
        return rows, int(row[2] or 0)

    def read_all(self) -> None:
        """Every column of the snapshot through Spark's noop sink (a count alone would need no column but the merge's:
        Hudi's full read is the merge on read of every column)."""
        self._snapshot().write.format("noop").mode("overwrite").save()

    def _latest_slices(self) -> list[Any]:
        """The latest file slice of every file group (Hudi's show_fsview_latest procedure over every partition)."""
        return self.spark.sql(
            f"CALL show_fsview_latest(path => '{self.path}', path_regex => '*', limit => 100000000)"
        ).collect()

    def files(self) -> int | None:
        """Base and log files of the latest file slices: the files a snapshot read opens."""
        return sum(int(bool(s["data_file"])) + int(s["num_delta_files"]) for s in self._latest_slices())

    def note(self) -> str:
        """The table as written: type, index, the merge mode, metadata partitions and the timeline's completed
        actions (what the table services did: compaction commits, cleans)."""
        properties = dict(
            line.split("=", 1)
            for line in (Path(self.path) / ".hoodie" / "hoodie.properties").read_text().splitlines()
            if "=" in line and not line.startswith("#")
        )
        actions: dict[str, int] = {}
        for instant in (Path(self.path) / ".hoodie" / "timeline").glob("[0-9]*_*.*"):  # done: <begin>_<end>.<action>
            action = instant.name.split(".", 1)[1]
            actions[action] = actions.get(action, 0) + 1
        done = ", ".join(f"{n} {a}" for a, n in sorted(actions.items()))
        return (
            f"{properties.get('hoodie.table.type')}, index {self.options['hoodie.index.type']}, merge mode "
            f"{properties.get('hoodie.record.merge.mode')}, metadata partitions "
            f"{properties.get('hoodie.table.metadata.partitions')}; timeline: {done}"
        )


class HudiMergeOnReadPeer(HudiPeer):
    """The merge-on-read table: updates go to log files beside the base files, merged by every snapshot read until a
    compaction rewrites them (inline, every 5 delta commits, as shipped; and compact() after the reads)."""

    table_type = "MERGE_ON_READ"

    def compact(self) -> None:
        """Schedule a compaction of every file group with log files and run it (Hudi's run_compaction procedure), so
        the read after it merges nothing. The trigger is set to one delta commit: at the shipped 5, a table whose
        inline compaction ran a batch or two ago would schedule nothing."""
        self.spark.sql(
            f"CALL run_compaction(op => 'scheduleAndExecute', path => '{self.path}', "
            "options => 'hoodie.compact.inline.max.delta.commits=1')"
        ).collect()
        left = sum(int(s["num_delta_files"]) for s in self._latest_slices())
        if left:
            print(f"hudi: {left} log files left after the compaction", file=sys.stderr)
