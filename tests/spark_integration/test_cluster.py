"""dbidx on a real Spark standalone cluster (one master, two workers of one core each), drivers in subprocesses.

What local mode cannot show (tests/cluster_harness.py says why): an executor JVM SIGKILLed mid-job, a speculative
copy of a stalled task winning on the other worker (Spark copies a task only to another host), shards whose tasks
move between executors and workers, where caches land inside a worker's Spark-managed directories, a second
application finding them warm, and dbidx shipped to executors as a packed virtualenv (`spark.archives`).

The expected table is computed here from the change stream alone (plain dicts: latest write wins, deletes remove);
only which key shard a key belongs to comes from dbidx (Spark's hash, `keyhash.spark_hash_one`), to know which
partitions each shard's task needed. Run with `pytest -m cluster` (docs/DEPLOY.md).
"""

from __future__ import annotations

import json
import random
import re
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

import pytest

from dbidx.storage.keyhash import spark_hash_one

from tests.cluster_harness import StandaloneCluster, WorkerNode, java_missing, run_driver

pytestmark = [pytest.mark.spark, pytest.mark.cluster]

APP = Path(__file__).parents[1] / "cluster_app.py"
REPO = Path(__file__).resolve().parents[2]
SHARDS = 4
CACHE_DIR = "dbidx-cache"  # cache.base_dir.default_base_path: <node's local dir>/dbidx-cache
SHARD_DIR = re.compile(r"^shard-\d{5}-of-\d{5}$")  # one RocksDB directory per (table, key shard)
SPARK_OWNED_PREFIXES = ("spark-", "executor-", "blockmgr-")
DRIVER_TIMEOUT_S = 240.0
KILL = (2, 1)  # (batch, shard) of application 1 whose first attempt's executor JVM is SIGKILLed
SPECULATE = (1, 2)  # (batch, shard) of application 1 whose first attempt stalls until a speculative copy wins

Row = list[Any]  # [id, dt, v, deleted]
Batch = list[Row]


# ---- the change stream and its oracle (no dbidx) -------------------------------------------------------------


def day(n: int) -> str:
    return f"2025-01-{n:02d}"


class StreamGenerator:
    """Seeded batches of inserts, updates, deletes (of live and of missing keys) and repeated keys over a few `dt`
    partitions. It tracks which records it believes live only to pick plausible updates and deletes; the expected
    table is computed separately, by `oracle`, from the batches alone."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.live: dict[str, set[str]] = defaultdict(set)  # dt -> ids
        self.next_id = 0
        self.batch_no = 0

    def new_id(self) -> str:
        # Now and then an id already used in another partition: in partitioned mode that is another record.
        if self.next_id and self.rng.random() < 0.1:
            return f"k{self.rng.randrange(self.next_id):05d}"
        self.next_id += 1
        return f"k{self.next_id - 1:05d}"

    def batch(self, days: list[str], rows: int) -> Batch:
        out: Batch = []
        value = self.batch_no * 100_000
        self.batch_no += 1
        before = {dt: sorted(self.live[dt]) for dt in days}  # updates and deletes pick records of earlier batches
        for i in range(rows):
            dt = self.rng.choice(days)
            roll = self.rng.random()
            if out and roll < 0.1:  # a record repeated in the batch: a later value, a delete, or back again
                key, dt = self.rng.choice(out)[:2]
                deleted = self.rng.random() < 0.3
            elif roll < 0.15:  # delete of a record that does not exist (nothing to do)
                key, deleted = f"missing{self.rng.randrange(10**6):06d}", True
            elif before[dt] and roll < 0.5:  # update
                key, deleted = self.rng.choice(before[dt]), False
            elif before[dt] and roll < 0.65:  # delete of a live record
                key, deleted = self.rng.choice(before[dt]), True
            else:  # insert
                key, deleted = self.new_id(), False
            out.append([key, dt, -1 if deleted else value + i, deleted])
            (self.live[dt].discard if deleted else self.live[dt].add)(key)
        return out


def oracle(batches: list[Batch]) -> dict[tuple[str, str], int]:
    """The expected table: (dt, id) -> v; rows apply in order (so the last row of a key in a batch wins)."""
    state: dict[tuple[str, str], int] = {}
    for batch in batches:
        for key, dt, value, deleted in batch:
            if deleted:
                state.pop((dt, key), None)
            else:
                state[(dt, key)] = value
    return state


def expected_counts(before: dict[tuple[str, str], int], batch: Batch) -> dict[str, int]:
    """What a batch's summary must count: per record its last row in the batch against the state before it."""
    last: dict[tuple[str, str], bool] = {}
    for key, dt, _value, deleted in batch:
        last[(dt, key)] = deleted
    counts = {
        "inserts": 0,
        "updates": 0,
        "deletes": 0,
        "deletes_missing": 0,
        "duplicates_dropped": len(batch) - len(last),
    }
    for ident, deleted in last.items():
        exists = ident in before
        counts[("deletes" if exists else "deletes_missing") if deleted else ("updates" if exists else "inserts")] += 1
    return counts


