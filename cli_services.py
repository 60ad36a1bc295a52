"""`dbidx config` and `dbidx maintain`: the table services' settings, and a run of the services (once, or in a loop
for pipelines whose writes should never wait for maintenance)."""

from __future__ import annotations

import time
from typing import Any

import click

from dbidx.cli_output import json_option, open_table, output, table_argument


@click.command("config")
@table_argument()
@click.argument("settings", nargs=-1, metavar="[KEY=VALUE]...")
@json_option
def config_cmd(uri: str, settings: tuple[str, ...], as_json: bool) -> None:
    """Show the table service settings and Delta table properties, or change them (KEY=VALUE; a key with a dot,
    such as delta.logRetentionDuration, is a Delta table property; VALUE `default` resets a key); docs/CONFIG.md."""
    from dbidx.data.deletion_vectors import VECTOR_STORAGE
    from dbidx.table.service_settings import parse_text, read_settings, write_settings

    table = open_table(uri)
    changes: dict[str, Any] = {}
    properties: dict[str, str | None] = {}
    for item in settings:
        key, sep, text = (part.strip() for part in item.partition("="))
        if not sep:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="SETTINGS")
        if "." in key:
            properties[key] = None if text.lower() == "default" else text
        else:
            changes[key] = parse_text(key, text)
    moved = 0
    if properties:
        table.set_delta_properties(properties)
        if VECTOR_STORAGE in properties:  # the vectors logged in the other form move at once (one version)
            moved = table.match_vector_storage().moved
    current = write_settings(table.io, changes) if changes else read_settings(table.io)
    payload = {
        "uri": table.uri,
        "settings": current.to_dict(),
        "changed": sorted(changes | properties),
        "non_default": sorted(current.changed()),
        "delta_properties": table.delta_properties(),
        "vectors_moved": moved,
    }
    output(as_json).emit(
        payload,
        lambda p: "\n".join(
            [f"{k} = {v}{'' if k not in p['non_default'] else '  (set)'}" for k, v in p["settings"].items()]
            + [f"{k} = {v}  (Delta table property)" for k, v in sorted(p["delta_properties"].items())]
        ),
    )


@click.command("maintain")
@table_argument()
@click.option(
    "--budget-seconds",
    type=click.FloatRange(min=0.001),
    default=None,
    help="Start no new service step after this many seconds (default: the table's budget_seconds).",
)
@click.option(
    "--budget-files",
    type=click.IntRange(min=1),
    default=None,
    help="Rewrite at most this many data files per run (default: the table's budget_files).",
)
@click.option("--loop", is_flag=True, help="Run again every --interval seconds until Ctrl-C.")
@click.option(
    "--interval",
    type=click.FloatRange(min=0),
    default=60.0,
    show_default=True,
    help="With --loop: seconds between the end of a run and the start of the next.",
)
@click.option("--max-runs", type=click.IntRange(min=1), default=None, help="With --loop: stop after this many runs.")
@json_option
def maintain_cmd(
    uri: str,
    budget_seconds: float | None,
    budget_files: int | None,
    loop: bool,
    interval: float,
    max_runs: int | None,
    as_json: bool,
) -> None:
    """Run the table services the table needs now (data compaction, index compaction, clean, Delta log cleanup,
    vacuum) within a budget."""
    from dbidx.table.service_settings import read_settings
    from dbidx.table.services import run_services

    table, out, runs = open_table(uri), output(as_json), []
    try:
        while True:  # the settings are read again each run: `dbidx config` applies to a running loop
            runs.append(run_services(table, read_settings(table.io), budget_seconds, budget_files).to_dict())
            if loop and not out.as_json:
                click.echo(_run_text(runs[-1]))
            if not loop or (max_runs is not None and len(runs) >= max_runs):
                break
            time.sleep(interval)
    except KeyboardInterrupt:  # Ctrl-C ends the loop; a service cut short is rolled back by the next writer
        if not runs:
            raise
    payload = runs[-1] | {"uri": table.uri, "runs": len(runs)}
    if loop and out.as_json:
        payload["all_runs"] = runs
    out.emit(payload, lambda p: f"{p['runs']} runs" if loop else _run_text(p))


