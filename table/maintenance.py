"""The Table's maintenance entry points: unfinished instants (list, roll back), both compactions and the clean, the
Delta table properties, vacuum, the table services and the sweep of what dead writers left. A mixin of
`table.facade.Table`, kept apart so the facade stays small; the work itself is in the modules each method names."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from dbidx.data.compaction import DataCompactionResult, compact_data
from dbidx.index.clean import clean
from dbidx.index.compaction import CompactionResult, compact
from dbidx.progress import Progress
from dbidx.runner import WorkRunner
from dbidx.storage.leftovers import DEFAULT_TEMP_AGE_S, SweepReport, sweep_leftovers
from dbidx.storage.pending import AbandonedReport, PendingAttempt, pending_attempts, roll_back_abandoned
from dbidx.errors import InstantStateError
from dbidx.storage.records import ACTION_ROLLBACK, CompletedInstant
from dbidx.table.delta_properties import set_delta_properties
from dbidx.table.service_settings import ServiceSettings, read_settings, write_settings
from dbidx.table.services import ServicesReport, run_services


@dataclass
class PendingRecovery:
    """What ending the pending instants did: rolled back, published (instant, seq: it had committed), left alive."""

    rolled_back: list[str] = field(default_factory=list)
    published: list[tuple[str, int]] = field(default_factory=list)
    skipped_alive: list[str] = field(default_factory=list)


class TableMaintenance:
    """Table methods that maintain it: rollback, compact, compact_data, clean, properties, vacuum, services, sweep."""

    def pending_attempts(self) -> list[PendingAttempt]:
        """Unfinished instants (crashed or running writers) with their writer, age, files and what to run."""
        return pending_attempts(self.io, self.timeline)

    def roll_back_abandoned(self) -> AbandonedReport:
        """Roll back the unfinished attempts whose writers are gone (heartbeat expired, or pid gone on this host):
        what every upsert runs before it starts. Live ones are left alone; a failure is a warning, never an error."""
        return roll_back_abandoned(self.timeline, pending_attempts(self.io, self.timeline, with_files=False))

    def rollback_pending(self, force: bool = False) -> tuple[list[str], list[str]]:
        """Roll back every unfinished instant whose writer is not provably alive (all of them with force=True);
        returns (rolled back, skipped as alive). `recover_pending` also says which ones had committed."""
        recovered = self.recover_pending(force=force)
        return recovered.rolled_back, recovered.skipped_alive

    def recover_pending(self, force: bool = False) -> PendingRecovery:
        """What `dbidx rollback --all-pending` runs: every unfinished instant whose writer is not provably alive
        (all of them with force=True) ends. One whose Delta version is on storage committed (its writer died
        between its commit point and its record): its staged record is published, never rolled back; the others
        are rolled back with their files."""
        attempts = self.pending_attempts()
        alive = [a.instant for a in attempts if a.alive and not force]
        targets = [a.instant for a in attempts if a.instant not in alive]
        self.absorb_delta_log()  # publishes the staged record of every instant whose Delta version is on storage
        out = PendingRecovery(skipped_alive=alive)
        for instant in targets:
            done = self.timeline.record_of(instant)
            if done is None:
                try:
                    out.rolled_back.append(self.rollback(instant, also_dead=targets).rolled_back)
                    continue
                except InstantStateError:  # it committed meanwhile (its record published by the rollback's claim)
                    self.timeline.refresh()
                    done = self.timeline.record_of(instant)
                    if done is None or done.action == ACTION_ROLLBACK:
                        raise
            if done.action == ACTION_ROLLBACK:
                out.rolled_back.append(instant)
            else:
                out.published.append((instant, done.seq))
        return out

    def rollback(self, instant: str, also_dead: Iterable[str] = ()) -> CompletedInstant:
        """Roll back an unfinished instant (e.g. of a crashed writer) and delete its files. `also_dead`: other
        pending instants the caller knows are dead (e.g. all of them, when no writer runs), which then do not count
        as active writers on a filesystem without an exclusive create."""
        return self.timeline.rollback(instant, ignore=also_dead)

    def compact(
        self,
        partitions: Iterable[str] | None = None,
        min_files: int = 2,
        progress: Progress | None = None,
        runner: WorkRunner | None = None,
        base_share: float | None = None,
    ) -> CompactionResult:
        """Merge each (partition, shard) with at least `min_files` index files into one base without tombstones,
        as one compaction instant; concurrent commits are not in conflict with it (see index.compaction). `runner`:
        where the merges run (dbidx.runner; default here; `spark_integration.service_jobs` as a Spark job).
        base_share: size-tiered, the base is rewritten only once the files after it hold this share of its entries,
        before that a group's newest files are merged into one merged file (None: always into a new base)."""
        result = compact(self, partitions, min_files=min_files, progress=progress, runner=runner, base_share=base_share)
        self._sweep_after("index compaction")
        return result

    def compact_data(
        self,
        partitions: Iterable[str] | None = None,
        min_files: int = 2,
        deleted_share: float | None = 0.2,
        target_file_bytes: int | None = 64 << 20,
        progress: Progress | None = None,
        runner: WorkRunner | None = None,
        base_share: float | None = None,
    ) -> DataCompactionResult:
        """Rewrite, per file group, its small data files (under `target_file_bytes`) when there are at least
        `min_files` of them, and every file with at least `deleted_share` of its rows deleted, into one base of their
        live rows, as one data compaction instant that concurrent upserts do not conflict with (see
        data.compaction). `runner`: where the rewrites run (as for `compact`). base_share: a group's largest small
        file stays while the rest hold less than this share of its bytes (None: one file per group results)."""
        result = compact_data(
            self,
            partitions,
            min_files=min_files,
            deleted_share=deleted_share,
            target_file_bytes=target_file_bytes,
            progress=progress,
            runner=runner,
            base_share=base_share,
        )
        self._sweep_after("data compaction")
        return result

    def clean(self, retain_completions: int = 10, delete_migrated: bool = False) -> CompletedInstant | None:
        """Delete the files compactions replaced: index files `retain_completions` completions later, data and
        deletion-vector files only once that many completions passed *and* the table's
        `delta.deletedFileRetentionDuration` (Delta's default: one week) since the completion that replaced them, so
        every Delta version within the retention stays readable (index/clean.py says why). The user's source files
        build-index listed go only with delete_migrated=True. Returns the clean's record, or None when nothing was
        old enough. Caches behind it reload (`dbidx cache sync`)."""
        record = clean(self, retain_completions=retain_completions, delete_migrated=delete_migrated)
        self._sweep_after("clean")
        return record

    def delta_properties(self) -> dict[str, str]:
        """The Delta table properties in force (metaData.configuration; other engines' changes absorbed first)."""
        self.follow_delta_log()
        return self.data_view().configuration()

    def set_delta_properties(self, changes: Mapping[str, str | None]) -> CompletedInstant | None:
        """Set (None: remove) Delta table properties, e.g. {"delta.logRetentionDuration": "interval 7 days"}, as one
        completion every engine sees (table/delta_properties.py says which keys); None if nothing changed."""
        return set_delta_properties(self, changes)

    def vacuum(self, retention_hours: int = 168, dry_run: bool = False) -> Any:
        """Delete files no Delta version references any more that were removed (or, never referenced, written)
        longer than `retention_hours` ago: Delta's VACUUM, checked against dbidx's own view (table/vacuum.py)."""
        from dbidx.table.vacuum import vacuum

        return vacuum(self, retention_hours=retention_hours, dry_run=dry_run)

    def service_settings(self) -> ServiceSettings:
        """What the table services do by themselves (`.dbidx/services.json`; defaults when never set)."""
        return read_settings(self.io)

    def configure_services(self, **changes: Any) -> ServiceSettings:
        """Change table service settings by key (table.service_settings.KEYS; None resets a key to its default),
        checked before anything is written (ConfigError); returns the settings now in force."""
        return write_settings(self.io, changes)

    def maintain(
        self,
        budget_seconds: float | None = None,
        budget_files: int | None = None,
        progress: Progress | None = None,
        runner: WorkRunner | None = None,
    ) -> ServicesReport:
        """Run the table services the table needs now (data compaction, index compaction, clean, log cleanup,
        vacuum), within the budget (the settings' unless given); what the budget leaves is in the report, for the
        next run. `runner`: where the compactions' pieces run (`spark_integration.maintain` passes Spark's)."""
        return run_services(self, self.service_settings(), budget_seconds, budget_files, progress, runner)

    def sweep_leftovers(self, min_age_s: float = DEFAULT_TEMP_AGE_S, all_cleans: bool = False) -> SweepReport:
        """Delete what dead writers left (storage/leftovers.py): the unfinished instants of writers that are gone
        (rolled back, as every upsert does first), settled instants' timeline files, markers and unlisted files,
        what a clean killed after publishing had still to delete, and `.tmp-*` files older than min_age_s. Clean
        and both compactions run it; so does `dbidx repair`, with all_cleans=True (every clean record's files still
        on storage, also of cleans that died before their claim told the sweep)."""
        return sweep_leftovers(self.io, self.timeline, min_age_s, all_cleans=all_cleans)

    def _referenced_paths(self) -> set[str]:
        """Every path the current view names (index, data and DV files not cleaned): what no sweep may delete."""
        with self._view_lock:
            return self.refresh(force=True).referenced_paths() | self.data_view().referenced_paths()

    def _sweep_after(self, what: str) -> None:
        """The sweep after a maintenance instant: that instant is done, so a failing sweep is a warning."""
        try:
            self.sweep_leftovers()
        except Exception as exc:  # noqa: BLE001 - the maintenance instant completed; the sweep runs again next time
            warnings.warn(
                f"{what} of {self.uri} completed, but sweeping leftovers failed: {exc}", RuntimeWarning, stacklevel=3
            )