def shard_of(key: str) -> int:
    """Spark's pmod(hash(key), shards): the task (and so the cache) a key's row goes to."""
    return spark_hash_one(key) % SHARDS


def partitions_needed(batch: Batch) -> dict[int, set[str]]:
    """Shard -> the partitions its task looks up (and so loads into that node's cache if cold)."""
    needed: dict[int, set[str]] = defaultdict(set)
    for key, dt, _value, _deleted in batch:
        needed[shard_of(key)].add(dt)
    return needed


# ---- running applications --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneCluster]:
    """A master and two one-core workers, each with its own local and work dirs; always stopped."""
    if java_missing():
        pytest.skip(
            "the cluster tests need Java 17 to run a Spark master and workers: install "
            "openjdk-17-jre-headless or set JAVA_HOME"
        )
    node = StandaloneCluster(tmp_path_factory.mktemp("cluster"), num_workers=2)
    try:
        started = time.perf_counter()
        node.start()
        print(f"cluster up in {time.perf_counter() - started:.1f} s")
        yield node
    finally:
        node.stop()
        for worker in node.workers:  # unpacked envs (370 MB per executor); the executors' logs stay
            for unpacked in worker.work_dir.glob("app-*/*/env"):
                shutil.rmtree(unpacked, ignore_errors=True)


@pytest.fixture(scope="module")
def packed_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """dbidx and its runtime dependencies packed once per module (a fresh venv, pip installs, venv-pack)."""
    pytest.importorskip("venv_pack", reason="the packed-env test needs venv-pack (dbidx's dev extra)")
    from tools.pack_env import pack_env

    result = pack_env(tmp_path_factory.mktemp("pack") / "dbidx-env.tar.gz")
    print(f"packed env: {result.bytes / 2**20:.0f} MiB in {result.seconds:.1f} s {result.step_seconds}")
    return Path(result.path)