def _run_text(p: dict[str, Any]) -> str:
    lines = [
        f"{r['service']} {r['instant']} in {r['seconds']:.2f} s: "
        + ", ".join(f"{k} {v}" for k, v in r["details"].items() if k != "partitions")
        for r in p["ran"]
    ]
    lines += [f"{y['service']} yielded to a concurrent run (next run retries): {y['error']}" for y in p["yielded"]]
    lines += [
        f"{left['service']} left for the next run ({left['reason']}): "
        + ", ".join(f"{k} {v}" for k, v in left.items() if k not in ("service", "reason"))
        for left in p["left"]
    ]
    return "\n".join(lines + [f"services run in {p['seconds']:.2f} s" + ("" if p["ran"] else ": nothing to do")])


@click.command("vacuum")
@table_argument()
@click.option(
    "--retention-hours",
    type=int,
    default=168,
    show_default=True,
    help="Delete only files unreferenced for longer than this (whole hours, at least 1).",
)
@click.option("--dry-run", is_flag=True, help="List what would be deleted; delete nothing.")
@json_option
def vacuum_cmd(uri: str, retention_hours: int, dry_run: bool, as_json: bool) -> None:
    """Delete files the table no longer references, unreferenced for over --retention-hours (Delta's VACUUM)."""
    from dbidx.table.vacuum import vacuum

    table = open_table(uri)
    payload = vacuum(table, retention_hours=retention_hours, dry_run=dry_run).to_dict() | {"uri": table.uri}
    verb = "would delete" if dry_run else "deleted"
    output(as_json).emit(
        payload,
        lambda p: "\n".join(
            [f"{verb} {path}" for path in p["deleted"]]
            + [f"kept {k['path']}: {k['reason']}" for k in p["protected"]]
            + [
                f"{verb} {len(p['deleted'])} files ({p['bytes']:,} bytes) unreferenced for over {retention_hours} h; "
                f"kept {len(p['protected'])} that delta-rs listed; {p['seconds']:.2f} s"
            ]
        ),
    )


@click.command("clean")
@table_argument()
@click.option(
    "--retain",
    type=click.IntRange(min=0),
    default=10,
    show_default=True,
    help="Keep replaced index files this many completions (caches catching up, index snapshots); data and "
    "deletion-vector files at least as many too, and always for the table's delta.deletedFileRetentionDuration "
    "(Delta's default: 1 week), which Delta readers of older versions rely on.",
)
@click.option(
    "--delete-migrated",
    is_flag=True,
    help="Also delete the user's source files a build-index listed once a data compaction replaced them.",
)
@json_option
def clean_cmd(uri: str, retain: int, delete_migrated: bool, as_json: bool) -> None:
    """Delete the files compactions replaced (the clean service, on demand): index files --retain completions
    later, data and deletion-vector files once the table's delta.deletedFileRetentionDuration has passed as well."""
    from dbidx.index.clean import plan_clean

    table = open_table(uri)
    record = table.clean(retain_completions=retain, delete_migrated=delete_migrated)
    plan = plan_clean(table, retain, delete_migrated)  # what is left: the files the retention still keeps
    payload = {
        "uri": table.uri,
        "instant": record.instant if record else None,
        "deleted": list(record.deleted) if record else [],
        "waiting": plan.waiting,
        "retention": plan.retention,
    }
    output(as_json).emit(
        payload,
        lambda p: "\n".join(
            [f"deleted {path}" for path in p["deleted"]]
            + [
                f"clean {p['instant']}: {len(p['deleted'])} files deleted; {p['waiting']} replaced data and "
                f"deletion-vector files kept for delta.deletedFileRetentionDuration ({p['retention']})"
                if p["instant"]
                else plan.nothing_to_do()
            ]
        ),
    )
