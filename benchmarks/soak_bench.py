"""Soak benchmark (issue 44 item 4): a long run of upserts through Spark, and whether the table stays healthy.

What is measured, in one run (Spark local[2], `--shards` key shards, `upsert` of every batch as a cached DataFrame):
  Per batch: upsert seconds (wall, the `upsert` call less its services), service seconds (the upsert summary's
  `services` section, when the table services exist; else 0) and their split per service (each run's `seconds`; the rest
  of the run, its triggers and steps that found nothing to do, as "(rest)"), live data files (the table's data view),
  files on disk and table bytes (a walk of the table dir: data, deletion vectors, Delta log, index, timeline), index
  files (files under `.dbidx/rli/`), cache bytes (a walk of the executor-local cache base dir).
  Every `--read-every` batches (and after the last): a full read of every column into Arrow by dbidx
  (`reads.read_arrow`), polars (`pl.read_delta`) and delta-rs (`QueryBuilder` `select *`: `to_pyarrow_table()`
  refuses deletion vectors), each best of 2, each checked against the row count the generator expects; and the
  anchor: the same live rows written once by `deltalake.write_deltalake` (partitioned by dt) into a scratch dir and
  read by delta-rs (the faster of `QueryBuilder` and `to_pyarrow_table()`, best of 2 each).
Goals (issue 44), checked in the goals table, never by a timed test; a goal the run cannot measure is "not
measured", never "yes":
  - live data files bounded: the most live files in the last `--read-every` batches <= 1.1x the most in batches
    R..2R (R = `--read-every`, past the first compaction cycle); needs more than 2R batches;
  - full reads within 1.5x of the anchor at every checkpoint (dbidx, polars, delta-rs: the worst checkpoint);
  - upsert + service seconds of the last R batches <= 1.2x batches R..2R; needs more than 2R batches;
  - bytes on disk <= 2x the live data (bytes of the live data files) at the end, after the retention period (with
    services off nothing is ever removed, so this is reported as measured at the end).
At the end the table is read back and checked: rows == distinct keys, sum(ver) == the generator's; a mismatch is
reported and the script exits non-zero.
Services: `--services on` runs the automatic table services (issue 44 items 1-2) after each publish; while they
have not landed in dbidx, `on` stops with a message saying so and `off` is dbidx's behaviour today (nothing runs
by itself).
Data: peer_bench.generate (speed_bench.dataset: reused from `--work` when it holds a data set of the same size):
`--keys` UUID keys over 30 daily partitions `dt`, then `--batches` batches of `--batch` rows (80% updates of the last
7 days, 5% late updates, 15% new keys), `ver` = batch number: the speed benchmarks' change mix.
Run: `python benchmarks/soak_bench.py [--keys 1000000] [--batches 1000] [--batch 10000] [--shards 2]
[--read-every 100] [--services on|off] [--work DIR] [--write-results] [--smoke]`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report
import speed_bench

from dbidx.config import CacheConfig
from dbidx.data import reads
from dbidx.table.facade import Table

KEY, PARTITION = "id", "dt"
READS = 2  # timed full reads per reader per checkpoint (the best is kept)
FILES_GOAL, READ_GOAL, TIME_GOAL, BYTES_GOAL = 1.1, 1.5, 1.2, 2.0
HEADERS = ["figure", "value", "goal", "met"]
ISSUE_SIZES = ((1_000_000, 1_000, 10_000), (10_000_000, 200, 100_000))  # (keys, batches, rows per batch)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------------
# The table services.


def set_services(table: Table, mode: str, retention: str | None) -> str:
    """Turn the table's services on or off (`after_commit`: they run inside `upsert` after its publish) and, with
    `retention`, set the table's Delta log and removed-file retention to it; returns how, for the section's text."""
    settings = table.configure_services(after_commit=mode == "on")
    changed = ", ".join(f"{k}={v}" for k, v in settings.changed().items()) or "the defaults"
    if retention:
        table.set_delta_properties(
            {"delta.logRetentionDuration": retention, "delta.deletedFileRetentionDuration": retention}
        )
    properties = f"; Delta table properties: {table.delta_properties()}"
    if mode == "off":
        return f"off (`Table.configure_services(after_commit=False)`; settings: {changed}{properties})"
    return f"on, run by `upsert` after each publish (settings: {changed}; all: {settings.to_dict()}{properties})"


def areas(root: Path) -> dict[str, int]:
    """Bytes under the table by area: data files (and anything else outside the two metadata folders), the Delta
    log, and dbidx's index, timeline and deletion-vector folders."""
    out: dict[str, int] = {}
    for dirpath, _dirs, names in os.walk(root):
        rel = os.path.relpath(dirpath, root).split(os.sep)
        area = (
            "_delta_log"
            if rel[0] == "_delta_log"
            else (
                f".dbidx/{rel[1]}"
                if rel[0] == ".dbidx" and len(rel) > 1
                else ".dbidx"
                if rel[0] == ".dbidx"
                else "data"
            )
        )
        for name in names:
            try:
                out[area] = out.get(area, 0) + os.stat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                continue
    return dict(sorted(out.items()))