class App:
    """One driver application's inputs and outputs in a directory of its own."""

    def __init__(self, cluster: StandaloneCluster, root: Path, name: str, table: Path) -> None:
        self.cluster, self.name, self.table = cluster, name, table
        self.dir = root / name
        self.probe_dir = self.dir / "probes"
        self.probe_dir.mkdir(parents=True)
        self.out = self.dir / "out.json"
        self.result: dict[str, Any] = {}

    def run(
        self, batches: list[Batch], *extra: str, submit: list[str] | None = None, env: dict[str, str] | None = None
    ) -> dict[str, Any]:
        source = self.dir / "batches.json"
        source.write_text(json.dumps(batches))
        args = [
            "--master",
            self.cluster.url,
            "--table",
            str(self.table),
            "--batches",
            str(source),
            "--out",
            str(self.out),
            "--probe-dir",
            str(self.probe_dir),
            "--local-dir",
            str(self.dir / "driver-local"),
            *extra,
        ]
        started = time.perf_counter()
        done = run_driver(APP, args, env if env is not None else self.cluster.env(), DRIVER_TIMEOUT_S, submit=submit)
        seconds = time.perf_counter() - started
        print(f"{self.name}: {len(batches)} batches in {seconds:.1f} s (exit {done.returncode})")
        assert done.returncode == 0, (
            f"{self.name} failed with exit code {done.returncode}:\n{done.stdout[-6000:]}\n{self.cluster.log_tails()}"
        )
        self.result = json.loads(self.out.read_text())
        return self.result

    def probes(self) -> list[dict[str, Any]]:
        """Every task attempt that reached on_task_written: batch, shard, attempt, pid, local_dirs, cwd, python."""
        return [json.loads(p.read_text()) for p in sorted(self.probe_dir.glob("b*-s*-a*-p*.json"))]

    def worker_of(self, probe: dict[str, Any]) -> WorkerNode:
        return self.cluster.worker_of(probe["local_dirs"])


def table_rows(result: dict[str, Any]) -> dict[tuple[str, str], int]:
    """The application's read_table rows as (dt, id) -> v, failing on a record that appears twice."""
    rows: dict[tuple[str, str], int] = {}
    for key, dt, value in result["rows"]:
        assert (dt, key) not in rows, f"record ({dt}, {key}) is twice in the table"
        rows[(dt, key)] = value
    return rows


def assert_table_is(result: dict[str, Any], expected: dict[tuple[str, str], int]) -> None:
    """Exactly the oracle's records with the oracle's values: nothing lost, duplicated, stale or resurrected."""
    got = table_rows(result)
    lost = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    stale = sorted(k for k in set(got) & set(expected) if got[k] != expected[k])
    assert not (lost or extra or stale), (
        f"{len(lost)} lost (e.g. {lost[:5]}), {len(extra)} extra (e.g. {extra[:5]}), "
        f"{len(stale)} stale (e.g. {[(k, got[k], expected[k]) for k in stale[:5]]})"
    )


def assert_counts(summaries: list[dict[str, Any]], batches: list[Batch], history: list[Batch]) -> None:
    """Each batch's summary counts what the oracle says it did."""
    for n, (summary, batch) in enumerate(zip(summaries, batches)):
        want = expected_counts(oracle(history + batches[:n]), batch)
        got = {name: summary[name] for name in want}
        assert got == want, f"batch {n}: summary counts {got}, expected {want}"


def assert_spark_figures(
    summaries: list[dict[str, Any]], kill: tuple[int, int] | None = None, speculate: tuple[int, int] | None = None
) -> None:
    """Every batch's `spark` section is known and every winning attempt names its executor. The batch whose
    executor was killed (`kill`: batch, shard) counts that executor lost (with Spark's reason) and the killed
    attempt retried, and the killed shard's task took more than one attempt and won elsewhere; no other batch lost
    an executor. In the batch of `speculate`, Spark launched a speculative copy of the stalled task, the copy won,
    and the straggler was killed (or is being killed when the figures are read)."""
    for n, summary in enumerate(summaries):
        did = summary["spark"]
        assert did["unknown"] is None and did["task_attempts"] >= len(summary["per_shard"]), (n, did)
        assert all(m["executor"] is not None and m["attempts"] >= 1 for m in summary["per_shard"]), (n, summary)
        shards = {m["shard"]: m for m in summary["per_shard"]}
        if speculate is not None and n == speculate[0]:
            winner = shards[speculate[1]]
            assert did["speculative"] >= 1 and did["killed"] + did["running"] >= 1, did
            assert winner["speculative"] is True and winner["attempt_number"] >= 1, (winner, did)
            assert {
                "shard": speculate[1],
                "attempt_number": winner["attempt_number"],
                "executor": winner["executor"],
                "speculative": True,
            } in did["later_attempts"], did
        if kill is None or n != kill[0]:
            assert did["executors_lost"] == 0 and did["lost_executors"] == [], (n, did)
            continue
        assert did["executors_lost"] == 1 and did["retried"] >= 1, did
        (lost,) = did["lost_executors"]
        assert lost["executor"] != "driver" and lost["reason"], did
        winner = shards[kill[1]]
        assert winner["attempts"] >= 2 and winner["executor"] != lost["executor"], (winner, did)


