"""`dbidx cache ...`: the commands over executor-local caches (info, stats, sync, verify, reap, bootstrap).

Each is a few lines over the library (`dbidx.cache`, `dbidx.bootstrap`); `each_cache` is the one loop that finds
the shard caches under a directory (a shard dir or a base path; by default the one base path Spark tasks use too,
`base_dir.base_path_choice`, which `dbidx cache info` shows) and opens them one at a time.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, TypeVar

import click

from dbidx.cli_output import ProgressBar, json_option, open_table, output, table_argument, wants_json
from dbidx.errors import CacheError, InvalidInputError

T = TypeVar("T")


def each_cache(
    cache_dir: str | Path | None, fn: Callable[[Path, Any], T], table: Any = None, none_ok: bool = False
) -> list[T]:
    """fn(path, open cache) for every shard cache under `cache_dir` (of `table` only, when given), one at a time:
    each cache is closed before the next opens, and when fn raises. No cache there is a CacheError unless
    `none_ok`. CLI tools wait at most 10 s for a busy cache."""
    from dbidx.cache.inspect import find_cache_dirs, open_cache_dir
    from dbidx.cache.registry import table_cache_dir_name

    root = Path(cache_dir) if cache_dir is not None else base_path()
    if table is not None:
        nested = root / table_cache_dir_name(table)
        root = nested if nested.is_dir() else root
    try:
        paths = find_cache_dirs(root)
    except CacheError as exc:
        if none_ok:
            return []
        where = (
            ""
            if cache_dir is not None
            else (
                " (the default base path; a job that set base.path or "
                "spark.local.dir keeps its caches elsewhere: pass --cache-dir)"
            )
        )
        raise CacheError(f"{exc}{where}; `dbidx cache info` shows where caches are looked for") from exc
    config = cli_cache_config()
    results = []
    for path in paths:
        with open_cache_dir(path, config) as cache:
            results.append(fn(path, cache))
    return results


def cli_cache_config() -> Any:
    """Cache settings for CLI tools: environment variables apply; wait at most 10 s for a busy cache."""
    from dataclasses import replace

    from dbidx.config import CacheConfig

    config = CacheConfig.from_sources()
    return replace(config, lock_timeout_s=min(config.lock_timeout_s, 10.0))


def base_path() -> Path:
    """The caches' base path for CLI tools: the config's base.path (DBIDX_CACHE_BASE_PATH), else the default."""
    from dbidx.cache.base_dir import default_base_path

    configured = cli_cache_config().base_path
    return Path(configured) if configured else default_base_path()


cache_dir_option = click.option(
    "--cache-dir",
    default=None,
    help="A shard cache dir or a base path holding several "
    "[default: the base path Spark tasks use too; see `dbidx cache info`].",
)


def table_caches_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """URI, --cache-dir and --json: the options of commands that check a table's caches against it."""
    return table_argument()(cache_dir_option(json_option(fn)))


@click.group("cache")
def cache_group() -> None:
    """Executor-local caches: info, stats, sync, verify, reap, bootstrap."""


def _table_reports(uri: str, cache_dir: str | None, fn: Callable[[Any, Any], Any]) -> list[dict[str, Any]]:
    """fn(cache, table).to_dict() with the cache's path, for each cache of the table at `uri` under `cache_dir`."""
    table = open_table(uri)
    return each_cache(cache_dir, lambda path, cache: {"path": str(path)} | fn(cache, table).to_dict(), table)


@cache_group.command("info")
@json_option
def info_cmd(as_json: bool) -> None:
    """Where caches live by default (for Spark tasks and these commands alike), why, and what is there."""
    from dbidx.cache.inspect import caches_summary

    output(as_json).emit(caches_summary(cli_cache_config()), _info_text)


def _info_text(p: dict[str, Any]) -> str:
    lines = [
        f"base path: {p['base_path']}",
        f"chosen by: {p['chosen_by']}",
        f"exists: {'yes' if p['exists'] else 'no (created by the first job or bootstrap)'}",
        f"caches: {len(p['caches'])} shard cache(s), {p['disk_bytes']:,} bytes",
    ]
    lines += [f"  {c['path']} ({c['disk_bytes']:,} bytes)" for c in p["caches"]]
    lines += [f"key files: {k['path']} ({k['files']:,} files, {k['disk_bytes']:,} bytes)" for k in p["key_files"]]
    return "\n".join(
        lines
        + [
            "a job whose base.path or spark.local.dir names another directory keeps its caches there "
            "(<spark.local.dir>/dbidx-cache, unless that is the system temp dir): pass --cache-dir"
        ]
    )


