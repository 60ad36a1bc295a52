"""Which partitions a time-bounded bootstrap picks: dates in every path form, non-date and mixed paths."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from dbidx.bootstrap.partition_dates import partition_time
from dbidx.bootstrap.selection import BY_COMMIT, BY_PATH, select_partitions
from dbidx.errors import ConfigError, InvalidInputError
from dbidx.storage.index_view import PartitionStats

DAY = datetime(2025, 1, 15, tzinfo=timezone.utc)
HOUR7 = datetime(2025, 1, 15, 7, tzinfo=timezone.utc)


@pytest.mark.parametrize(
    "path, start, granularity",
    [
        ("dt=2025-01-15", DAY, "day"),
        ("date=20250115", DAY, "day"),
        ("2025/01/15", DAY, "day"),
        ("year=2025/month=01/day=15", DAY, "day"),
        ("year=2025/month=1/day=15/hour=7", HOUR7, "hour"),
        ("dt=2025-01-15/hr=07", HOUR7, "hour"),
        ("dt=2025-01-15/hour=07", HOUR7, "hour"),
        ("dt=2025-01-15-07", HOUR7, "hour"),
        ("ds=2025-01-15T07", HOUR7, "hour"),
        ("2025011507", HOUR7, "hour"),
        ("date=20250115/hh=07", HOUR7, "hour"),
        ("2025/01/15/07", HOUR7, "hour"),
        ("region=eu/dt=2025-01-15", DAY, "day"),
        ("region=eu/dt=2025-01-15/hr=07/type=click", HOUR7, "hour"),
        ("tenant=42/2025/01/15", DAY, "day"),
        ("2025-01-15", DAY, "day"),
    ],
)
def test_dates_are_recognised_in_every_path_form(path, start, granularity):
    found = partition_time(path)
    assert found is not None, path
    assert (found.start, found.granularity) == (start, granularity)


@pytest.mark.parametrize(
    "path",
    [
        "region=eu",
        "",
        "id=12345678",
        "dt=2025-02-30",
        "dt=2025-13-01",
        "2025/13/45",
        "dt=2025-01-15x",
        "year=2025",
        "v=1.2.3",
        "dt=1850-01-01",
        "dt=2025-01-15/hr=25",
    ],
)
def test_paths_without_a_real_date_are_not_dated(path):
    found = partition_time(path)
    # an invalid hour falls back to no date at all rather than a wrong hour
    assert found is None, (path, found)


def test_the_leftmost_date_wins_in_nested_paths():
    assert partition_time("dt=2025-01-15/backfill=2024-12-31").day.isoformat() == "2025-01-15"


@pytest.mark.parametrize(
    "pattern, path, expected",
    [
        ("ds=%Y.%m.%d", "region=eu/ds=2025.01.15", DAY),
        ("p_%Y_%j", "p_2025_015", DAY),
        ("%Y%m%d-%H", "x/20250115-07", HOUR7),
        ("re:day_(?P<year>\\d{4})(?P<month>\\d\\d)(?P<day>\\d\\d)", "a=1/day_20250115", DAY),
    ],
)
def test_user_patterns_strftime_and_regex(pattern, path, expected):
    assert partition_time(path, pattern).start == expected


def test_a_user_pattern_replaces_the_built_in_forms():
    assert partition_time("dt=2025-01-15", "ds=%Y.%m.%d") is None


@pytest.mark.parametrize("pattern", ["dt=%Y-%m", "dt=%Y-%b-%d", "re:(?P<year>\\d{4}", "re:plain"])
def test_bad_user_patterns_are_config_errors(pattern):
    with pytest.raises(ConfigError, match="partition pattern"):
        partition_time("dt=2025-01-15", pattern)


def _stats(partition: str, last_commit: str = "2025-01-01T00:00:00+00:00", live: int = 10) -> PartitionStats:
    ms = int(datetime.fromisoformat(last_commit).timestamp() * 1000)
    return PartitionStats(partition, "20250101000000000", ms, live)


def test_last_x_days_counts_today_and_takes_dated_paths_by_date_and_others_by_last_commit():
    stats = [_stats(f"dt=2025-01-{d:02d}") for d in range(1, 24)]
    stats += [
        _stats("region=eu", last_commit="2025-01-20T10:00:00+00:00"),  # written 2 days ago: in
        _stats("region=us", last_commit="2025-01-10T10:00:00+00:00"),  # last written 12 days ago: out
        _stats("region=eu/dt=2025-01-21/hr=03"),  # dated by path, not by commit time
        _stats("region=eu/dt=2025-01-02", last_commit="2025-01-22T00:00:00+00:00"),  # old date, fresh commit: out
    ]
    selection = select_partitions(stats, days=7, now="2025-01-22")
    chosen = {s.partition: s.reason for s in selection.selected}
    assert chosen == {
        **{f"dt=2025-01-{d:02d}": BY_PATH for d in range(16, 24)},  # 16..22 plus the future-dated 23rd
        "region=eu": BY_COMMIT,
        "region=eu/dt=2025-01-21/hr=03": BY_PATH,
    }
    assert selection.first_day.isoformat() == "2025-01-16"
    assert selection.oldest == "dt=2025-01-16"
    assert selection.outside == len(stats) - len(chosen)
    assert [s.day for s in selection.selected] == sorted((s.day for s in selection.selected), reverse=True)


def test_zero_days_selects_nothing_and_bad_inputs_are_rejected():
    assert select_partitions([_stats("dt=2025-01-22")], days=0, now="2025-01-22").selected == []
    with pytest.raises(InvalidInputError, match="days"):
        select_partitions([], days=-1)
    with pytest.raises(InvalidInputError, match="--now"):
        select_partitions([], days=1, now="yesterday")


def test_one_day_is_today_only_and_a_timezone_aware_now_is_read_as_utc():
    stats = [_stats("dt=2025-01-21"), _stats("dt=2025-01-22")]
    assert [s.partition for s in select_partitions(stats, 1, "2025-01-22T23:30:00").selected] == ["dt=2025-01-22"]
    # 2025-01-22 01:00 in UTC+02:00 is still the 21st in UTC (and the 22nd, dated ahead of the clock, counts too)
    late = select_partitions(stats, 1, "2025-01-22T01:00:00+02:00")
    assert late.first_day.isoformat() == "2025-01-21"
    assert [s.partition for s in late.selected] == ["dt=2025-01-22", "dt=2025-01-21"]