# ---- the tests ---------------------------------------------------------------------------------------------------


def test_kill_an_executor_mid_job_then_a_second_application_finds_its_caches_warm(
    cluster: StandaloneCluster, tmp_path: Path
) -> None:
    started = time.perf_counter()
    gen = StreamGenerator(seed=20250101)
    # 1. Application 1: an initial load and five change batches over a moving set of partitions.
    first = [gen.batch([day(1), day(2), day(3)], 300)]
    first += [
        gen.batch(gen.rng.sample([day(1), day(2), day(3), day(4)], gen.rng.choice([2, 3])), 250) for _ in range(5)
    ]
    # 2. Application 2: partitions application 1 wrote, and one it never saw (day 5).
    second = [gen.batch([day(1), day(2), day(4), day(5)], 250), gen.batch([day(3), day(5)], 200)]
    table = tmp_path / "table"  # one path both "machines" see: the shared filesystem of a real cluster

    app1 = App(cluster, tmp_path, "app1", table)
    result1 = app1.run(
        first,
        "--create",
        str(SHARDS),
        "--kill",
        f"{KILL[0]}:{KILL[1]}",
        "--speculate",
        f"{SPECULATE[0]}:{SPECULATE[1]}",
    )
    # 3. The executor really died mid-job, after the task of KILL wrote its files and before it reported.
    marker = app1.probe_dir / "killed"
    assert marker.exists(), "the kill never happened (no task of the chosen batch and shard ran its hook)"
    killed = json.loads(marker.read_text())
    assert killed["executor_pid"] is not None, f"no executor JVM found above the Python worker: {killed}"
    assert (killed["record"]["batch"], killed["record"]["shard"]) == KILL
    # ... and dbidx still produced exactly the expected table, each batch counted right.
    assert len(result1["summaries"]) == len(first)
    assert_table_is(result1, oracle(first))
    assert_counts(result1["summaries"], first, [])
    # 4. The shard of the killed task ran again, on a live executor; shards ran on both workers.
    probes1 = app1.probes()
    killed_pid = killed["record"]["pid"]
    retried = [p for p in probes1 if (p["batch"], p["shard"]) == KILL and p["pid"] != killed_pid]
    assert retried, f"no other attempt of batch {KILL[0]} shard {KILL[1]} reached its hook: {probes1}"
    workers_of_shard: dict[int, set[str]] = defaultdict(set)
    for probe in probes1:
        workers_of_shard[probe["shard"]].add(app1.worker_of(probe).name)
    assert set().union(*workers_of_shard.values()) == {w.name for w in cluster.workers}, workers_of_shard
    moved = sorted(s for s, names in workers_of_shard.items() if len(names) > 1)
    assert moved, f"no shard ran on both workers: {dict(workers_of_shard)}"
    # 4b. In the batch of SPECULATE, Spark copied the stalled first attempt to the other worker (speculation is on
    #     in application 1), the copy won and the straggler was killed: the table above is exact all the same.
    stalled = [p for p in probes1 if (p["batch"], p["shard"]) == SPECULATE]
    assert sorted(p["attempt"] for p in stalled) == [0, 1], stalled
    assert len({app1.worker_of(p).name for p in stalled}) == 2, stalled
    # 4c. Each batch's summary says what Spark did (job_report.py): the batch of the kill lost that executor and
    #     retried the killed attempt, the shard's task took more than one attempt and won on another executor, and
    #     no other batch lost one; in the batch of SPECULATE a speculative copy was launched and won.
    assert_spark_figures(result1["summaries"], kill=KILL, speculate=SPECULATE)
    # 5. Caches are at the default location: <worker's SPARK_LOCAL_DIRS>/dbidx-cache, not in Spark's
    #    per-application or per-executor directories (which Spark deletes), and nowhere else.
    cached: dict[str, dict[int, set[str]]] = {w.name: defaultdict(set) for w in cluster.workers}
    # Every attempt that reached its hook had loaded its partitions and closed its cache; the table's first write
    # (the initial load) takes the bulk path and opens no cache, but stages its partitions beside the cache of the
    # worker it ran on, which the next open there installs (cache/staging.py): warm there too, when that shard's
    # load ran once (of two attempts, only the committed one's staging is installed, and which won is unknown here).
    load_attempts = defaultdict(list)
    for probe in probes1:
        if probe["batch"] == 0:
            load_attempts[probe["shard"]].append(probe)
    unsure = {shard for shard, attempts in load_attempts.items() if len(attempts) != 1}
    for probe in probes1:
        if probe["batch"] == 0 and probe["shard"] in unsure:
            continue
        cached[app1.worker_of(probe).name][probe["shard"]] |= partitions_needed(first[probe["batch"]])[probe["shard"]]
    table_dirs = set()
    for worker in cluster.workers:
        found = sorted(p.relative_to(worker.local_dir) for p in worker.local_dir.rglob(CACHE_DIR))
        assert found == [Path(CACHE_DIR)], f"{worker.name}: cache dirs at {found}, expected only ./{CACHE_DIR}"
        assert not any(part.startswith(SPARK_OWNED_PREFIXES) for p in found for part in p.parts)
        shard_dirs = sorted(d for d in (worker.local_dir / CACHE_DIR).glob("*/shard-*") if SHARD_DIR.match(d.name))
        table_dirs |= {d.parent.name for d in shard_dirs}
        have = {int(d.name.split("-")[1]) for d in shard_dirs}
        staged = {int(d.name.split("-")[1]) for d in (worker.local_dir / CACHE_DIR).glob("*/shard-*.staged")}
        # A shard whose tasks after the load ran here has its cache here; one whose only task here was the load
        # may have only its staging (installed by the next open of that cache here).
        opened = {p["shard"] for p in probes1 if p["batch"] != 0 and app1.worker_of(p).name == worker.name}
        assert opened <= have, f"{worker.name}: shards {sorted(opened)} opened caches here, caches of {sorted(have)}"
        ran_here = set(cached[worker.name])
        assert ran_here <= have | staged, (
            f"{worker.name}: shards {sorted(ran_here)} ran here, caches of {sorted(have)}, staging of {sorted(staged)}"
        )
    everywhere = set(cluster.root.rglob(CACHE_DIR))
    assert everywhere == {w.local_dir / CACHE_DIR for w in cluster.workers}, f"cache dirs: {sorted(everywhere)}"
    assert len(table_dirs) == 1, f"one table, one table directory per node: {table_dirs}"
    table_dir = table_dirs.pop()
    assert not (Path.home() / ".cache" / "dbidx" / table_dir).exists(), "a cache fell back to ~/.cache/dbidx"
    assert not list((app1.dir / "driver-local").rglob(CACHE_DIR)), "the driver opened a cache"

    # 6. Application 2 on the same cluster: the expected table again.
    app2 = App(cluster, tmp_path, "app2", table)
    result2 = app2.run(second)
    assert_table_is(result2, oracle(first + second))
    assert_spark_figures(result2["summaries"])
    assert_counts(result2["summaries"], second, first)
    # 7. Its first batch loaded on demand exactly the partitions the worker its shard ran on did not hold for
    #    that shard: none that application 1 had loaded there (warm across applications), and day 5 everywhere.
    per_shard = {m["shard"]: m for m in result2["summaries"][0]["per_shard"]}
    needed = partitions_needed(second[0])
    probes2 = [p for p in app2.probes() if p["batch"] == 0]
    checked, warm = [], 0
    for shard in range(SHARDS):
        where = {app2.worker_of(p).name for p in probes2 if p["shard"] == shard}
        attempts = [p for p in probes2 if p["shard"] == shard]
        if len(attempts) != 1 or shard in unsure:  # a retried attempt: which one's metrics (or staging) won is
            continue  # not known here
        (name,) = where
        cold = needed[shard] - cached[name][shard]
        warm += len(needed[shard] & cached[name][shard])
        got = per_shard[shard]["on_demand_loads"]
        assert got == len(cold), (
            f"app2 batch 0 shard {shard} on {name}: {got} on-demand loads, expected "
            f"{len(cold)} ({sorted(cold)} not loaded there by app1; needed "
            f"{sorted(needed[shard])}, cached {sorted(cached[name][shard])})"
        )
        checked.append(shard)
    assert len(checked) >= SHARDS - 1, f"only shards {checked} ran once in app2's first batch"
    assert warm > 0, "no partition of app2's first batch was warm on the worker its shard ran on: nothing checked"
    print(
        f"cluster scenario: {time.perf_counter() - started:.1f} s; app2 batch 0: {warm} warm partition loads "
        f"avoided, on-demand loads {[per_shard[s]['on_demand_loads'] for s in range(SHARDS)]}"
    )


