"""Shared benchmark plumbing: the machine line, medians, markdown tables, and RESULTS.md sections.

Each benchmark script owns one section of benchmarks/RESULTS.md, delimited by HTML comments, and rewrites only
that section (`--write-results`), so the figures in the file always come from a run, never from typing.
"""

from __future__ import annotations

import os
import platform
import re
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def machine() -> str:
    """One line naming the machine and the versions that matter."""
    import pyarrow

    mem_gb = 0.0
    try:
        with open("/proc/meminfo") as fh:
            mem_gb = int(fh.readline().split()[1]) / (1 << 20)
    except OSError:
        pass
    rd_version = _dist_version("rocksdict")
    return (
        f"{os.cpu_count()} cores, {mem_gb:.0f} GB RAM, {platform.system()} {platform.machine()}; "
        f"Python {platform.python_version()}, pyarrow {pyarrow.__version__}, rocksdict {rd_version}"
    )


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "?"


def command() -> str:
    """The command line that produced the figures."""
    return "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])


def median_time(fn: Callable[[], Any], repeats: int, setup: Callable[[], Any] | None = None) -> tuple[float, Any]:
    """Median wall seconds of fn() over `repeats` runs (setup() runs untimed before each), and the last result."""
    times, result = [], None
    for _ in range(max(1, repeats)):
        if setup is not None:
            setup()
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A markdown table."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
        if isinstance(v, int):
            return f"{v:,}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def dir_bytes(path: Path, pattern: str = "*") -> int:
    """Total size of the files under a directory matching a glob pattern."""
    return sum(f.stat().st_size for f in Path(path).rglob(pattern) if f.is_file())


def status_bytes(field: str, pid: int | str = "self") -> int:
    """A memory figure of a process from Linux's /proc/<pid>/status (VmRSS: resident now, VmHWM: peak), in bytes."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def seconds_of(fn: Callable[[], Any]) -> float:
    """Wall seconds of one call of fn()."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rli_paths(table: Any) -> list[str]:
    """Every RLI file a table's completions list, as filesystem paths (a Spark join's input)."""
    table.refresh()
    return [table.io.path(f.path) for rec in table.timeline.completed() for f in rec.files]


def rss_bytes() -> int:
    """Resident set size of this process."""
    return status_bytes("VmRSS")


def reset_peak_rss(pid: int | str = "self") -> None:
    """Reset a process's peak RSS (VmHWM: write 5 to /proc/<pid>/clear_refs), so the next reading covers only what
    follows (OSError where the kernel does not allow it)."""
    with open(f"/proc/{pid}/clear_refs", "w") as fh:
        fh.write("5")


def write_figures(name: str, figures: dict[str, Any]) -> None:
    """Key figures of a run as benchmarks/results/<name>.json, the input of projection.py (never typed by hand)."""
    import json

    out = RESULTS.parent / "results" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "command": command(), **figures}, indent=1, default=str))


def write_section(name: str, body: str, target: Path = RESULTS) -> None:
    """Replace (or append) the section `name` of RESULTS.md (or another markdown file) with body."""
    start, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    text = (
        target.read_text()
        if target.exists()
        else "# Benchmark results\n\nEvery figure below is written by "
        "the benchmark script named in its section (`--write-results`); none is typed by hand.\n"
    )
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _m: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    target.write_text(text)


def publish(name: str, body: str, figures: dict[str, Any]) -> str:
    """Save a run's figures, draw its charts from them, and write its RESULTS.md section (body + chart links).

    The order matters: the charts are drawn from the saved JSON, so RESULTS.md links only what was drawn from
    this run. Returns the section as written (for printing).
    """
    import charts  # beside this module; imported here so the benchmarks' start-up does not pay for it

    write_figures(name, figures)
    body = "\n\n".join([body, charts.links(charts.draw(name))])
    write_section(name, body)
    return body


CACHE_HELP = "cache settings, e.g. 'compression=lz4,block.cache.mb=512' (docs/CONFIG.md names)"


