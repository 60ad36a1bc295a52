"""Charts of the benchmark results: every PNG under benchmarks/results/ is drawn from results/<name>.json.

Drawing from the saved figures (not inside the timed runs) means a chart can be redrawn without rerunning a
benchmark and always shows exactly what RESULTS.md reports. Each chart carries a footer naming the machine, the
versions and the command that measured it (both saved in the JSON by `_report.write_figures`).
Needs matplotlib (the `bench` extra); without it nothing is drawn and the benchmarks still run.
Run: `python benchmarks/charts.py [name ...]` (default: every results/*.json that has a chart).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _pyplot() -> Any | None:
    """matplotlib.pyplot (Agg), or None without matplotlib: the set-up the demo's chart shares (dbidx.charts)."""
    from dbidx.charts import pyplot

    return pyplot()


Figure = tuple[Any, str, str]  # (matplotlib figure, data shape for the footer, file name)


def _save(plt: Any, figure: Figure, data: dict, out_dir: Path) -> str:
    """Footer (machine, versions, data shape, command), then the PNG; returns its path as RESULTS.md links it."""
    from dbidx.charts import save_figure

    fig, shape, filename = figure
    footer = f"{data.get('machine', 'machine not recorded')}\n{shape}. Command: {data.get('command', '?')}"
    save_figure(plt, fig, out_dir / filename, footer)
    return f"results/{filename}"


def footprint(plt: Any, data: dict) -> list[Figure]:
    """Bytes per entry by key shape (index, cache, dict, RFC-107), and cache MB over 30 days with the TTL on/off."""
    import numpy as np

    largest = max(r[1] for r in data["headline"])
    rows = [r for r in data["headline"] if r[1] >= largest * 0.99 and r[2] == 30]
    dicts = {r[0]: r[2] for r in data["dict"] if r[1] >= largest * 0.99}
    fig, ax = plt.subplots(figsize=(8, 4.8))
    width, x = 0.25, np.arange(len(rows))
    ax.bar(x - width, [r[3] for r in rows], width, label="index Parquet")
    ax.bar(x, [r[4] for r in rows], width, label="RocksDB cache (zstd)")
    ax.bar(x + width, [dicts.get(r[0], 0) for r in rows], width, label="Python dict (RSS)")
    ax.axhspan(50, 70, color="grey", alpha=0.2, label="RFC-107 index estimate (50-70)")
    ax.set_xticks(x, [r[0] for r in rows])
    ax.set_ylabel("bytes per entry")
    ax.set_title(f"Index footprint, {largest:,} keys, 30 partitions")
    ax.legend()
    out = [(fig, f"{largest:,} entries over 30 daily partitions, one shard", "footprint.png")]
    growth = data["growth"]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    ax.plot([r[0] for r in growth], [r[2] for r in growth], marker="o", label="TTL reaper on")
    ax.plot([r[0] for r in growth], [r[3] for r in growth], marker="o", label="TTL reaper off")
    ax.set_xlabel("simulated day")
    ax.set_ylabel("cache MB on disk")
    ax.set_title(f"Cache footprint over {len(growth)} days of daily partitions")
    ax.legend()
    shape = f"{growth[0][1]:,} new UUID keys a day, {growth[-1][1]:,} keys after {len(growth)} days"
    out.append((fig, shape, "ttl_growth.png"))
    rows = [r for r in data["compression"] if r[1] >= largest * 0.99]  # compressions at the largest size
    fig, ax = plt.subplots(figsize=(8, 4.8))
    x = np.arange(len(rows))
    for i, (column, label) in enumerate(
        ((3, "bulk-loaded"), (4, "catch-up written"), (5, "catch-up written, compacted"))
    ):
        ax.bar(x + (i - 1) * width, [r[column] for r in rows], width, label=label)
    ax.set_xticks(x, [f"{r[0]}\n{r[2]}" for r in rows], fontsize=7)
    ax.set_ylabel("cache bytes per entry")
    ax.set_title(f"Cache footprint by compression, {largest:,} keys")
    ax.legend()
    out.append((fig, f"{largest:,} entries over 30 daily partitions, one shard", "compression.png"))
    return out