@pytest.mark.slow
@pytest.mark.packing
def test_packed_env_ships_dbidx_to_the_executors(cluster: StandaloneCluster, packed_env: Path, tmp_path: Path) -> None:
    gen = StreamGenerator(seed=7)
    batches = [gen.batch([day(1), day(2)], 200), gen.batch([day(1), day(2), day(3)], 150)]
    table = tmp_path / "table"
    # 1. spark-submit as docs/DEPLOY.md has it: the archive unpacked as ./env in each executor's working directory,
    #    executors run ./env/bin/python, the driver keeps this interpreter (dbidx is installed in it).
    env = cluster.env()
    env.pop("PYSPARK_PYTHON")
    submit = [
        "--master",
        cluster.url,
        "--archives",
        f"{packed_env}#env",
        "--conf",
        "spark.pyspark.python=./env/bin/python",
        "--conf",
        f"spark.pyspark.driver.python={sys.executable}",
    ]
    app1 = App(cluster, tmp_path, "submitted", table)
    assert_table_is(app1.run(batches[:1], "--create", str(SHARDS), submit=submit, env=env), oracle(batches[:1]))
    # 2. The SparkSession.builder form: spark.archives in the builder, PYSPARK_PYTHON in the driver's environment.
    app2 = App(cluster, tmp_path, "builder", table)
    assert_table_is(
        app2.run(batches[1:], "--archive", f"{packed_env}#env", env=cluster.env(PYSPARK_PYTHON="./env/bin/python")),
        oracle(batches),
    )
    # 3. Every task ran the unpacked env's interpreter, with dbidx imported from it, in an executor's work dir.
    for app in (app1, app2):
        probes = app.probes()
        assert probes
        for probe in probes:
            worker = app.worker_of(probe)
            python, module = Path(probe["python"]), Path(probe["dbidx"])
            assert "/env/bin/python" in str(python) and python.is_relative_to(worker.work_dir), probe
            env_root = python.parent.parent
            assert module.is_relative_to(env_root / "lib") and "site-packages" in module.parts, probe
            assert Path(probe["cwd"]).is_relative_to(worker.work_dir), probe
            assert env_root.parent == Path(probe["cwd"]), probe
            assert not module.is_relative_to(REPO), f"dbidx came from the repository, not the env: {probe}"