@cache_group.command("stats")
@cache_dir_option
@json_option
def stats_cmd(cache_dir: str, as_json: bool) -> None:
    """Partitions, entries, bytes, watermark and pending instants of each cache."""
    from dbidx.cache.inspect import cache_report

    reports = each_cache(cache_dir, lambda _path, cache: cache_report(cache))
    output(as_json).emit({"caches": reports}, _stats_text)


def _stats_text(p: dict[str, Any]) -> str:
    lines = []
    for c in p["caches"]:
        lines.append(
            f"{c['path']}: table {c['table_id']} shard {c['shard']}/{c['num_shards']}, watermark "
            f"{c['watermark']}, {c['entries']} entries, {c['disk_bytes']} bytes"
        )
        lines += [
            f"  {r['partition'] or '(global)'}\t{r['state']}\t{r['entries']} entries\t{r['disk_bytes']} B"
            f"\tlast access {r['last_access']}"
            for r in c["partitions"]
        ]
    return "\n".join(lines)


@cache_group.command("sync")
@table_caches_options
def sync_cmd(uri: str, cache_dir: str, as_json: bool) -> None:
    """Catch local caches up to the table's latest completed instant."""
    from dbidx.cache.catchup import sync

    results = _table_reports(uri, cache_dir, sync)
    output(as_json).emit(
        {"caches": results},
        lambda p: "\n".join(
            f"{r['path']}: seq {r['from_seq']} -> {r['to_seq']}, applied {r['applied_entries']} entries, reloaded "
            f"{len(r['reloaded_partitions'])} partitions, installed {len(r['staged_partitions'])} staged by a load"
            for r in p["caches"]
        ),
    )


@cache_group.command("verify")
@table_caches_options
def verify_cmd(uri: str, cache_dir: str, as_json: bool) -> None:
    """Compare caches with the index, entry by entry (exit 1 on a difference)."""
    from dbidx.cache.verify import verify

    results = _table_reports(uri, cache_dir, verify)
    payload = {"ok": all(r["ok"] for r in results), "caches": results}
    output(as_json).emit(payload, _verify_text)
    if not payload["ok"]:
        sys.exit(1)


def _verify_text(p: dict[str, Any]) -> str:
    lines = []
    for c in p["caches"]:
        for r in c["partitions"]:
            verdict = (
                "ok"
                if r["ok"]
                else (
                    f"DIFF missing {r['missing']} extra {r['extra']} wrong location "
                    f"{r['wrong_location']}: " + "; ".join(r["examples"])
                )
            )
            lines.append(
                f"{c['path']} {r['partition'] or '(global)'} @ seq {r['synced_seq']}: "
                f"{r['cache_entries']} entries, {verdict}"
            )
    return "\n".join(lines + ["all caches match the index" if p["ok"] else "MISMATCH"])


@cache_group.command("reap")
@cache_dir_option
@click.option(
    "--ttl-hours", type=click.FloatRange(min=0), default=None, help="Drop partitions idle this long [config default]."
)
@click.option(
    "--max-disk-mb", type=click.IntRange(min=0), default=None, help="Then drop LRU partitions above this size [config]."
)
@click.option("--dry-run", is_flag=True, help="Only report what would be dropped.")
@json_option
def reap_cmd(cache_dir: str, ttl_hours: float | None, max_disk_mb: int | None, dry_run: bool, as_json: bool) -> None:
    """Remove abandoned shard caches under a base path, then drop expired and over-budget partitions from the
    others."""
    from dbidx.cache.inspect import is_cache_dir
    from dbidx.cache.reaper import abandoned_to_dict, reap, sweep_abandoned

    ttl = cli_cache_config().partition_ttl_hours if ttl_hours is None else ttl_hours
    root = Path(cache_dir) if cache_dir is not None else base_path()
    # First, before opening any cache (an open counts as a use): caches no process holds, idle for the TTL.
    abandoned = [] if is_cache_dir(root) else sweep_abandoned(root, ttl, dry_run=dry_run)
    # none_ok when the sweep removed caches: it may have removed every one there was.
    results = each_cache(
        root,
        lambda path, cache: {"path": str(path)} | reap(cache, ttl_hours, max_disk_mb, dry_run=dry_run).to_dict(),
        none_ok=bool(abandoned),
    )
    verb = "would drop" if dry_run else "dropped"
    output(as_json).emit(
        {"abandoned": abandoned_to_dict(abandoned), "caches": results},
        lambda p: "\n".join(
            [
                f"{a['path']}: {'would remove' if dry_run else 'removed'} abandoned cache (idle {a['idle_hours']} h, "
                f"{a['disk_bytes']} bytes)"
                for a in p["abandoned"]
            ]
            + [
                f"{r['path']}: {verb} {len(r['dropped'])} partitions {r['dropped'] or ''} ({r['bytes_before']} -> "
                f"{r['bytes_after']} bytes)"
                for r in p["caches"]
            ]
        ),
    )