def cache_settings(parser: Any, value: str) -> dict[str, str]:
    """A `--cache name=value,...` option as a mapping for CacheConfig.from_sources; a malformed or unknown setting is
    a usage error (parser.error) before anything runs."""
    from dbidx.config import CacheConfig
    from dbidx.errors import ConfigError

    pairs = [item.split("=", 1) for item in value.split(",") if item]
    if any(len(pair) != 2 for pair in pairs):
        parser.error(f"--cache {value!r}: each setting is name=value, settings separated by commas")
    try:
        CacheConfig.from_sources(dict(pairs))
    except ConfigError as exc:
        parser.error(f"--cache {value!r}: {exc}")
    return dict(pairs)


def spark_session(
    local_dir: Path, shards: int, app: str, delta: bool = False, extra: dict[str, str] | None = None
) -> Any:
    """The benchmarks' local[2] SparkSession: no UI, `shards` shuffle partitions, a 4 GB driver, Arrow on; with
    `delta`, Delta Lake on Spark loaded (its jars from the cache the tests fill: delta_spark.default_ivy_dir) and new
    Delta tables created with deletion vectors on, as Delta Spark users run it; `extra` settings on top (a system on a
    Spark of its own, e.g. Hudi's jars and extension in peer_bench.py, gets the same session otherwise)."""
    import os
    import sys

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder = SparkSession.builder
    if delta:
        from dbidx.spark_integration.delta_spark import default_ivy_dir, delta_spark_conf

        settings = {
            "spark.databricks.delta.properties.defaults.enableDeletionVectors": "true",
            # Delta's log replay runs in 50 tasks by default: on local[2] a Delta engineer sizes it to the cores.
            "spark.databricks.delta.snapshotPartitions": str(max(2, shards)),
        }
        conf = delta_spark_conf(default_ivy_dir(), settings)
        for key, value in conf.items():
            builder = builder.config(key, value)
    for key, value in (extra or {}).items():
        builder = builder.config(key, value)
    spark = (
        builder.master("local[2]")
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", str(shards))
        .config("spark.driver.memory", "4g")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.local.dir", str(local_dir))
        .config("spark.sql.warehouse.dir", str(local_dir / "warehouse"))  # not ./spark-warehouse (Delta's catalog)
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


class CachedFrames:
    """A peer fed with a cached Spark DataFrame of the benchmark's input (`self.spark` set by the subclass): what
    every Spark system shares, on the project's Spark (peer_bench.py) or one of its own (hudi_peer.py)."""

    spark: Any

    def prepare(self, path: str) -> Any:
        frame = self.spark.read.parquet(path).cache()
        frame.count()
        return frame

    def release(self, data: Any) -> None:
        data.unpersist()

    def close(self) -> None:
        self.spark.stop()


def tree_processes(pid: int) -> list[Any] | None:
    """psutil Process objects of a process and its descendants ([] if it is gone); None without psutil."""
    try:
        import psutil
    except ImportError:
        return None
    try:
        root = psutil.Process(pid)
        return [root] + root.children(recursive=True)
    except psutil.Error:
        return []


def tree_rss_each(pid: int) -> list[int]:
    """Resident bytes of a process and of each of its descendants (psutil if installed, else /proc); [] if the
    process is gone."""
    procs = tree_processes(pid)
    if procs is None:
        return _proc_tree_rss_each(pid)
    import psutil  # tree_processes found it

    sizes = []
    for proc in procs:
        try:
            sizes.append(proc.memory_info().rss)
        except psutil.Error:
            pass
    return sizes


def _proc_tree_rss_each(pid: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError, IndexError):
            continue
    tree, frontier = {pid}, [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier and child not in tree]
        tree.update(children)
        frontier = children
    sizes = []
    for member in tree:
        try:
            sizes.append(int(Path(f"/proc/{member}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
        except (OSError, ValueError, IndexError):
            pass
    return sizes


class TreeRss:
    """Peak resident bytes of a process and all its descendants (the Spark JVM, its Python workers, loader
    processes), sampled by a thread while a `with` block runs: the largest single process and the largest sum."""

    def __init__(self, pid: int | None = None, interval: float = 0.2) -> None:
        self.pid = os.getpid() if pid is None else pid
        self.interval = interval
        self.largest = self.total = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-tree-rss", daemon=True)

    def _sample(self) -> None:
        sizes = tree_rss_each(self.pid) or [0]
        self.largest, self.total = max(self.largest, max(sizes)), max(self.total, sum(sizes))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> "TreeRss":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *_exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
