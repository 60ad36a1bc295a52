"""`dbidx commits`, `dbidx stats` and `dbidx verify`: looking at a table without changing it (its recent
completions, its partitions and services, the checksums of its files), each with the table's pending attempts.
Apart from cli.py, which registers these commands, so that module stays a list of commands over library calls.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from dbidx.cli_output import ProgressBar, json_option, open_table, output, table_argument, wants_json


@click.command("commits")
@click.argument("uri")
@click.option(
    "--last",
    default=20,
    show_default=True,
    type=click.IntRange(min=1),
    help="How many completions to show, newest first.",
)
@json_option
def commits_cmd(uri: str, last: int, as_json: bool) -> None:
    """Recent completions of a table, with each upsert's metrics (rows, inserts, hit rate, on-demand loads...)."""
    from dbidx.spark_integration.driver import commit_history

    table = open_table(uri)
    output(as_json).emit(
        {"commits": commit_history(table, last), "pending": [p.to_dict() for p in table.pending_attempts()]},
        _commits_text,
    )


def _pending_text(pending: list[dict[str, Any]]) -> list[str]:
    """One line per unfinished attempt: who, since when, how many files, and what to run."""
    lines = []
    for p in pending:
        age = "unknown age" if p["age_seconds"] is None else f"{p['age_seconds'] / 60:.1f} min old"
        alive = {True: "alive", False: "gone", None: "liveness unknown yet"}[p["alive"]]
        beat = (
            "no heartbeat"
            if p.get("heartbeat_age_seconds") is None
            else f"heartbeat {p['heartbeat_age_seconds']:.0f} s ago"
        )
        app = "".join(f", {k} {v}" for k, v in sorted((p.get("tags") or {}).items()))
        lines.append(
            f"PENDING {p['instant']} {p['action'] or '?'} by {p['host'] or '?'} pid {p['pid'] or '?'}{app} "
            f"({alive}: {beat}), {age}, {len(p['files'])} files: {p['advice']}"
        )
    return lines


def _commits_text(payload: dict[str, Any]) -> str:
    from dbidx.spark_integration.job_report import describe

    lines = _pending_text(payload.get("pending", []))
    for c in payload["commits"]:
        m = c["metrics"]
        what = (
            f"{m.get('input_rows', m['rows']):,} rows in, {m['rows']:,} records, {m['inserts']:,} inserts, "
            f"{m['updates']:,} updates, {m['deletes']:,} deletes"
            f" ({m['deletes_missing']:,} more of keys not in the index: nothing to delete), "
            f"hit rate {m['hit_rate']:.1%}, {m['on_demand_loads']} on-demand loads "
            f"({m['stall_seconds']:.2f} s), {m['catchup_entries']:,} catch-up entries, {m['seconds']:.1f} s"
            if m
            else f"rolled back {c['rolled_back']}"
            if c["rolled_back"]
            else ""
        )
        lines.append(f"{c['seq']:>5} {c['instant']} {c['action']:<11} {what}".rstrip())
        if m and m.get("spark"):  # an upsert Spark ran: attempts, retries, speculation, executors lost
            lines.append(f"{'':>5} {describe(m['spark'])}")
    return "\n".join(lines) or "no completions yet"


@click.command("stats")
@table_argument()
@json_option
def stats_cmd(uri: str, as_json: bool) -> None:
    """Per-partition stats of the persisted index (last commit, live keys, file groups); `dbidx cache stats` for
    local caches."""
    table = open_table(uri)
    parts = [
        {
            "partition": s.partition,
            "last_instant": s.last_instant,
            "last_commit": s.last_commit_time.isoformat(),
            "live_keys": s.live_keys,
            "file_groups": len(s.bucket_fills),
            "bucket_fills": s.bucket_fills,
        }
        for s in table.partitions()
    ]
    latest = table.latest()
    payload = {
        "uri": table.uri,
        "index_mode": table.props.index_mode,
        "num_shards": table.num_shards,
        "completed_instants": table.timeline.latest_seq,
        "latest_instant": latest.instant if latest else None,
        "live_keys": sum(p["live_keys"] for p in parts),
        "partitions": parts,
        "pending": [a.to_dict() for a in table.pending_attempts()],
        **_services_of(table),
    }

    def text(p: dict[str, Any]) -> str:
        head = (
            f"{p['uri']}: {p['index_mode']} index, {p['num_shards']} shards, {p['live_keys']} live keys, "
            f"{len(p['partitions'])} partitions, {p['completed_instants']} completions"
        )
        rows = [
            f"  {r['partition'] or '(root)'}\t{r['live_keys']} keys\t{r['file_groups']} file groups\t"
            f"last {r['last_instant']} ({r['last_commit']})"
            for r in p["partitions"]
        ]
        from dbidx.table.service_settings import ServiceSettings

        if p["services"] is None:
            changed = f"settings unreadable, the table services do not run: {p['services_error']}"
        else:
            defaults = ServiceSettings().to_dict()
            changed = ", ".join(f"{k}={v}" for k, v in p["services"].items() if defaults.get(k) != v) or "defaults"
        return "\n".join([head] + rows + [f"  services: {changed} (dbidx config)"] + _pending_text(p["pending"]))

    output(as_json).emit(payload, text)


@click.command("verify")
@table_argument()
@json_option
def verify_cmd(uri: str, as_json: bool) -> None:
    """Check every file of the table against its recorded size and checksum (exit 4 on damage); `dbidx cache
    verify` compares caches with the index."""
    _verify_table_files(open_table(uri), as_json)


def _verify_table_files(table: Any, as_json: bool) -> None:
    from dbidx.table.verify_table import verify_table

    with ProgressBar("verify", wants_json(as_json)) as update:
        check = verify_table(table, progress=update)
    pending = [a.to_dict() for a in table.pending_attempts()]

    def text(p: dict[str, Any]) -> str:
        lines = [f"DAMAGED {d['path']}: {d['problem']}" for d in p["damaged"]] + _pending_text(p["pending"])
        lines.append(
            f"seq {p['seq']}: {p['index_files']} index files and {p['data_files']} data files intact "
            f"({p['bytes_checked']:,} bytes checked), {len(p['damaged'])} damaged"
        )
        return "\n".join(lines)

    output(as_json).emit(check.to_dict() | {"pending": pending}, text)
    if not check.ok:
        sys.exit(4)


def _services_of(table: Any) -> dict[str, Any]:
    """`stats`' `services` (the table service settings), or None and `services_error` when services.json is
    damaged: stats still shows the table, and says why no service runs and how to fix it."""
    from dbidx.errors import CorruptFileError

    try:
        return {"services": table.service_settings().to_dict()}
    except CorruptFileError as exc:
        return {"services": None, "services_error": str(exc)}