@cache_group.command("services")
@click.option("--stop", is_flag=True, help="Ask each service to close its cache and exit (after its current task).")
@json_option
def services_cmd(stop: bool, as_json: bool) -> None:
    """Your cache services on this machine (config `service`): pid, cache directory, tasks served."""
    from dbidx.cache.service_link import request_stop, running_services

    found = running_services()
    for service in found:
        service["stopping"] = bool(stop and service["cache_dir"] and request_stop(Path(service["cache_dir"])))
    output(as_json).emit({"services": found}, _services_text)


def _services_text(p: dict[str, Any]) -> str:
    if not p["services"]:
        return "no cache service runs"
    return "\n".join(
        f"pid {s['pid']}: {s['cache_dir']} ({s['requests']} tasks served, exits after {s['idle_exit_s']} s idle)"
        + (" - stopping" if s["stopping"] else "")
        if not s["busy"]
        else f"{s['socket']}: busy with a task"
        for s in p["services"]
    )


@cache_group.command("bootstrap")
@table_argument()
@click.option(
    "--days", type=click.IntRange(min=0), default=None, help="Load the partitions of the last DAYS days [config: 7]."
)
@click.option("--shard", "shards", type=click.IntRange(min=0), multiple=True, help="Bootstrap this shard (repeatable).")
@click.option(
    "--num-shards", type=click.IntRange(min=1), default=None, help="Expected shard count of the table (checked)."
)
@click.option("--all-shards", is_flag=True, help="Bootstrap every shard (the default without --shard).")
@click.option(
    "--cache-dir",
    default=None,
    help="Base path of the caches [config base.path, else SPARK_LOCAL_DIRS or the user cache dir].",
)
@click.option(
    "--partition-pattern",
    default=None,
    help="Date pattern of partition paths, strftime-like "
    "(ds=%Y%m%d) or 're:' + regex with named groups year, month, day[, hour].",
)
@click.option("--now", default=None, help="Treat this ISO date (or date-time, UTC) as today [the clock].")
@click.option(
    "--parallelism",
    type=click.Choice(["auto", "threads", "processes", "serial"]),
    default="auto",
    show_default=True,
    help="How partitions are built in parallel.",
)
@json_option
def bootstrap_cmd(
    uri: str,
    days: int | None,
    shards: tuple[int, ...],
    num_shards: int | None,
    all_shards: bool,
    cache_dir: str | None,
    partition_pattern: str | None,
    now: str | None,
    parallelism: str,
    as_json: bool,
) -> None:
    """Load the last DAYS days of partitions (global index: the shard's whole slice) into local shard caches.

    `dbidx bootstrap` and `dbidx cache bootstrap` are the same command."""
    from dbidx.bootstrap.time_bounded import bootstrap, resolve_shards

    if all_shards and shards:
        raise InvalidInputError("use either --shard or --all-shards, not both")
    table = open_table(uri)
    chosen = resolve_shards(table, list(shards) or None, num_shards)
    with ProgressBar("bootstrap", wants_json(as_json)) as progress:
        result = bootstrap(
            table, days, chosen, now, cli_cache_config(), cache_dir, partition_pattern, parallelism, progress=progress
        )
    output(as_json).emit(
        result.to_dict(),
        lambda p: (
            f"bootstrapped {len(p['shards'])} shard(s) of {p['table']}: window {p['selection']['first_day']} .. "
            f"{p['selection']['now'][:10]} ({p['days']} days), {p['partitions_loaded']} partition slices loaded, "
            f"{p['entries']:,} entries, {p['disk_bytes']:,} bytes on disk, {p['seconds']:.2f} s, "
            f"{p['entries_per_second']:,} entries/s ({p['parallelism']}); "
            f"{sum(len(s['already_ready']) for s in p['shards'])} already ready (caught up "
            f"{sum(s['caught_up_entries'] for s in p['shards']):,} entries)"
        ),
    )
