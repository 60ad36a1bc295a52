"""Why the table services' time grows over a long run (issue 44, the soak's time goal), reproduced without Spark.

The soak (soak_bench.py, Spark) showed the services' share of "upsert + service s" growing from window to window
(31 -> 52 -> 75 s per 100 batches at 1 M keys) while every service ran as often in each window: each run got slower.
This script replays the same change mix through the library writer (`upsert_arrow`, in this process), with the
services on and their defaults (they run inside `upsert_arrow` after its publish, as in the soak), and measures,
per service and per window of `--window` batches, wall seconds and CPU seconds (`time.process_time` of this process:
the services run here, so this is their CPU, and the machine being shared does not inflate it).

How the services are measured: the functions of `dbidx.table.services` that `run_services` calls are wrapped in this
process (the real ones run; the wrapper only reads the clocks around them): each service's trigger (`data_needs`,
`index_needs`, `clean_due`, `retention_of`, `vacuum_wait`) and its step (`_compact_data`, `_compact_index`, `_clean`,
`_log_cleanup`, `_vacuum`). A name the module no longer has is reported and skipped. `--profile` also runs cProfile
(CPU timer) around each services run and aggregates the functions per window, to name what grows: the top functions
by growth of their own (tottime) and inclusive (cumtime) CPU seconds, last window vs the second. The profiler slows
Python code down, so its seconds are for comparing windows, not for the per-service table of a run without it.
Beside the clocks, what each service did per window (rows and index entries rewritten, files deleted, Delta
checkpoints, from the upsert summaries' `services.ran[].details`) with its CPU per unit: flat per unit means
the growth is the work's (bigger file groups to rewrite), growing per unit means the code's.

Data: table_bench.Stream (the soak's generator): `--keys` UUID keys over 30 daily partitions, loaded at once (the
bulk path), then `--batches` batches of `--batch` rows (80% updates of the last 7 days, 5% late, 15% new keys).
Run: `python benchmarks/service_growth.py [--keys 100000] [--batches 500] [--batch 2000] [--shards 2] [--window 100]
[--retention 'interval 2 minutes'] [--profile] [--json OUT] [--smoke]`.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report
from table_bench import Stream

from dbidx.table import service_settings
from dbidx.table import services as services_module
from dbidx.table.facade import Table
from dbidx.spark_integration import driver
from dbidx.spark_integration.local import upsert_arrow

KEY, PARTITION, SEED = "id", "dt", 20261123
# The functions run_services calls, by service: (trigger, step). Their wall and CPU are the service's.
WRAPPED = {
    "data_compaction": ("data_needs", "_compact_data"),
    "index_compaction": ("index_needs", "_compact_index"),
    "clean": ("clean_due", "_clean"),
    "log_cleanup": ("retention_of", "_log_cleanup"),
    "vacuum": ("vacuum_wait", "_vacuum"),
}
PROFILE_TOP = 20


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class Batch:
    """One batch: the upsert less its services, the services run (total and per service part), the table's files."""

    number: int
    upsert_wall: float
    upsert_cpu: float
    services_wall: float
    services_cpu: float
    parts: dict[str, list[float]] = field(default_factory=dict)  # "service:trigger|step" -> [wall, cpu, calls]
    ran: list[dict[str, Any]] = field(default_factory=list)  # the report's runs: {service, seconds, details}
    files: dict[str, int] = field(default_factory=dict)  # files by area after the batch