def skew(plt: Any, data: dict) -> list[Figure]:
    """Largest and p99 bucket per day: simple (hash % N) vs dynamic buckets."""
    rows = data["rows"]
    days = [r[0] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    ax.plot(days, [r[3] for r in rows], label="simple: max bucket")
    ax.plot(days, [r[4] for r in rows], "--", label="simple: p99 bucket")
    ax.plot(days, [r[6] for r in rows], label="dynamic: max bucket")
    ax.plot(days, [r[7] for r in rows], "--", label="dynamic: p99 bucket")
    ax.axhline(data["capacity"], color="grey", lw=0.8, label=f"dynamic capacity ({data['capacity']:,})")
    ax.set_xlabel("day")
    ax.set_ylabel("keys per bucket")
    ax.set_title(f"Bucket size over {data['days']} days of growth in one partition")
    ax.legend()
    shape = f"one partition, {rows[0][1]:,} new keys on day 1, {rows[-1][2]:,} keys on day {rows[-1][0]}"
    return [(fig, shape, "skew.png")]


def spark(plt: Any, data: dict) -> list[Figure]:
    """Per-batch tagging seconds vs index size: dbidx, a Spark join against the RLI, a driver-side dict."""
    sizes = data["sizes"]
    keys = [r["keys"] / 1e6 for r in sizes]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for name, label in (
        ("dbidx_s", "dbidx tag"),
        ("join_s", "Spark join against the RLI"),
        ("dict_s", "driver-side dict (collect + lookups)"),
    ):
        ax.plot(keys, [r[name] for r in sizes], marker="o", label=label)
    ax.set_xlabel("index size (million keys)")
    ax.set_ylabel(f"seconds per {data['batch_rows']:,}-row batch")
    ax.set_title("Tagging time vs index size (Spark local[2])")
    ax.legend()
    shape = f"batches of {data['batch_rows']:,} rows, 80% existing keys, 30 daily partitions, {data['shards']} shards"
    return [(fig, shape, "tagging.png")]


def bootstrap(plt: Any, data: dict) -> list[Figure]:
    """Bootstrap entries/s per parallelism mode, for the 7-day window and the whole table."""
    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    labels = [f"{r[0]}\n{r[1]} days" for r in rows]
    ax.bar(range(len(rows)), [r[4] / 1e6 for r in rows], color=["C0" if r[1] == rows[0][1] else "C1" for r in rows])
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("million entries / s (end to end)")
    ax.set_title(
        f"Bootstrap rate by parallelism; on-demand stall: {data['stall_s_per_million']:.2f} s per 1 M entries",
        fontsize=10,
    )
    shape = f"{data.get('days_total', '?')} daily partitions x {data.get('keys_per_day', 0):,} UUID keys, one shard"
    return [(fig, shape, "bootstrap.png")]


def restart(plt: Any, data: dict) -> list[Figure]:
    """Warm restart (catch-up) vs full re-bootstrap seconds after K commits."""
    import numpy as np

    rows = data["rows"]
    x, width = np.arange(len(rows)), 0.38
    fig, ax = plt.subplots(figsize=(8, 4.8))
    ax.bar(x - width / 2, [r[3] for r in rows], width, label="warm restart (reuse + catch-up)")
    ax.bar(x + width / 2, [r[4] for r in rows], width, label="full re-bootstrap")
    for i, r in enumerate(rows):
        ax.annotate(r[5], (i, max(r[3], r[4])), ha="center", va="bottom", fontsize=9)
    ax.set_xticks(x, [f"K={r[0]}\n({r[1]:,} entries)" for r in rows], fontsize=8)
    ax.set_ylabel("seconds")
    ax.set_title(f"Getting a serving cache back after K commits, {data['keys']:,} keys")
    ax.legend()
    return [(fig, f"{data['keys']:,} keys in 30 daily partitions, one shard", "restart.png")]


def peers(plt: Any, data: dict) -> list[Figure]:
    """Median seconds per change batch vs table size, one line per system (its finished runs); none below two
    sizes."""
    import statistics

    runs = sorted(data["runs"].values(), key=lambda run: run["keys"])
    if len(runs) < 2:
        return []
    fig, ax = plt.subplots(figsize=(8, 4.8))
    names = dict.fromkeys(name for run in runs for name in run["systems"])
    for name in names:
        points = [
            (run["keys"] / 1e6, statistics.median(s["batch_s"][1:]))
            for run in runs
            if (s := run["systems"].get(name)) and s["status"] == "ok" and len(s["batch_s"]) > 1
        ]
        if points:
            label = next(run["systems"][name]["label"] for run in runs if name in run["systems"])
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("table size (million keys)")
    ax.set_ylabel("median seconds per change batch (batch 1 excluded)")
    ax.set_title("Upsert batch time vs table size: dbidx and its peers")
    ax.legend(fontsize=8)
    shape = (
        "batch rows by size: "
        + ", ".join(f"{run['keys']:,} keys: {run['batch_rows']:,}" for run in runs)
        + "; 80% recent updates, 5% late updates, 15% new keys; 30 daily partitions"
    )
    return [(fig, shape, "peers.png")]


def soak(plt: Any, data: dict) -> list[Figure]:
    """Over batch number: live data files, upsert + service seconds per batch, and each full read's time over
    delta-rs's read of the same rows written once (soak_bench.py)."""
    batches, points = data["batches"], data["checkpoints"]
    x = [b["number"] for b in batches]
    fig, (files, seconds, ratio) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    files.plot(x, [b["live_files"] for b in batches], label="live data files")
    files.plot(x, [b["disk_files"] for b in batches], "--", label="files on disk (table dir)")
    files.set_ylabel("files")
    files.legend(fontsize=8)
    seconds.plot(x, [b["upsert_s"] + b["service_s"] for b in batches], lw=0.8, label="upsert + services")
    if any(b["service_s"] for b in batches):
        seconds.plot(x, [b["service_s"] for b in batches], lw=0.8, label="of which services")
    seconds.set_ylabel("seconds per batch")
    seconds.legend(fontsize=8)
    for name, label in (
        ("dbidx_s", "dbidx read_arrow"),
        ("polars_s", "polars read_delta"),
        ("deltars_s", "delta-rs QueryBuilder"),
    ):
        ratio.plot([c["batch"] for c in points], [c[name] / c["anchor_s"] for c in points], marker="o", label=label)
    ratio.axhline(1.5, color="grey", lw=0.8, label="goal: 1.5x")
    ratio.set_ylim(bottom=0)
    ratio.set_ylabel("full read / delta-rs read\nof the rows written once")
    ratio.set_xlabel("batch number")
    ratio.legend(fontsize=8)
    fig.suptitle(f"Soak: {data['keys']:,} keys, batches of {data['batch_rows']:,} rows, services {data['services']}")
    shape = (
        f"{data['keys']:,} UUID keys, 30 daily partitions, {len(batches):,} batches of {data['batch_rows']:,} "
        f"rows (80% recent updates, 5% late, 15% new), {data['shards']} shards, Spark local[2]"
    )
    return [(fig, shape, f"{data['name']}.png")]


CHARTS: dict[str, Callable[[Any, dict], list[Figure]]] = {
    "footprint": footprint,
    "skew": skew,
    "spark": spark,
    "bootstrap": bootstrap,
    "restart": restart,
    "peers": peers,
}
# The soak benchmark's runs, one section and chart each: the two sizes, services on and off, and on with a
# short Delta retention (--retention).
SOAK_RUNS = [
    f"soak-{keys}-services-{mode}" for keys in (1_000_000, 10_000_000) for mode in ("on", "off", "on-short-retention")
]
CHARTS.update({name: soak for name in SOAK_RUNS})
# Charts that draw nothing until their benchmark has written enough figures (peers: two --keys sizes or more,
# `make bench-peers`; a soak run: once `make bench-soak` or a run with --write-results made it); the suite checks the
# others always, these once they draw.
DRAWN_ONCE_RUN = {"peers", *SOAK_RUNS}


def draw(name: str, out_dir: Path = RESULTS_DIR) -> list[str]:
    """Draw the charts of one benchmark from its saved figures (results/<name>.json) into out_dir; returns the
    written paths as RESULTS.md links them; [] without matplotlib or figures."""
    plt = _pyplot()
    path = RESULTS_DIR / f"{name}.json"
    if plt is None or name not in CHARTS or not path.exists():
        return []
    data = json.loads(path.read_text())
    return [_save(plt, figure, data, out_dir) for figure in CHARTS[name](plt, data)]


def links(paths: list[str]) -> str:
    """The markdown line that shows the charts in RESULTS.md ('' when none were drawn)."""
    return "Chart: " + ", ".join(f"![{Path(p).stem}]({p})" for p in paths) if paths else ""


def main() -> None:
    names = sys.argv[1:] or [n for n in CHARTS if (RESULTS_DIR / f"{n}.json").exists()]
    if _pyplot() is None:
        raise SystemExit("matplotlib is not installed: pip install -e '.[bench]'")
    for name in names:
        for path in draw(name):
            print(path)


if __name__ == "__main__":
    main()
