"""The `dbidx` command line: each command is a few lines over a library call, printed as text or JSON.

Exit codes: 0 ok, 1 unexpected dbidx error, 2 bad input or config, 3 table missing/exists, 4 corrupt data or
history compacted away, 5 concurrency conflict, incomplete commit or bad instant state, 6 cache problem (busy, of
another table, missing or damaged). `cache verify` and `lookup` exit 1 when the answer is "differs" or "not
found"; `verify` exits 4 when a table file is damaged.

The commands are defined here and in modules of their own, registered on `main` below: cli_table.py (commits,
stats, verify), cli_services.py (config, maintain, vacuum, clean) and cli_cache.py (cache ..., bootstrap).
"""

from __future__ import annotations

import errno
import sys
import traceback
from dataclasses import asdict
from functools import partial
from typing import Any

import click

from dbidx import cli_cache, cli_services, cli_table
from dbidx.version import __version__
from dbidx.cli_output import (
    Output,
    ProgressBar,
    json_option,
    open_table,
    output,
    storage_options,
    table_argument,
    wants_json,
)
from dbidx.errors import DbidxError


class DbidxGroup(click.Group):
    """The top-level command group: one place that turns every failure into a line (or one JSON object with
    --json) and an exit code, never a traceback, unless --verbose asks for it or the failure is a bug.

    DbidxError -> its exit code; OSError (not a directory, permission denied, ...) -> 2, out of disk space -> 6;
    click usage errors -> 2; anything else -> 1 with "please report" (the traceback with --verbose).
    """

    def main(
        self,
        args: Any = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        if "--verbose" in argv[1:]:  # accepted anywhere, as the bug hint says "run it again with --verbose"
            argv = ["--verbose"] + [a for a in argv if a != "--verbose"]
        out = Output("--json" in argv)
        try:
            result = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            out.fail(type(exc).__name__, exc.format_message(), exc.exit_code, usage=exc)
        except click.Abort:
            out.fail("Aborted", "aborted", 1)
        except DbidxError as exc:
            out.fail(type(exc).__name__, str(exc), exc.exit_code)
        except OSError as exc:
            code = 6 if exc.errno in (errno.ENOSPC, errno.EDQUOT) else 2
            where = f": {exc.filename}" if getattr(exc, "filename", None) else ""
            out.fail(type(exc).__name__, f"{exc.strerror or exc}{where}", code)
        except Exception as exc:  # noqa: BLE001 - the last line of defence: a bug, reported as one
            if "--verbose" in argv:
                traceback.print_exc()
            out.fail(
                type(exc).__name__,
                f"unexpected {type(exc).__name__}: {exc}. This is a bug in dbidx; please "
                "report it with the output of the same command run with --verbose",
                1,
            )
        sys.exit(result if isinstance(result, int) else 0)


@click.group(cls=DbidxGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dbidx")
@click.option("--verbose", is_flag=True, help="Print the traceback of an unexpected error (for a bug report).")
@click.option(
    "--json", "as_json", is_flag=True, help="Print every result as one JSON object (as each command's --json does)."
)
@click.option(
    "--storage-option",
    "storage_options",
    multiple=True,
    metavar="KEY=VALUE",
    help="Object-store option for the table (endpoint, region, access_key_id, secret_access_key, "
    "allow_http, ...; repeatable). The AWS_*/GOOGLE_*/AZURE_* environment variables work too.",
)
@click.pass_context
def main(ctx: click.Context, verbose: bool, as_json: bool, storage_options: tuple[str, ...]) -> None:
    """dbidx: executor-local RocksDB record-index cache for PySpark upserts, over a persisted record index."""
    options = {}
    for item in storage_options:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--storage-option")
        options[key.strip()] = value
    ctx.obj = {"storage_options": options, "json": as_json}


@main.command("init")
@click.argument("uri")
@click.option(
    "--num-shards",
    default=4,
    show_default=True,
    type=click.IntRange(min=1),
    help="Key shards of the index (fixed forever).",
)
@click.option("--global-index", is_flag=True, help="One index across all partitions (keys unique table-wide).")
@json_option
def init_cmd(uri: str, num_shards: int, global_index: bool, as_json: bool) -> None:
    """Create an empty dbidx table (its metadata folder) at URI."""
    from dbidx.table.facade import Table

    table = Table.create(uri, num_shards=num_shards, global_index=global_index, storage_options=storage_options())
    output(as_json).emit(
        asdict(table.props) | {"uri": table.uri},
        lambda p: f"created {p['index_mode']} table {p['uri']} with {p['num_shards']} shards",
    )


@main.command("build-index")
@click.argument("uri")
@click.option("--key", "key_column", required=True, help="Record key column of the data files.")
@click.option(
    "--partition-col",
    "partition_columns",
    multiple=True,
    help="Hive partition column(s), outermost first; checked against the directory layout.",
)
@click.option(
    "--num-shards",
    default=None,
    type=click.IntRange(min=1),
    help="Key shards of the new index (default 4; with --readopt, the old index's).",
)
@click.option("--global-index", is_flag=True, help="Build a global index (keys unique table-wide).")
@click.option(
    "--readopt",
    is_flag=True,
    help="Rebuild the index of an indexed table from its Delta table as it is now (the old index folder "
    "is moved aside; shards and mode kept unless given): the remedy for versions dbidx cannot absorb.",
)
@json_option
def build_index_cmd(
    uri: str,
    key_column: str,
    partition_columns: tuple[str, ...],
    num_shards: int | None,
    global_index: bool,
    readopt: bool,
    as_json: bool,
) -> None:
    """Build the record-level index of the Parquet data set at URI, or adopt the Delta table at URI."""
    from dbidx.table.build_index import build_index
    from dbidx.table.readopt import readopt as readopt_table
    from dbidx.table.facade import Table

    moved = None
    with ProgressBar("build-index", wants_json(as_json)) as progress:
        if readopt:
            done = readopt_table(
                uri,
                key_column,
                partition_columns or None,
                num_shards,
                global_index or None,
                storage_options(),
                progress,
            )
            table, result, moved = done.table, done.build, done.moved_to
        else:
            table = Table.open_or_create(
                uri, num_shards=num_shards or 4, global_index=global_index, storage_options=storage_options()
            )
            result = build_index(table, key_column, partition_columns or None, progress=progress)
    payload = {
        "instant": result.instant,
        "files": result.files,
        "partitions": result.partitions,
        "keys": result.keys,
        "uri": table.uri,
        "old_index_moved_to": moved,
    }
    output(as_json).emit(
        payload,
        lambda p: (
            f"indexed {p['keys']} keys from {p['files']} files in {p['partitions']} partitions (instant {p['instant']})"
        ),
    )


@main.command("lookup")
@table_argument()
@click.argument("keys", nargs=-1)
@click.option("--partition", default=None, help="Partition path of the keys (required unless global index).")
@click.option("--mode", type=click.Choice(["auto", "seek", "scan"]), default="auto", show_default=True)
@json_option
def lookup_cmd(uri: str, keys: tuple[str, ...], partition: str | None, mode: str, as_json: bool) -> None:
    """Print where KEYS are in the table at URI (keys not in the index are new; a partition the table does not
    have is said to be missing, with its nearest existing partitions). Exit 1 when no key is found."""
    from dbidx.index.point_lookup import lookup_report

    if not keys:
        raise click.UsageError("name at least one KEY after the URI: dbidx lookup URI KEY... [--partition P]")
    report = lookup_report(open_table(uri), list(keys), partition, mode)
    output(as_json).emit(report.to_dict(), _lookup_text)
    if report.missing and not report.found:
        sys.exit(1)


def _lookup_text(p: dict[str, Any]) -> str:
    lines = [f"{r['key']}\t{r.get('partition', p['partition'])}\t{r['file_group']}\t{r['instant']}" for r in p["found"]]
    if p["partition_in_table"] is False:
        near = ", ".join(p["nearest_partitions"]) or "none: the table has no partitions yet"
        return "\n".join(
            lines
            + [f"{k}\t(not in index: partition {p['partition']} is not in the table)" for k in p["missing"]]
            + [
                f"partition {p['partition']!r} is not in the table; "
                f"nearest existing partitions: {near} (`dbidx stats URI` lists them all)"
            ]
        )
    return "\n".join(lines + [f"{k}\t(not in index: new key)" for k in p["missing"]])


@main.command("compact")
@click.argument("uri")
@click.option("--partition", "partitions", multiple=True, help="Only these partitions (default: all).")
@click.option(
    "--min-files",
    default=2,
    show_default=True,
    type=click.IntRange(min=1),
    help="Compact groups with at least this many files.",
)
@click.option("--clean/--no-clean", default=True, show_default=True, help="Then delete replaced files.")
@click.option(
    "--retain",
    default=10,
    show_default=True,
    type=click.IntRange(min=0),
    help="The clean's --retain: replaced index files are kept this many completions, data and deletion-vector "
    "files as many and for the table's delta.deletedFileRetentionDuration (`dbidx clean --help`).",
)
@click.option(
    "--data",
    is_flag=True,
    help="Also rewrite, per data file group, its small files when there are at "
    "least --min-files, and each file with at least --deleted-share of its rows deleted, into one base.",
)
@click.option(
    "--deleted-share",
    default=0.2,
    show_default=True,
    type=click.FloatRange(0, 1, min_open=True),
    help="With --data: the share of deleted rows at which a file is rewritten.",
)
@click.option(
    "--target-file-mb",
    default=64,
    show_default=True,
    type=click.IntRange(min=1),
    help="With --data: files this large are left alone unless --deleted-share says otherwise.",
)
@json_option
def compact_cmd(
    uri: str,
    partitions: tuple[str, ...],
    min_files: int,
    clean: bool,
    retain: int,
    data: bool,
    deleted_share: float,
    target_file_mb: int,
    as_json: bool,
) -> None:
    """Merge RLI deltas into base files (dropping tombstones), with --data also data files, then clean old files."""
    table, quiet = open_table(uri), wants_json(as_json)
    with ProgressBar("compact index", quiet) as progress:
        result = table.compact(partitions or None, min_files=min_files, progress=progress)
    data_result = None
    if data:
        with ProgressBar("compact data", quiet) as progress:
            data_result = table.compact_data(
                partitions or None,
                min_files=min_files,
                deleted_share=deleted_share,
                target_file_bytes=target_file_mb << 20,
                progress=progress,
            )
    cleaned = table.clean(retain_completions=retain) if clean else None
    payload = {
        "instant": result.record.instant if result.record else None,
        "groups": result.groups,
        "files_replaced": result.files_replaced,
        "entries_written": result.entries_written,
        "data": vars(data_result)
        | {"record": None, "instant": data_result.record.instant if data_result.record else None}
        if data_result
        else None,
        "files_deleted": len(cleaned.deleted) if cleaned else 0,
    }
    output(as_json).emit(payload, _compact_text)


def _compact_text(p: dict[str, Any]) -> str:
    lines = [f"compacted {p['groups']} index groups ({p['files_replaced']} files -> {p['entries_written']} entries)"]
    if p["data"]:
        d = p["data"]
        lines.append(
            f"compacted {d['file_groups']} data file groups ({d['files_replaced']} files, "
            f"{d['bytes_before']:,} bytes -> {d['rows_written']:,} live rows, {d['bytes_after']:,} bytes)"
        )
    lines.append(f"deleted {p['files_deleted']} old files")
    return "\n".join(lines)


@main.command("rollback")
@click.argument("uri")
@click.argument("instant", required=False)
@click.option(
    "--all-pending",
    is_flag=True,
    help="Roll back every unfinished instant whose writer is not provably alive (a heartbeat renewed "
    "within its expiry, or a pid alive on this host).",
)
@click.option("--force", is_flag=True, help="With --all-pending: also the instants of writers that look alive.")
@json_option
def rollback_cmd(uri: str, instant: str | None, all_pending: bool, force: bool, as_json: bool) -> None:
    """Roll back an unfinished instant (e.g. of a crashed writer) and delete its files."""
    table = open_table(uri)
    if not instant and not all_pending:
        raise click.UsageError("name an INSTANT or pass --all-pending")
    if instant and all_pending:
        raise click.UsageError("name an INSTANT or pass --all-pending, not both")
    if all_pending:
        recovered = table.recover_pending(force=force)
        done, published, alive = recovered.rolled_back, recovered.published, recovered.skipped_alive
    else:
        done, published, alive = [table.rollback(instant).rolled_back], [], []
    output(as_json).emit(
        {"rolled_back": done, "published": [{"instant": i, "seq": s} for i, s in published], "skipped_alive": alive},
        lambda p: (
            "\n".join(
                [f"rolled back {i}" for i in p["rolled_back"]]
                + [
                    f"published {x['instant']} at seq {x['seq']}: it had committed (its Delta version was on "
                    "storage) before its writer died, so its record was published, not rolled back"
                    for x in p["published"]
                ]
                + [
                    f"skipped {i}: its writer looks alive (heartbeat renewed, or its pid "
                    "runs on this host); --force to roll it back anyway"
                    for i in p["skipped_alive"]
                ]
            )
            or "nothing to roll back: no instant is pending"
        ),
    )


@main.command("repair")
@click.argument("uri")
@json_option
def repair_cmd(uri: str, as_json: bool) -> None:
    """Write the Delta log versions (_delta_log/) that completed instants lack (after a crash between the two), then
    sweep what dead writers left (unfinished instants of writers that are gone, rolled back; settled instants'
    timeline files and markers; files a published clean lists that are still there; temp files older than an hour;
    requested/inflight files of instant ids at the end of the 17-digit range that no completion names)."""
    from dbidx.storage.instant_range import remove_strays

    table = open_table(uri)
    strays = remove_strays(table.io, table.timeline)  # 1. first: they stop every writer
    absorbed = table.absorb_delta_log()
    written = table.sync_delta_log()
    swept = table.sweep_leftovers(all_cleans=True)
    output(as_json).emit(
        {
            "versions_written": written,
            "versions_absorbed": len(absorbed),
            "version": table.delta_version(),
            "leftovers_deleted": swept.total,
            "swept": swept.counts(),
            "rolled_back": swept.rolled_back,
            "out_of_range_removed": strays,
        },
        _repair_text,
    )


_SWEPT_WORDS = {
    "rolled_back": "unfinished instant(s) of writers that are gone, rolled back",
    "settled_files": "unlisted file(s) of settled instants",
    "timeline_files": "timeline file(s) (claims, markers' instants, heartbeats, staged records) of settled instants",
    "cleaned_files": "file(s) a clean listed and died before deleting",
    "temp_files": "temp file(s) over an hour old",
}


def _repair_text(p: dict[str, Any]) -> str:
    lines = [
        f"absorbed {p['versions_absorbed']} Delta version(s) of other writers; wrote {p['versions_written']} "
        f"missing Delta version(s); the table is at version {p['version']}; deleted {p['leftovers_deleted']} "
        "leftover file(s)"
    ]
    lines += [f"  {n} {_SWEPT_WORDS[k]}" for k, n in p["swept"].items() if n]
    lines += [f"removed {s} (an instant id at the end of the 17-digit range)" for s in p["out_of_range_removed"]]
    return "\n".join(lines)


_FORM_WORDS = {"file": "in files", "inline": "inline"}


@main.command("sync")
@table_argument()
@json_option
def sync_cmd(uri: str, as_json: bool) -> None:
    """Bring the index at URI up to its Delta log: absorb the versions other engines (delta-rs, Spark, polars, ...)
    committed since the index's last, and publish the records of dbidx writers that put their Delta version and died
    before publishing (docs/FORMAT.md sections 12 and 12c). Every write and read does this first; run it to see it.
    It also gives every deletion vector of the log the form the table's dbidx.deletionVectors.storage asks for."""
    table = open_table(uri)
    from dbidx.table.delta_sync import LOG_CATCH_UP_EXTRA

    records = table.absorb_delta_log()
    caught_up = table.catch_up_log_vectors()  # vectors an absorb masked a stale rewrite's copies with, into the log
    moved = table.match_vector_storage()
    absorbed = [r for r in records if r.action == "absorb"]
    output(as_json).emit(
        {
            "version": table.delta_version(),
            "absorbed": len(absorbed),
            "published": len(records) - len(absorbed),
            "operations": sorted({str(r.extra.get("absorbed", {}).get("operation", "")) for r in absorbed}),
            "masked_files": len(caught_up.extra.get(LOG_CATCH_UP_EXTRA) or []) if caught_up is not None else 0,
            "vectors_moved": moved.moved,
            "vector_storage": moved.form,
        },
        lambda p: (
            f"absorbed {p['absorbed']} Delta version(s) of other writers"
            + (f" ({', '.join(p['operations'])})" if p["operations"] else "")
            + f", published {p['published']} staged record(s)"
            + (
                f", gave {p['masked_files']} file(s) the deletion vectors that mask a stale rewrite's copies"
                if p["masked_files"]
                else ""
            )
            + (
                f", logged {p['vectors_moved']} deletion vector(s) {_FORM_WORDS[p['vector_storage']]}"
                if p["vectors_moved"]
                else ""
            )
            + f"; the index is at Delta version {p['version']}"
        ),
    )


@main.command("upgrade")
@click.argument("uri")
@click.option(
    "--rollback-pending",
    is_flag=True,
    help="Roll back the instants of format-3 writers that are gone (after the upgrade); without it, "
    "pending instants refuse the upgrade.",
)
@json_option
def upgrade_cmd(uri: str, rollback_pending: bool, as_json: bool) -> None:
    """Convert a format-3 table in place to format 4 (a Delta Lake table with deletion vectors); no data file is
    rewritten. Stop the table's writers first. Run again after a crash: it finishes or starts over safely."""
    from dbidx.table.upgrade import upgrade_table

    with ProgressBar("upgrade", wants_json(as_json)) as progress:
        report = upgrade_table(
            uri, storage_options=storage_options() or None, rollback_pending=rollback_pending, progress=progress
        )
    output(as_json).emit(asdict(report), _upgrade_text)


def _upgrade_text(p: dict[str, Any]) -> str:
    if p["status"] == "already":
        return f"{p['uri']} is in format 4 already (upgraded at completion {p['upgraded_at_seq'] or '-'})"
    return (
        f"{p['status']} {p['uri']} to format 4 at completion {p['upgraded_at_seq']}: {p['files_with_vectors']} of "
        f"{p['data_files']} data files got a deletion vector ({p['rows_hidden']:,} superseded or deleted rows), "
        f"{p['live_rows']:,} live rows; wrote {p['delta_versions']} Delta version(s)"
        + (f"; rolled back {', '.join(p['rolled_back'])}" if p["rolled_back"] else "")
    )


@main.command("demo")
@click.option(
    "--dir",
    "workdir",
    default="demo-output",
    show_default=True,
    help="Where the demo table, caches and Spark scratch go (replaced on every run; a non-empty directory "
    "the demo did not create is refused).",
)
@click.option(
    "--keys", default=200_000, show_default=True, type=click.IntRange(min=1), help="Keys of the initial load."
)
@click.option(
    "--days", default=10, show_default=True, type=click.IntRange(min=1), help="Daily partitions of the initial load."
)
@click.option(
    "--batches", default=6, show_default=True, type=click.IntRange(min=0), help="Change batches after the initial load."
)
@click.option(
    "--batch-rows", type=click.IntRange(min=1), default=None, help="Rows per change batch [default: keys / 4]."
)
@click.option("--force", is_flag=True, help="Use --dir even if it holds files the demo did not create (deleted).")
@json_option
def demo_cmd(
    workdir: str, keys: int, days: int, batches: int, batch_rows: int | None, force: bool, as_json: bool
) -> None:
    """End-to-end demo: a change stream upserted through Spark (batch and streaming), warm restart, checked."""
    from dbidx.demo import run_demo

    # With --json the narrative goes to stderr, so stdout stays one JSON document.
    report = run_demo(
        workdir,
        keys=keys,
        days=days,
        batches=batches,
        batch_rows=batch_rows,
        echo=partial(click.echo, err=wants_json(as_json)),
        force=force,
    )
    if wants_json(as_json):
        Output(True).emit(report, lambda p: "")


main.add_command(cli_table.commits_cmd)
main.add_command(cli_table.stats_cmd)
main.add_command(cli_table.verify_cmd)
main.add_command(cli_cache.cache_group)
main.add_command(cli_services.config_cmd)
main.add_command(cli_services.maintain_cmd)
main.add_command(cli_services.vacuum_cmd)
main.add_command(cli_services.clean_cmd)
# `dbidx bootstrap URI --days 7`, the command the mission names: the very command object of `dbidx cache
# bootstrap`, registered a second time at the top level, so both spellings take the same flags and do the same.
main.add_command(cli_cache.bootstrap_cmd, name="bootstrap")


if __name__ == "__main__":  # pragma: no cover
    main()