REST = "(rest)"  # a run's seconds outside the services it lists: triggers, and steps that found nothing to do


def services_of(summary: dict[str, Any]) -> tuple[float, list[str], dict[str, float], str | None]:
    """From an upsert summary's `services` section (None without services): the seconds they took inside the
    upsert, the services that ran, the seconds per service (a service that ran twice, e.g. two rounds of data
    compaction, summed; REST: the run's seconds outside them, its triggers and the steps that did nothing, which
    the report does not list), and the error they ended with (never a failed upsert). Why per service: the time
    goal is missed when the services' share grows, and only their split says which one grows."""
    section = summary.get("services")
    if not isinstance(section, dict):
        return 0.0, [], {}, None
    total = float(section.get("seconds") or 0.0)
    runs = [r for r in section.get("ran", []) if isinstance(r, dict)]
    seconds: dict[str, float] = {}
    for r in runs:
        seconds[str(r.get("service"))] = seconds.get(str(r.get("service")), 0.0) + float(r.get("seconds") or 0.0)
    if section.get("seconds") is not None:
        seconds[REST] = max(0.0, total - sum(seconds.values()))
    return total, [str(r.get("service")) for r in runs], seconds, section.get("error")


# ---------------------------------------------------------------------------------------------------------------
# What is measured per batch and at the checkpoints.


def walk(root: Path) -> tuple[int, int, int]:
    """(files, bytes, index files) under a directory; index files: those under .dbidx/rli/."""
    files = size = index = 0
    rli = os.path.join(str(root), ".dbidx", "rli")
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            try:
                size += os.stat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:  # removed by a clean while we walked
                continue
            files += 1
            if dirpath.startswith(rli):
                index += 1
    return files, size, index


def live(table: Table) -> tuple[int, int]:
    """(live data files, their bytes) of the table's current state."""
    with table.held_data_view() as view:
        files = view.live()
        return len(files), sum(f.record.size for f in files)


@dataclass
class Batch:
    number: int
    upsert_s: float  # the upsert call without its services
    service_s: float
    live_files: int
    live_bytes: int
    disk_files: int
    table_bytes: int
    index_files: int
    cache_bytes: int
    services_ran: list[str] = field(default_factory=list)
    service_error: str | None = None
    load_1m: float = 0.0  # the machine's 1-minute load average after the batch (other work on the machine shows)
    service_seconds: dict[str, float] = field(default_factory=dict)  # per service (services_of), REST included


@dataclass
class Checkpoint:
    batch: int
    rows: int
    dbidx_s: float
    polars_s: float
    deltars_s: float
    anchor_s: float
    anchor_how: str
    anchor_bytes: int

    def ratio(self, name: str) -> float:
        return getattr(self, f"{name}_s") / self.anchor_s