class Meter:
    """Clocks around the services: the whole run (wrapping the `run_services` the writer calls) and each service's
    trigger and step (wrapping the functions of dbidx.table.services). Wrapping, not copying: the real code runs."""

    def __init__(self, profile: bool) -> None:
        self.parts: dict[str, list[float]] = {}
        self.total = [0.0, 0.0]
        self.profile = profile
        self.stats: pstats.Stats | None = None  # this window's profile
        self.missing: list[str] = []
        self._undo: list[tuple[Any, str, Any]] = []

    def install(self) -> None:
        for service, names in WRAPPED.items():
            for part, name in zip(("trigger", "step"), names):
                original = getattr(services_module, name, None)
                if original is None:
                    self.missing.append(name)
                    continue
                self._patch(services_module, name, self._timed(f"{service}:{part}", original))
        self._patch(driver, "run_services", self._run(driver.run_services))

    def uninstall(self) -> None:
        for module, name, original in reversed(self._undo):
            setattr(module, name, original)
        self._undo.clear()

    def _patch(self, module: Any, name: str, wrapper: Any) -> None:
        self._undo.append((module, name, getattr(module, name)))
        setattr(module, name, wrapper)

    def _timed(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                cell = self.parts.setdefault(label, [0.0, 0.0, 0])
                cell[0] += time.perf_counter() - wall
                cell[1] += time.process_time() - cpu
                cell[2] += 1

        return wrapper

    def _run(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            profiler = cProfile.Profile(time.process_time) if self.profile else None
            wall, cpu = time.perf_counter(), time.process_time()
            if profiler:
                profiler.enable()
            try:
                return fn(*args, **kwargs)
            finally:
                if profiler:
                    profiler.disable()
                self.total[0] += time.perf_counter() - wall
                self.total[1] += time.process_time() - cpu
                if profiler:
                    if self.stats is None:
                        self.stats = pstats.Stats(profiler)
                    else:
                        self.stats.add(profiler)

        return wrapper

    def take(self) -> tuple[list[float], dict[str, list[float]]]:
        """The clocks since the last take (one batch), reset."""
        total, parts = self.total, self.parts
        self.total, self.parts = [0.0, 0.0], {}
        return total, parts


def files_by_area(root: Path) -> dict[str, int]:
    """Files under the table by area: index, timeline (completed, archive, checkpoints, other), deletion vectors,
    Delta log, data: what a listing or a replay would have to go through."""
    out: dict[str, int] = {}
    for dirpath, _dirs, names in os.walk(root):
        rel = os.path.relpath(dirpath, root).replace(os.sep, "/")
        if rel.startswith(".dbidx/timeline/"):
            area = "timeline/" + rel.split("/")[2]
        elif rel.startswith(".dbidx/"):
            area = rel.split("/")[1]
        elif rel.startswith("_delta_log"):
            area = "_delta_log"
        elif rel == ".":
            area = "root"
        else:
            area = "data"
        out[area] = out.get(area, 0) + len(names)
    return dict(sorted(out.items()))


def parse_setting(text: str) -> tuple[str, Any]:
    """A `--setting key=value` as `dbidx config` parses it (the table service setting's own type)."""
    key, _, value = text.partition("=")
    return key, service_settings.parse_text(key, value)


def run(args: argparse.Namespace, work: Path, meter: Meter) -> tuple[list[Batch], list[tuple[int, pstats.Stats]]]:
    stream = Stream(args.keys, np.random.default_rng(SEED))
    root = work / "table"
    table = Table.open_or_create(str(root), num_shards=args.shards)
    # The defaults (the services run inside the upsert), but for the --setting overrides (e.g. A/B of a setting).
    settings = table.configure_services(after_commit=True, **dict(parse_setting(s) for s in args.setting or []))
    if args.retention:
        table.set_delta_properties(
            {"delta.logRetentionDuration": args.retention, "delta.deletedFileRetentionDuration": args.retention}
        )
    log(f"services {settings.to_dict()}; Delta properties {table.delta_properties()}")
    start = time.perf_counter()
    upsert_arrow(stream.load(), table, key=KEY, partition=PARTITION)
    meter.take()
    meter.stats = None
    log(f"load of {args.keys:,} keys: {time.perf_counter() - start:.1f} s")
    batches: list[Batch] = []
    profiles: list[tuple[int, pstats.Stats]] = []
    for number in range(1, args.batches + 1):
        data = stream.batch(args.batch, number)
        wall, cpu = time.perf_counter(), time.process_time()
        summary = upsert_arrow(data, table, key=KEY, partition=PARTITION).to_dict()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        total, parts = meter.take()
        section = summary.get("services") or {}
        if section.get("error"):
            log(f"batch {number}: services failed: {section['error']}")
        ran = [
            {"service": str(r.get("service")), "seconds": r.get("seconds"), "details": r.get("details")}
            for r in section.get("ran", [])
        ]
        batches.append(
            Batch(number, wall - total[0], cpu - total[1], total[0], total[1], parts, ran, files_by_area(root))
        )
        if number % args.window == 0 or number == args.batches:
            if meter.stats is not None:
                profiles.append((number, meter.stats))
            meter.stats = None
            w = batches[-args.window :]
            log(
                f"batch {number}: last {len(w)} batches upsert {sum(b.upsert_wall for b in w):.1f} s wall "
                f"{sum(b.upsert_cpu for b in w):.1f} s CPU, services {sum(b.services_wall for b in w):.1f} s wall "
                f"{sum(b.services_cpu for b in w):.1f} s CPU; files {batches[-1].files}"
            )
    rows, sum_ver = stream.expected()
    from dbidx.data import reads
    import pyarrow.compute as pc

    got = reads.read_arrow(table, columns=["ver"])
    if (got.num_rows, int(pc.sum(got.column("ver")).as_py() or 0)) != (rows, sum_ver):
        raise SystemExit(f"read back {got.num_rows:,} rows, expected {rows:,}: the table is wrong")
    return batches, profiles


# ---------------------------------------------------------------------------------------------------------------
# The tables.


def windows(batches: list[Batch], size: int) -> list[list[Batch]]:
    return [batches[i : i + size] for i in range(0, len(batches), size)]


def label(w: list[Batch]) -> str:
    return f"{w[0].number}-{w[-1].number}"


def totals_table(ws: list[list[Batch]]) -> str:
    rows = []
    for w in ws:
        rows.append(
            [
                label(w),
                sum(b.upsert_wall for b in w),
                sum(b.upsert_cpu for b in w),
                sum(b.services_wall for b in w),
                sum(b.services_cpu for b in w),
                f"{sum(b.services_wall for b in w) / sum(b.upsert_wall + b.services_wall for b in w):.0%}",
            ]
        )
    return _report.table(
        ["batches", "upsert wall s", "upsert CPU s", "services wall s", "services CPU s", "services' share of wall"],
        rows,
    )


def service_table(ws: list[list[Batch]]) -> str:
    """Per service part and window: wall and CPU sums, calls, CPU per call (mean, max) and the CPU ratio to the
    second window (the soak's reference)."""
    labels = sorted(
        {k for w in ws for b in w for k in b.parts}, key=lambda k: (list(WRAPPED).index(k.split(":")[0]), k)
    )
    rows = []
    for name in labels:
        ref = None
        for i, w in enumerate(ws):
            cells = [b.parts[name] for b in w if name in b.parts]
            cpu = [c[1] for c in cells]
            calls = int(sum(c[2] for c in cells))
            if i == 1:
                ref = sum(cpu)
            ratio = f"{sum(cpu) / ref:.2f}x" if ref else "-"
            rows.append(
                [
                    name,
                    label(w),
                    sum(c[0] for c in cells),
                    sum(cpu),
                    calls,
                    sum(cpu) / calls if calls else 0.0,
                    max(cpu, default=0.0),
                    ratio,
                ]
            )
    # What no wrapper covers: the run's own settings read and bookkeeping (services total less the parts).
    for i, w in enumerate(ws):
        rest = [
            (
                b.services_wall - sum(c[0] for c in b.parts.values()),
                b.services_cpu - sum(c[1] for c in b.parts.values()),
            )
            for b in w
        ]
        rows.append(
            [
                "(rest of the run)",
                label(w),
                sum(r[0] for r in rest),
                sum(r[1] for r in rest),
                len(w),
                sum(r[1] for r in rest) / len(w),
                max((r[1] for r in rest), default=0.0),
                "",
            ]
        )
    return _report.table(
        ["service:part", "batches", "wall s", "CPU s", "calls", "CPU s/call", "max CPU s/call", "CPU vs 2nd window"],
        rows,
    )


WORK = {
    "data_compaction": "rows_written",
    "index_compaction": "entries_written",
    "clean": "files_deleted",
    "log_cleanup": "files_deleted",
}  # what a service's run did, from its report's details


def work_table(ws: list[list[Batch]]) -> str:
    """What each service did per window (rows / entries rewritten, files deleted, checkpoints) beside its step's CPU:
    CPU per unit of work flat means the growth is the work's (bigger groups to rewrite), not the code's."""
    rows = []
    for service, unit in WORK.items():
        for w in ws:
            runs = [r for b in w for r in b.ran if r["service"] == service]
            done = sum(int((r.get("details") or {}).get(unit) or 0) for r in runs)
            cpu = sum(b.parts.get(f"{service}:step", [0.0, 0.0, 0])[1] for b in w)
            checkpoints = sum(1 for r in runs if "checkpoint" in (r.get("details") or {}))
            rows.append(
                [
                    service,
                    label(w),
                    len(runs),
                    f"{done:,} {unit}",
                    cpu,
                    f"{cpu / done * 1e6:,.1f}" if done else "-",
                    checkpoints if service == "log_cleanup" else "",
                ]
            )
    return _report.table(["service", "batches", "runs", "work", "step CPU s", "CPU us per unit", "checkpoints"], rows)


def files_table(ws: list[list[Batch]]) -> str:
    areas = sorted({a for w in ws for b in w for a in b.files})
    rows = [[label(w)] + [w[-1].files.get(a, 0) for a in areas] for w in ws]
    return _report.table(["files at the end of"] + areas, rows)


def profile_table(profiles: list[tuple[int, pstats.Stats]], key: str) -> str:
    """The functions whose CPU (key: tottime or cumtime) grew most from the second window to the last."""
    if len(profiles) < 3:
        return "(needs at least 3 windows)"

    def per_function(stats: pstats.Stats) -> dict[str, tuple[float, int]]:
        out = {}
        for (file, line, fn), (_cc, calls, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
            name = (
                f"{os.path.relpath(file, str(Path(__file__).resolve().parents[1])) if file.startswith('/') else file}"
                f":{line}({fn})"
            )
            out[name] = (tt if key == "tottime" else ct, calls)
        return out

    cols = [per_function(s) for _, s in profiles]
    ref, last = cols[1], cols[-1]
    growth = sorted(last, key=lambda n: -(last[n][0] - ref.get(n, (0.0, 0))[0]))[:PROFILE_TOP]
    rows = [[n] + [f"{c.get(n, (0.0, 0))[0]:.2f} ({c.get(n, (0.0, 0))[1]:,})" for c in cols] for n in growth]
    return _report.table([f"function ({key}: CPU s (calls) per window)"] + [f"to {n}" for n, _ in profiles], rows)


def render(
    args: argparse.Namespace, batches: list[Batch], profiles: list[tuple[int, pstats.Stats]], missing: list[str]
) -> str:
    ws = windows(batches, args.window)
    parts = [
        f"## Service growth: {args.batches:,} batches of {args.batch:,} rows on {args.keys:,} keys, "
        f"{args.shards} shards" + (f", retention {args.retention}" if args.retention else ""),
        f"Machine: {_report.machine()}. Command: `{_report.command()}`. Writer: `upsert_arrow` (no Spark), "
        f"services on with their defaults{' (profiled: CPU inflated)' if args.profile else ''}.",
        totals_table(ws),
        service_table(ws),
        work_table(ws),
        files_table(ws),
    ]
    if missing:
        parts.append(f"Not measured (dbidx.table.services has no such function now): {', '.join(missing)}.")
    if profiles:
        parts += [
            "Functions whose own CPU grew most (tottime):",
            profile_table(profiles, "tottime"),
            "Functions whose inclusive CPU grew most (cumtime):",
            profile_table(profiles, "cumtime"),
        ]
    return "\n\n".join(parts)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--batches", type=int, default=500)
    parser.add_argument("--batch", type=int, default=2_000)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--window", type=int, default=100)
    parser.add_argument("--retention", help="a Delta interval set as the log and removed-file retention")
    parser.add_argument(
        "--setting",
        action="append",
        metavar="KEY=VALUE",
        help="a table service setting other than its default (repeatable), e.g. index_base_share=0",
    )
    parser.add_argument("--profile", action="store_true", help="cProfile each services run (CPU timer)")
    parser.add_argument("--json", type=Path, help="write every batch's figures here")
    parser.add_argument("--work", type=Path, help="work dir, kept (default: a temp dir, removed)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (seconds; used by tests)")
    args = parser.parse_args()
    if args.smoke:
        args.keys, args.batches, args.batch, args.window = 2_000, 24, 200, 8
    return args


def main() -> None:
    args = parse()
    own = args.work is None
    work = Path(tempfile.mkdtemp(prefix="dbidx-service-growth-", dir=str(Path.cwd()))) if own else args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    meter = Meter(args.profile)
    meter.install()
    try:
        batches, profiles = run(args, work, meter)
    finally:
        meter.uninstall()
        if own:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        args.json.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "batches": [asdict(b) for b in batches]})
        )
    print(render(args, batches, profiles, meter.missing))


if __name__ == "__main__":
    main()