def best(fn: Any, repeats: int = READS) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def checkpoint(table: Table, number: int, expected: int, scratch: Path) -> Checkpoint:
    """Full reads of the table by dbidx, polars and delta-rs, and delta-rs's read of the same rows written once."""
    import deltalake
    import polars as pl
    from deltalake import DeltaTable, QueryBuilder

    uri = table.io.path("")

    def via_deltars(path: str) -> Any:
        return pa.table(QueryBuilder().register("t", DeltaTable(path)).execute("select * from t").read_all())

    dbidx_s, data = best(lambda: reads.read_arrow(table))
    polars_s, frame = best(lambda: pl.read_delta(uri))
    deltars_s, other = best(lambda: via_deltars(uri))
    ours = (data.num_rows, int(pc.sum(data.column("ver")).as_py() or 0))
    for who, got in (("polars", frame.to_arrow()), ("delta-rs", other)):
        theirs = (got.num_rows, int(pc.sum(got.column("ver")).as_py() or 0))
        if theirs != ours:
            raise SystemExit(f"batch {number}: {who} reads (rows, sum of ver) = {theirs}, dbidx {ours}")
    if ours[0] != expected:
        raise SystemExit(f"batch {number}: dbidx reads {ours[0]:,} rows, the generator has {expected:,} keys")
    shutil.rmtree(scratch, ignore_errors=True)
    deltalake.write_deltalake(str(scratch), data, partition_by=[PARTITION])
    del data, frame, other
    query_s, _ = best(lambda: via_deltars(str(scratch)))
    table_s, _ = best(lambda: DeltaTable(str(scratch)).to_pyarrow_table())
    anchor_s, how = min((query_s, "QueryBuilder"), (table_s, "to_pyarrow_table"))
    anchor_bytes = walk(scratch)[1]
    shutil.rmtree(scratch, ignore_errors=True)
    return Checkpoint(number, ours[0], dbidx_s, polars_s, deltars_s, anchor_s, how, anchor_bytes)


@dataclass
class Run:
    load_s: float
    services: str
    batches: list[Batch] = field(default_factory=list)
    checkpoints: list[Checkpoint] = field(default_factory=list)
    counts: tuple[int, int] = (0, 0)
    areas: dict[str, int] = field(default_factory=dict)  # bytes by area of the table dir at the end


def soak(spark: Any, work: Path, manifest: dict[str, Any], args: argparse.Namespace) -> Run:
    root, caches = work / "soak-table", work / "soak-cache"
    table = Table.open_or_create(str(root), num_shards=args.shards)
    services = set_services(table, args.services, args.retention)
    config = CacheConfig.from_sources({"base_path": str(caches)})

    def upsert(df: Any) -> dict[str, Any]:
        from dbidx.spark_integration.api import upsert as spark_upsert

        return spark_upsert(df, table, key=KEY, partition=PARTITION, cache_config=config).to_dict()

    load, load_rows = speed_bench.cached(spark, manifest["load"])
    start = time.perf_counter()
    upsert(load)
    run = Run(time.perf_counter() - start, services)
    load.unpersist()
    log(f"initial load of {load_rows:,} rows: {run.load_s:.2f} s; services {services}")
    for number, path in enumerate(manifest["batches"], start=1):
        df, _rows = speed_bench.cached(spark, path)
        start = time.perf_counter()
        summary = upsert(df)
        wall_s = time.perf_counter() - start
        df.unpersist()
        service_s, ran, per_service, error = services_of(summary)
        if error:
            log(f"batch {number}: the services failed (the upsert is committed): {error}")
        live_files, live_bytes = live(table)
        disk_files, table_bytes, index_files = walk(root)
        run.batches.append(
            Batch(
                number,
                wall_s - service_s,
                service_s,
                live_files,
                live_bytes,
                disk_files,
                table_bytes,
                index_files,
                walk(caches)[1],
                ran,
                error,
                os.getloadavg()[0],
                per_service,
            )
        )
        if number % 10 == 0 or number == 1:
            b = run.batches[-1]
            log(
                f"batch {number}: upsert {b.upsert_s:.2f} s, services {b.service_s:.2f} s, {b.live_files:,} live "
                f"files, {b.disk_files:,} on disk, {b.table_bytes / 2**20:.1f} MiB"
            )
        if number % args.read_every == 0 or number == len(manifest["batches"]):
            expected = speed_bench.expected_rows(args.keys, number, args.batch)
            run.checkpoints.append(checkpoint(table, number, expected, work / "soak-anchor"))
            c = run.checkpoints[-1]
            log(
                f"reads at batch {number}: dbidx {c.dbidx_s:.2f} s, polars {c.polars_s:.2f} s, delta-rs "
                f"{c.deltars_s:.2f} s; anchor {c.anchor_s:.2f} s ({c.anchor_how})"
            )
    run.areas = areas(root)
    log("bytes by area at the end: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in run.areas.items()))
    data = reads.read_arrow(table, columns=["ver"])
    run.counts = (data.num_rows, int(pc.sum(data.column("ver")).as_py() or 0))
    return run


# ---------------------------------------------------------------------------------------------------------------
# The goals table, the section and the figures.


def window(run: Run, first: int, last: int) -> list[Batch]:
    return [b for b in run.batches if first < b.number <= last]


def goal_rows(run: Run, args: argparse.Namespace) -> list[list[Any]]:
    r, n = args.read_every, len(run.batches)
    enough = n > 2 * r
    why = f"not measured (needs more than {2 * r} batches)"
    rows: list[list[Any]] = []
    if enough:
        early, late = window(run, r, 2 * r), window(run, n - r, n)
        most_early, most_late = max(b.live_files for b in early), max(b.live_files for b in late)
        ratio = most_late / most_early
        rows.append(
            [
                f"live data files: most in batches {n - r + 1}-{n} vs most in batches {r + 1}-{2 * r}",
                f"{most_late:,} vs {most_early:,} = {ratio:.2f}x",
                f"<= {FILES_GOAL}x (bounded)",
                "yes" if ratio <= FILES_GOAL else "NO",
            ]
        )
        t_early = sum(b.upsert_s + b.service_s for b in early)
        t_late = sum(b.upsert_s + b.service_s for b in late)
        s_early, s_late = sum(b.service_s for b in early), sum(b.service_s for b in late)
        ratio = t_late / t_early
        rows.append(
            [
                f"upsert + service s: batches {n - r + 1}-{n} vs batches {r + 1}-{2 * r}",
                f"{t_late:.1f} s vs {t_early:.1f} s = {ratio:.2f}x (services {s_late:.1f} s = "
                f"{share(s_late, t_late)} vs {s_early:.1f} s = {share(s_early, t_early)})",
                f"<= {TIME_GOAL}x",
                "yes" if ratio <= TIME_GOAL else "NO",
            ]
        )
    else:
        rows.append(["live data files bounded", why, f"<= {FILES_GOAL}x", "-"])
        rows.append(["upsert + service s, last window vs the second", why, f"<= {TIME_GOAL}x", "-"])
    for name, label in (
        ("dbidx", "dbidx read_arrow"),
        ("polars", "polars read_delta"),
        ("deltars", "delta-rs QueryBuilder"),
    ):
        worst = max(run.checkpoints, key=lambda c: c.ratio(name))
        rows.append(
            [
                f"full read, {label} vs delta-rs on the rows written once: worst of {len(run.checkpoints)} checkpoints",
                f"{worst.ratio(name):.2f}x (batch {worst.batch}: {getattr(worst, name + '_s'):.2f}"
                f" s vs {worst.anchor_s:.2f} s)",
                f"<= {READ_GOAL}x",
                "yes" if worst.ratio(name) <= READ_GOAL else "NO",
            ]
        )
    last = run.batches[-1]
    ratio = last.table_bytes / last.live_bytes
    retention = (
        "after the retention period"
        if args.services == "on"
        else "services off: nothing is ever removed, measured at the end"
    )
    rows.append(
        [
            f"bytes on disk vs live data bytes at batch {last.number} ({retention})",
            f"{last.table_bytes / 2**20:,.1f} MiB vs {last.live_bytes / 2**20:,.1f} MiB = {ratio:.2f}x",
            f"<= {BYTES_GOAL}x",
            "yes" if ratio <= BYTES_GOAL else "NO",
        ]
    )
    return rows


def share(part: float, whole: float) -> str:
    return f"{part / whole:.0%}" if whole > 0 else "-"


def service_rows(run: Run, size: int) -> list[list[Any]]:
    """Seconds per service per window of `size` batches (sum, runs, mean per run, max in one batch; REST: per
    batch), then all services per window with their share of upsert + service s: which service's runs grow, and
    whether they run more often or take longer each time."""
    windows = [run.batches[i : i + size] for i in range(0, len(run.batches), size)]
    names = sorted({name for b in run.batches for name in b.service_seconds}, key=lambda n: (n == REST, n))
    rows: list[list[Any]] = []
    for name in names:
        for w in windows:
            values = [b.service_seconds[name] for b in w if name in b.service_seconds]  # per batch, runs summed
            runs = sum(b.services_ran.count(name) for b in w) if name != REST else len(values)
            rows.append(
                [
                    name,
                    f"{w[0].number}-{w[-1].number}",
                    sum(values),
                    runs,
                    sum(values) / runs if runs else 0.0,
                    max(values, default=0.0),
                    "",
                ]
            )
    for w in windows:
        services = sum(b.service_s for b in w)
        rows.append(
            [
                "all services",
                f"{w[0].number}-{w[-1].number}",
                services,
                len(w),
                services / len(w),
                max((b.service_s for b in w), default=0.0),
                share(services, sum(b.upsert_s + b.service_s for b in w)),
            ]
        )
    return rows


def sample_rows(run: Run, every: int) -> list[list[Any]]:
    """Batch 1, every `every` batches and the last."""
    picked = [b for b in run.batches if b.number == 1 or b.number % every == 0 or b.number == len(run.batches)]
    return [
        [
            b.number,
            b.upsert_s,
            b.service_s,
            b.live_files,
            b.disk_files,
            b.table_bytes / 2**20,
            b.live_bytes / 2**20,
            b.index_files,
            b.cache_bytes / 2**20,
        ]
        for b in picked
    ]


def read_rows(run: Run) -> list[list[Any]]:
    return [
        [
            c.batch,
            c.rows,
            c.dbidx_s,
            c.polars_s,
            c.deltars_s,
            f"{c.anchor_s:.3f} ({c.anchor_how})",
            f"{c.ratio('dbidx'):.2f}x",
            f"{c.ratio('polars'):.2f}x",
            f"{c.ratio('deltars'):.2f}x",
            c.anchor_bytes / 2**20,
        ]
        for c in run.checkpoints
    ]


def check_line(run: Run, manifest: dict[str, Any]) -> tuple[str, bool]:
    rows, sum_ver = run.counts
    ok = (rows, sum_ver) == (manifest["rows"], manifest["sum_ver"])
    return (
        f"Check (the table read back with `reads.read_arrow`): {rows:,} rows, sum(ver) {sum_ver:,}; expected "
        f"{manifest['rows']:,} distinct keys, sum(ver) {manifest['sum_ver']:,}: " + ("check ok." if ok else "MISMATCH.")
    ), ok


def code_version() -> str:
    """Which dbidx the run measured: the commit, and whether the checkout had changes not committed (other work in
    progress in the same checkout is measured with it)."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=30
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return "Code: not a git checkout."
    changed = sorted(line[3:] for line in dirty if line.strip())
    if not head:
        return "Code: not a git checkout."
    if not changed:
        return f"Code: dbidx at commit {head}."
    return (
        f"Code: dbidx at commit {head} with changes not committed yet in {len(changed)} files of the checkout "
        f"({', '.join(changed[:8])}{', ...' if len(changed) > 8 else ''}): the run measured them too."
    )


def render(args: argparse.Namespace, origin: str, run: Run, check: str, code: str) -> str:
    mean = sum(b.upsert_s + b.service_s for b in run.batches) / len(run.batches)
    loads = sorted(b.load_1m for b in run.batches)
    ran: dict[str, int] = {}
    for b in run.batches:
        for service in b.services_ran:
            ran[service] = ran.get(service, 0) + 1
    errors = sum(1 for b in run.batches if b.service_error)
    services_did = (
        (
            "; service runs: "
            + (", ".join(f"{k} {v:,}" for k, v in sorted(ran.items())) or "none")
            + f", failed {errors:,}"
        )
        if args.services == "on"
        else ""
    )
    every = max(1, args.read_every // 4)
    notes = [code]
    if not any(
        args.keys >= keys and args.batches >= batches and args.batch >= batch for keys, batches, batch in ISSUE_SIZES
    ):
        notes.append(
            "This run is smaller than the issue's soak (1,000 batches of 10,000 rows on 1,000,000 keys, and "
            "200 batches of 100,000 rows on 10,000,000 keys, services on: `make bench-soak`); its figures "
            "do not stand in for those runs."
        )
    if args.services == "off":
        notes.append(
            "Services off: the baseline, what a pipeline gets when nothing maintains the table. The goals "
            "are those of the table services (issue 44); this run shows what they have to fix."
        )
    per_service = (
        [
            f"Service seconds per {args.read_every} batches (the upsert summaries' `services`: each run's `seconds` "
            f"summed per service; {REST}: the rest of each services run, its triggers and the steps that found nothing "
            "to do; mean: per run (all services: per batch); max: the most in one batch; share: of upsert + service s):",
            _report.table(
                ["service", "batches", "sum s", "runs", "mean s", "max s", "share"], service_rows(run, args.read_every)
            ),
        ]
        if args.services == "on"
        else []
    )
    return "\n\n".join(
        [
            f"## Soak: {args.batches:,} batches of {args.batch:,} rows on {args.keys:,} keys, services {args.services}"
            + (f", retention {args.retention}" if args.retention else ""),
            f"Machine: {_report.machine()}. Command: `{_report.command()}`. Spark local[2], {args.shards} key shards. "
            f"{args.keys:,} UUID keys over 30 daily partitions loaded at once ({run.load_s:.1f} s, the bulk path), then "
            f"{args.batches:,} change batches of {args.batch:,} rows through `upsert` (80% updates of the last 7 days, "
            f"5% late updates, 15% new keys; data {origin}), each a cached DataFrame. Services: {run.services}. "
            f"Upsert s: the `upsert` call less its services; service s: its summary's `services` section (0 without "
            f"services). "
            f"Live data files: the table's data view; files on disk and table MiB: every file under the table dir "
            f"(data, deletion vectors, Delta log, index, timeline); index files: those under `.dbidx/rli/`; cache "
            f"MiB: the executor-local caches. Mean upsert + service s per batch: {mean:.3f}{services_did}. The "
            f"machine's 1-minute load average after each batch: median {loads[len(loads) // 2]:.1f}, max {loads[-1]:.1f} "
            f"({os.cpu_count()} cores; above that, other work shared the machine and the seconds are inflated).",
            *notes,
            _report.table(HEADERS, goal_rows(run, args)),
            check,
            f"Full reads every {args.read_every} batches (every column into Arrow, best of {READS}, each checked "
            "against the generator's row count; polars and delta-rs also against dbidx's sum of ver): dbidx "
            "`reads.read_arrow`, polars `read_delta`, delta-rs `QueryBuilder` `select *` of dbidx's table; anchor: "
            "the same rows written once by `write_deltalake` partitioned by dt, read by delta-rs (the faster of "
            "`QueryBuilder` and `to_pyarrow_table`):",
            _report.table(
                [
                    "batch",
                    "rows",
                    "dbidx s",
                    "polars s",
                    "delta-rs s",
                    "anchor s",
                    "dbidx / anchor",
                    "polars / anchor",
                    "delta-rs / anchor",
                    "anchor MiB",
                ],
                read_rows(run),
            ),
            "Bytes on disk by area at the end: "
            + ", ".join(f"{k} {v / 2**20:,.1f} MiB" for k, v in run.areas.items())
            + ".",
            f"Per batch (batch 1, every {every} batches and the last; every batch is in the figures JSON):",
            _report.table(
                [
                    "batch",
                    "upsert s",
                    "service s",
                    "live data files",
                    "files on disk",
                    "table MiB",
                    "live data MiB",
                    "index files",
                    "cache MiB",
                ],
                sample_rows(run, every),
            ),
            *per_service,
        ]
    )


def figures(args: argparse.Namespace, run: Run, ok: bool, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "keys": args.keys,
        "batch_rows": args.batch,
        "shards": args.shards,
        "services": args.services,
        "read_every": args.read_every,
        "load_s": run.load_s,
        "check_ok": ok,
        "retention": args.retention,
        "areas": run.areas,
        "batches": [asdict(b) for b in run.batches],
        "checkpoints": [asdict(c) for c in run.checkpoints],
    }


# ---------------------------------------------------------------------------------------------------------------


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--batches", type=int, default=1_000)
    parser.add_argument("--batch", type=int, default=10_000, help="rows per change batch")
    parser.add_argument("--shards", type=int, default=2, help="dbidx key shards and Spark shuffle partitions")
    parser.add_argument(
        "--read-every", type=int, default=100, help="full reads every N batches (and the window of the goals)"
    )
    parser.add_argument("--services", choices=("on", "off"), default="on")
    parser.add_argument(
        "--retention",
        help="a Delta interval (e.g. 'interval 2 minutes') set as the table's "
        "delta.logRetentionDuration and delta.deletedFileRetentionDuration before the load (default: "
        "Delta's 30 days and 7 days)",
    )
    parser.add_argument("--work", type=Path, help="data dir, kept for reuse (default: a temp dir, removed)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (seconds; used by tests)")
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.keys, args.batches, args.batch, args.read_every = 2_000, 12, 200, 4
    if args.batches < 1 or args.read_every < 1 or args.batch < 20:
        parser.error("--batches and --read-every must be at least 1, --batch at least 20")
    return args


def run(args: argparse.Namespace, work: Path) -> tuple[str, bool, dict[str, Any]]:
    manifest, origin = speed_bench.dataset(work, args.keys, args.batches, args.batch)
    log(f"data {origin}")
    for name in ("soak-table", "soak-cache", "soak-spark", "soak-anchor"):
        shutil.rmtree(work / name, ignore_errors=True)
    code = code_version()  # at the start: what the run imports (the checkout may change while it runs)
    spark = _report.spark_session(work / "soak-spark", args.shards, "dbidx-soak-bench")
    try:
        result = soak(spark, work, manifest, args)
    finally:
        spark.stop()
        for name in ("soak-table", "soak-cache", "soak-spark", "soak-anchor"):
            shutil.rmtree(work / name, ignore_errors=True)
    check, ok = check_line(result, manifest)
    name = f"soak-{args.keys}-services-{args.services}" + ("-short-retention" if args.retention else "")
    return render(args, origin, result, check, code), ok, figures(args, result, ok, name)


def main() -> None:
    args = parse()
    own = args.work is None
    work = Path(tempfile.mkdtemp(prefix="dbidx-soak-bench-", dir=str(Path.cwd()))) if own else args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    try:
        body, ok, figs = run(args, work)
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)
    if not ok:  # figures measured on a broken table are not published
        print(body)
        raise SystemExit("the table read back does not match the data written (see the check line)")
    if args.write_results and not args.smoke:
        body = _report.publish(figs["name"], body, figs)
    print(body)


if __name__ == "__main__":
    main()
