"""The RocksDB cache on real rocksdict directories: layout, key codec, visibility of loads, identity, base path."""

from __future__ import annotations

import os
import uuid

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dbidx.cache import codec
from dbidx.cache.base_dir import default_base_path, prepare_dir
from dbidx.cache.record_cache import RecordIndexCache
from dbidx.cache.registry import CacheIdentity
from dbidx.config import CacheConfig
from dbidx.errors import (
    CacheBusyError,
    CacheError,
    CacheMismatchError,
    ConfigError,
    InvalidInputError,
    PartitionNotReadyError,
)

from tests.cache_helpers import DAY1, DAY2, DAY3, make_table, open_cache, truth

WEIRD_PARTITIONS = [
    "dt=2025-01-01",
    "region=eu/dt=2025-01-01",
    "city=São Paulo",
    "名前=東京/日付=2025",
    "a b=c d",
    "x=" + "long" * 60 + "/y=" + "long" * 60,
    "k=v%2Fencoded",
    "emoji=😀",
]


def ident(shard: int = 0) -> CacheIdentity:
    return CacheIdentity("t" * 32, 4, shard, "partitioned")


@given(
    st.lists(
        st.one_of(
            st.uuids().map(str),
            st.uuids().map(lambda u: str(u).upper()),
            st.integers(0, 10**20 - 1).map(lambda i: str(i).zfill(20)),
            st.integers(0, 10**12).map(str),
            st.text(min_size=1, max_size=40).filter(lambda s: "\x00" not in s),
        ),
        min_size=1,
        max_size=60,
    )
)
@settings(max_examples=150, deadline=None)
def test_key_codec_round_trips_and_is_injective(keys):
    encoded = codec.encode_keys(keys)
    assert [codec.decode_key(e) for e in encoded] == keys
    assert len(set(encoded)) == len(set(keys))


@given(
    st.integers(0, 47).flatmap(
        lambda width: st.lists(
            st.text(alphabet="0123456789abcdef-_", min_size=width, max_size=width).map(lambda k: "X" + k),
            min_size=1,
            max_size=50,
        )
    ),
    st.integers(0, 3),
)
@settings(max_examples=100, deadline=None)
def test_fixed_width_raw_keys_encode_like_any_other_raw_key(keys, skip):
    """Every key raw and of one length (32-hex ids: the rows-at-once path) encodes as the raw class does - the tag
    byte, then the key's bytes - sliced arrays included, and decodes back."""
    array = pa.array(["pad"] * skip + keys).slice(skip)
    encoded = codec.encode_keys_binary(array).to_pylist()
    assert encoded == [b"\x00" + k.encode() for k in keys]
    assert [codec.decode_key(e) for e in encoded] == keys


UUID_LIKE = st.one_of(
    st.uuids().map(str),
    st.tuples(st.uuids().map(str), st.integers(0, 35), st.sampled_from("-AFgz0f\u00e9")).map(
        lambda t: (t[0][: t[1]] + t[2] + t[0][t[1] + 1 :])[:36]
    ),  # one byte changed: a dash moved, upper case, ...
)


@given(st.lists(UUID_LIKE, min_size=1, max_size=30), st.integers(0, 2))
@settings(max_examples=150, deadline=None)
def test_batches_of_36_byte_keys_encode_as_the_general_path(keys, skip):
    """A batch whose every key is 36 bytes takes the all-UUIDs path: it must encode each key exactly as the general
    path does (a stray or moved dash, upper case or a non-hex byte anywhere sends the batch to it), sliced too."""
    keys = [k for k in keys if len(k.encode()) == 36] or [str(uuid.uuid4())]
    fast = codec.encode_keys_binary(pa.array(["pad"] * skip + keys).slice(skip)).to_pylist()
    general = codec.encode_keys_binary(pa.array(keys + ["not 36 bytes"])).to_pylist()[:-1]
    assert fast == general
    assert [codec.decode_key(e) for e in fast] == keys


def test_key_codec_sizes():
    u = str(uuid.uuid4())
    assert len(codec.encode_keys([u])[0]) == 17
    assert len(codec.encode_keys(["00000000000000001234"])[0]) == 11
    assert codec.encode_keys(["abc"])[0] == b"\x00abc"
    assert [codec.decode_index(codec.encode_index(i)) for i in (0, 127, 128, 16383, 70000)] == [
        0,
        127,
        128,
        16383,
        70000,
    ]
    assert len(codec.encode_index(127)) == 1 and len(codec.encode_index(128)) == 2


def test_partitions_with_any_path_get_their_own_family(tmp_path):
    with RecordIndexCache(tmp_path / "c", ident()) as cache:
        for i, partition in enumerate(WEIRD_PARTITIONS):
            cache.load_partition(partition, [f"key-{i}", "shared"], [f"fg-{i}", f"fg-{i}-b"], synced_seq=1)
        families = cache.store.column_families()
    with RecordIndexCache(tmp_path / "c", ident()) as cache:
        assert sorted(cache.partitions()) == sorted(WEIRD_PARTITIONS)
        for i, partition in enumerate(WEIRD_PARTITIONS):
            assert cache.lookup(partition, ["shared", f"key-{i}", "nope"]) == [f"fg-{i}-b", f"fg-{i}", None]
        assert len({cache.partitions()[p].cf for p in WEIRD_PARTITIONS}) == len(WEIRD_PARTITIONS)
    assert len(families) == len(WEIRD_PARTITIONS)
    assert all(len(f.encode()) <= 255 and "/" not in f for f in families)


def test_cache_matches_the_index_and_reports_stats(tmp_path):
    table = make_table(tmp_path)
    with open_cache(table, 1, tmp_path / "cache") as cache:
        expected = truth(table, DAY1, 1)
        snap = table.snapshot(DAY1, shard=1)
        cache.load_partition(DAY1, snap.column("key"), snap.column("file_group"), synced_seq=3)
        keys = list(expected) + ["absent-1", "absent-2"]
        assert cache.lookup(DAY1, keys) == [expected.get(k) for k in keys]
        state = cache.partitions()[DAY1]
        assert state.entries == len(expected) and state.loaded_seq == 3
        assert sum(state.fills.values()) == len(expected) and set(state.fills) == {"fg-1-0", "fg-1-1", "fg-1-2"}
        assert dict(cache.items(DAY1)) == expected
        assert cache.not_ready([DAY1, DAY2, DAY2]) == [DAY2]
        with pytest.raises(PartitionNotReadyError, match="dt=2025-01-02"):
            cache.lookup(DAY2, ["x"])
        assert cache.metrics.to_dict()["per_partition"][DAY1]["hits"] == len(expected)


def test_an_interrupted_load_is_never_visible(tmp_path, monkeypatch):
    cache = RecordIndexCache(tmp_path / "c", ident()).open()
    cache.load_partition(DAY1, ["a", "b"], ["fg-1", "fg-1"], synced_seq=1)
    families_before = set(cache.store.column_families())

    def crash(*_args):
        raise KeyboardInterrupt("killed between SST ingest and the registry flip")

    monkeypatch.setattr(cache.store, "write", crash)
    with pytest.raises(KeyboardInterrupt):
        cache.load_partition(DAY1, ["a", "b", "c"], ["fg-2"] * 3, synced_seq=2)
    with pytest.raises(KeyboardInterrupt):
        cache.load_partition(DAY2, ["z"], ["fg-9"], synced_seq=2)
    assert cache.lookup(DAY1, ["a", "c"]) == ["fg-1", None]  # still the old, complete content
    assert not cache.is_ready(DAY2)
    monkeypatch.undo()
    cache.store.close()  # no clean close: the registry session stays "open"
    cache.store = None
    with RecordIndexCache(tmp_path / "c", ident()) as again:
        assert again.recovered
        assert again.lookup(DAY1, ["a", "b", "c"]) == ["fg-1", "fg-1", None]
        assert not again.is_ready(DAY2)
        assert set(again.store.column_families()) == families_before  # the orphan families were dropped


def test_duplicate_keys_in_a_load_are_rejected_and_leave_nothing(tmp_path):
    with RecordIndexCache(tmp_path / "c", ident()) as cache:
        with pytest.raises(InvalidInputError, match="appears twice"):
            cache.load_partition(DAY1, ["a", "b", "a"], ["x", "y", "z"], synced_seq=1)
        assert not cache.is_ready(DAY1)
        assert cache.store.column_families() == []
        assert not list(cache.scratch_dir.iterdir())


@pytest.mark.parametrize(
    "keys",
    [
        ["a", "b", "b", "c"],  # sorted, with a repeat: not strictly ascending, so the full path finds the repeat
        ["00000000-0000-4000-8000-000000000001", "00000000-0000-4000-8000-000000000001"],
    ],
    ids=["raw", "uuid"],
)
def test_sorted_input_with_a_repeat_is_still_rejected(tmp_path, keys):
    with RecordIndexCache(tmp_path / "c", ident()) as cache:
        with pytest.raises(InvalidInputError, match="appears twice"):
            cache.load_partition(DAY1, keys, ["x"] * len(keys), synced_seq=1)


def test_keys_in_ascending_order_load_as_shuffled_ones_do(tmp_path):
    """An index file's keys arrive sorted as strings; loaded without a second sort, they must read back exactly as
    the same keys loaded in any order (mixed key classes too: their encoded order differs from the text order)."""
    import random
    import uuid as uuid_module

    keys = sorted(
        [str(uuid_module.UUID(int=random.getrandbits(128), version=4)) for _ in range(500)]
        + [f"k{i:04d}" for i in range(300)]
        + [str(i) for i in range(200)]
    )
    locations = [f"fg-{i % 7}" for i in range(len(keys))]
    shuffled = list(zip(keys, locations))
    random.shuffle(shuffled)
    with RecordIndexCache(tmp_path / "c", ident()) as cache:
        for name, (ks, ls) in ((DAY1, (keys, locations)), (DAY2, tuple(map(list, zip(*shuffled))))):
            cache.load_partition(name, ks, ls, synced_seq=1)
        only_uuids = [k for k in keys if len(k) == 36]
        cache.load_partition(DAY3, only_uuids, ["fg-u"] * len(only_uuids), synced_seq=1)
        probe = keys + ["absent", "99999"]
        assert cache.lookup(DAY1, probe) == cache.lookup(DAY2, probe) == locations + [None, None]
        assert dict(cache.items(DAY3)) == {k: "fg-u" for k in only_uuids}


def test_a_directory_never_serves_another_table_or_shard(tmp_path):
    with RecordIndexCache(tmp_path / "c", ident(0)):
        pass
    with pytest.raises(CacheMismatchError, match="shard 0/4"):
        RecordIndexCache(tmp_path / "c", ident(1)).open()
    with pytest.raises(CacheMismatchError):
        RecordIndexCache(tmp_path / "c", CacheIdentity("u" * 32, 4, 0, "partitioned")).open()


def test_a_second_opener_waits_then_gets_a_clear_error(tmp_path):
    config = CacheConfig(lock_timeout_s=0.3)
    with RecordIndexCache(tmp_path / "c", ident(), config):
        with pytest.raises(CacheBusyError, match="in use"):
            RecordIndexCache(tmp_path / "c", ident(), config).open()
    with RecordIndexCache(tmp_path / "c", ident(), config):
        pass  # released on close


def test_base_path_defaults_and_directory_errors(tmp_path, monkeypatch):
    assert (
        default_base_path(environ={"SPARK_LOCAL_DIRS": "/disk1,/disk2", "HOME": "/h"})
        == default_base_path(environ={"SPARK_LOCAL_DIRS": "/disk1"}).parent / "dbidx-cache"
    )
    assert str(default_base_path("/spark/local", environ={"HOME": "/h"})) == "/spark/local/dbidx-cache"
    assert str(default_base_path(environ={"HOME": "/home/u"})) == "/home/u/.cache/dbidx"
    assert str(default_base_path(environ={"XDG_CACHE_HOME": "/x", "HOME": "/h"})) == "/x/dbidx"
    # Inside a Python worker SPARK_LOCAL_DIRS is the executor's block-manager dir, which Spark deletes with the
    # executor: the default climbs above the Spark-owned (prefix + UUID) directories to the node's local dir.
    uid = "0b5e8f0e-3c1d-4c56-9d7a-2f1e0c9b8a71"
    worker = f"/disk1/spark-{uid}/executor-{uid}/blockmgr-{uid}"
    assert str(default_base_path(environ={"SPARK_LOCAL_DIRS": f"{worker},/disk2/x"})) == "/disk1/dbidx-cache"
    assert str(default_base_path(environ={"SPARK_LOCAL_DIRS": f"/l/spark-{uid}/blockmgr-{uid}"})) == "/l/dbidx-cache"
    assert (
        str(default_base_path(environ={"SPARK_LOCAL_DIRS": "/data/spark-local/blockmgr-x"}))
        == "/data/spark-local/blockmgr-x/dbidx-cache"
    )  # not Spark's naming: left alone
    # Kubernetes mounts the pod's volume at /var/data/spark-<uuid> itself: the climb stops at the mount point.
    k8s_mount = f"/var/data/spark-{uid}"
    real_ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: str(p) == k8s_mount or real_ismount(p))
    assert (
        str(default_base_path(environ={"SPARK_LOCAL_DIRS": f"{k8s_mount}/blockmgr-{uid}"}))
        == f"{k8s_mount}/dbidx-cache"
    )
    monkeypatch.undo()
    # The executor's own environment can name it (the driver's config, if it has base.path, still wins).
    assert str(default_base_path(environ={"DBIDX_CACHE_BASE_PATH": "/ssd/c", "SPARK_LOCAL_DIRS": worker})) == "/ssd/c"
    made = prepare_dir(tmp_path / "a" / "b")
    assert oct(made.stat().st_mode & 0o777) == "0o700"
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="cannot be created|not writable"):
            prepare_dir(ro / "cache")
    with pytest.raises(ConfigError, match="MB free"):
        prepare_dir(tmp_path / "full", min_free_mb=1 << 40)


def test_config_from_dict_env_and_spark_conf():
    conf = CacheConfig.from_sources(
        {"hoodie.index.cache.rocksdb.block.cache.mb": "128"},
        spark_conf={
            "hoodie.index.cache.rocksdb.partition.ttl.hours": "12",
            "hoodie.index.cache.rocksdb.block.cache.mb": "1",
        },
        environ={"DBIDX_CACHE_MAX_DISK_MB": "500", "DBIDX_CACHE_COMPRESSION": "LZ4"},
    )
    assert (conf.block_cache_mb, conf.partition_ttl_hours, conf.max_disk_mb, conf.compression) == (
        128,
        12.0,
        500,
        "lz4",
    )
    with pytest.raises(ConfigError, match=r"unknown cache config key .*full name .*short dotted .*field name"):
        CacheConfig.from_sources({"hoodie.index.cache.rocksdb.nope": 1}, environ={})


def test_config_keys_in_every_documented_form():
    for key in ("hoodie.index.cache.rocksdb.base.path", "base.path", "base_path"):
        assert CacheConfig.from_sources({key: "/mnt/c"}, environ={}).base_path == "/mnt/c", key
    assert CacheConfig.from_sources({"partition.ttl.hours": "6"}, environ={}).partition_ttl_hours == 6.0
    for wrong in ("base-path", "basepath", "hoodie.index.cache.rocksdb.base", "base.path_x", "ttl"):
        with pytest.raises(ConfigError, match="base.path"):
            CacheConfig.from_sources({wrong: "/mnt/c"}, environ={})
    with pytest.raises(ConfigError, match="same setting base_path"):
        CacheConfig.from_sources({"base.path": "/a", "base_path": "/b"}, environ={})
    # `enabled` is RFC-107's switch, not a setting: true is accepted and changes nothing (Hudi-style blocks), false
    # is refused rather than ignored, from every source.
    assert (
        CacheConfig.from_sources(
            {"enabled": "true", "hoodie.index.cache.rocksdb.enabled": True}, environ={"DBIDX_CACHE_ENABLED": "1"}
        )
        == CacheConfig()
    )
    for source in (
        {"mapping": {"enabled": False}},
        {"environ": {"DBIDX_CACHE_ENABLED": "no"}},
        {"spark_conf": {"hoodie.index.cache.rocksdb.enabled": "false"}},
    ):
        with pytest.raises(ConfigError, match="no cache-less tagging path"):
            CacheConfig.from_sources(**({"environ": {}} | source))
    # The same precedence as every setting (mapping > Spark conf > environment): the mapping's true stands.
    assert CacheConfig.from_sources({"enabled": True}, environ={"DBIDX_CACHE_ENABLED": "false"}) == CacheConfig()
    with pytest.raises(ConfigError, match="cannot read 'maybe' as bool"):
        CacheConfig.from_sources({"enabled": "maybe"}, environ={})
    with pytest.raises(ConfigError, match="DBIDX_CACHE_BLOCK_CACHE_MB"):
        CacheConfig.from_sources(environ={"DBIDX_CACHE_BLOCK_CACHE_MB": "lots"})
    with pytest.raises(ConfigError, match="compression"):
        CacheConfig(compression="brotli")


def _table_properties(cache: RecordIndexCache, partition: str) -> str:
    view = cache.store.cf(cache.partitions()[partition].cf)
    try:
        return view.property_value("rocksdb.aggregated-table-properties") or ""
    finally:
        del view  # a live family handle keeps the DB's LOCK past close()


def test_loaded_partitions_have_partitioned_index_and_filters(tmp_path):
    """Bulk-loaded SSTs split their index and filter into small blocks, so a partition bigger than the block cache
    does not evict and reload a whole-file filter on every lookup (the measured cliff: docs/DESIGN.md)."""
    keys = [str(uuid.UUID(int=i)) for i in range(20_000)]
    with RecordIndexCache(tmp_path / "c", ident()) as cache:
        cache.load_partition(DAY1, keys, ["fg-a"] * len(keys), synced_seq=1)
        props = _table_properties(cache, DAY1)
    partitions = int(props.split("# index partitions=")[1].split(";")[0])
    assert partitions > 1, props


def test_caches_written_with_whole_file_filters_stay_readable(tmp_path, monkeypatch):
    """An existing cache whose SSTs were written before index/filter partitioning reads the same after upgrade:
    RocksDB takes each SST's index and filter layout from the file itself."""
    import rocksdict as rd

    from dbidx.cache import sst_builder, store

    def old_options(config: CacheConfig, block_cache: rd.Cache | None) -> rd.Options:
        opts = rd.Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.create_missing_column_families(True)
        opts.set_atomic_flush(True)
        table = rd.BlockBasedOptions()
        table.set_bloom_filter(config.bloom_bits_per_key, False)
        if block_cache is not None:
            table.set_block_cache(block_cache)
        table.set_cache_index_and_filter_blocks(True)
        opts.set_block_based_table_factory(table)
        return opts

    keys = [str(uuid.UUID(int=i * 7919)) for i in range(5_000)]
    with monkeypatch.context() as patch:
        patch.setattr(store, "column_family_options", old_options)
        patch.setattr(sst_builder, "column_family_options", old_options)
        patch.setattr(sst_builder, "_OPTIONS", {})
        with RecordIndexCache(tmp_path / "c", ident()) as cache:
            cache.load_partition(DAY1, keys, [f"fg-{i % 3}" for i in range(len(keys))], synced_seq=1)
            assert "# index partitions=" not in _table_properties(cache, DAY1)
    with RecordIndexCache(tmp_path / "c", ident()) as cache:
        assert cache.lookup(DAY1, keys + ["absent"]) == [f"fg-{i % 3}" for i in range(len(keys))] + [None]
        cache.load_partition(DAY2, keys[:10], ["fg-new"] * 10, synced_seq=2)
        assert cache.lookup(DAY2, keys[:2]) == ["fg-new", "fg-new"]


def test_on_demand_loads_at_once_follow_load_threads(tmp_path):
    """load.threads bounds the concurrent on-demand loads of one open cache (memory); 0 = one per core, <= 8."""
    from dbidx.spark_integration.tagger import TagOptions
    from dbidx.spark_integration.shard_sessions import shard_session
    from dbidx.spark_integration.task_result import ShardMetrics

    assert CacheConfig.from_sources({"load.threads": "3"}, environ={}).on_demand_workers == 3
    assert 1 <= CacheConfig().on_demand_workers == min(8, os.cpu_count() or 1)
    with pytest.raises(ConfigError, match="load.threads"):
        CacheConfig(load_threads=-1)
    table = make_table(tmp_path)
    options = TagOptions(key="id", partition="dt", cache=CacheConfig(base_path=str(tmp_path / "b"), load_threads=2))
    with shard_session(table, 0, options, ShardMetrics()) as held:  # a task session owns its loader
        assert held.loader.workers == 2 and held.loader.cache is held.cache


def test_config_values_are_read_by_their_declared_types():
    """Coercion follows the dataclass's annotations: ints, floats, bools, optional strings and enumerations."""
    conf = CacheConfig.from_sources(
        {
            "compression": " LZ4 ",
            "compaction.style": "Universal",
            "stage.loads": "no",
            "partition.ttl.hours": "1.5",
            "base.path": "",
        },
        environ={},
    )
    assert (conf.compression, conf.compaction_style, conf.stage_loads, conf.partition_ttl_hours, conf.base_path) == (
        "lz4",
        "universal",
        False,
        1.5,
        None,
    )
    with pytest.raises(ConfigError, match=r"key compression: cannot read 'brotli' as one of zstd, lz4, snappy, none"):
        CacheConfig.from_sources({"compression": "brotli"}, environ={})
    with pytest.raises(ConfigError, match=r"DBIDX_CACHE_LOAD_THREADS: cannot read 'two' as int for load_threads"):
        CacheConfig.from_sources(environ={"DBIDX_CACHE_LOAD_THREADS": "two"})


@pytest.mark.parametrize("key", [b"p:" + DAY1.encode(), b"watermark", b"meta"])
def test_damaged_registry_bytes_are_a_cache_error_naming_the_cache(tmp_path, key):
    """Registry values are read back as untrusted input: garbage is a CacheError that says to rebuild, never a
    partition read with made-up counters or a crash with a bare TypeError."""
    from dbidx.cache.store import Store

    with RecordIndexCache(tmp_path / "c", ident()) as cache:
        cache.load_partition(DAY1, ["k1"], ["fg-1"], synced_seq=1)
        cache.set_watermark(1)
    store = Store(tmp_path / "c", CacheConfig()).open()
    try:
        store.db[key] = b"\xc1 not msgpack" if key != b"watermark" else b"12x"
    finally:
        store.close()
    with pytest.raises(CacheError, match=r"registry's .* is damaged .*delete the cache directory to rebuild"):
        RecordIndexCache(tmp_path / "c", ident()).open()


@pytest.mark.parametrize(
    "field, value", [("entries", "12"), ("fills", {"fg-1": -3}), ("state", "half"), ("cf", ""), ("synced_seq", 1.5)]
)
def test_a_well_formed_registry_entry_with_wrong_values_is_refused(tmp_path, field, value):
    """Parsing is not enough: a partition state whose fields have the wrong type or range (crafted, or written by
    another tool) is refused like garbage, not used for counters, seqs or a family name."""
    import msgpack

    from dbidx.cache.store import Store

    with RecordIndexCache(tmp_path / "c", ident()) as cache:
        cache.load_partition(DAY1, ["k1"], ["fg-1"], synced_seq=1)
        state = vars(cache.partitions()[DAY1]) | {field: value}
    store = Store(tmp_path / "c", CacheConfig()).open()
    try:
        store.db[b"p:" + DAY1.encode()] = msgpack.packb(state)
    finally:
        store.close()
    with pytest.raises(CacheError, match=r"registry's entry .* is damaged .*not a partition state"):
        RecordIndexCache(tmp_path / "c", ident()).open()


def test_an_overlay_family_of_an_earlier_version_is_dropped_on_open(tmp_path):
    """Earlier versions kept uncommitted entries in an `_overlay` column family; caches hold committed entries only
    now, so an old cache's family is a leftover like any family the registry does not point at."""
    from dbidx.cache.store import Store

    with RecordIndexCache(tmp_path / "c", ident()) as cache:
        cache.load_partition(DAY1, ["k1"], ["fg-1"], synced_seq=1)
    store = Store(tmp_path / "c", CacheConfig()).open()
    try:
        store.cf("_overlay", create=True)[b"dt=x\x00k2"] = b"\x93\xa1i\xa10\xa4fg-2"
    finally:
        store.close()
    with RecordIndexCache(tmp_path / "c", ident()) as cache:
        assert "_overlay" not in cache.store.column_families()
        assert cache.lookup(DAY1, ["k1", "k2"]) == ["fg-1", None]


def test_lookup_order_follows_the_bytes_after_a_long_shared_prefix():
    """Multi-gets run in (nearly) key order for locality; keys that share a long prefix are ordered by the bytes
    after it, and keys identical for the whole window fall back to an exact sort."""
    import random

    rng = random.Random(0)
    for template, width in (("tenant-0042/orders/{:09d}", 9), ("{}".rjust(41, "x"), 6)):
        keys = [template.format(rng.randrange(10**width)) for _ in range(20_000)]
        encoded = codec.encode_keys_binary(pa.array(keys))
        order = codec.lookup_order(encoded)
        assert sorted(order.tolist()) == list(range(len(keys)))
        ordered = encoded.take(pa.array(order)).to_pylist()
        inversions = sum(a > b for a, b in zip(ordered, ordered[1:]))
        assert inversions < len(keys) // 1000, (template, inversions)


def test_flipped_bytes_in_a_cache_file_are_a_typed_error_naming_the_file(tmp_path):
    """RocksDB's block checksums catch a flipped byte; the library turns its bare Exception into CacheCorruptError
    (a CacheError) naming the SST, on the lookup path and the scan path alike - never a key read as absent."""
    from dbidx.errors import CacheCorruptError

    keys = [f"key-{i:06d}" for i in range(20_000)]
    with RecordIndexCache(tmp_path / "c", ident(), CacheConfig(block_cache_mb=0)) as cache:
        cache.load_partition(DAY1, keys, [f"fg-{i % 5}" for i in range(len(keys))], synced_seq=1)
    sst = max((tmp_path / "c").glob("*.sst"), key=lambda p: p.stat().st_size)
    data = bytearray(sst.read_bytes())
    for pos in range(64, int(len(data) * 0.8), 997):
        data[pos] ^= 0x5A
    sst.write_bytes(bytes(data))
    with pytest.raises(CacheCorruptError, match=rf"Corruption.*{sst.name}"):
        with RecordIndexCache(tmp_path / "c", ident(), CacheConfig(block_cache_mb=0)) as cache:
            cache.lookup(DAY1, keys)
    with pytest.raises(CacheCorruptError, match=rf"Corruption.*{sst.name}"):
        with RecordIndexCache(tmp_path / "c", ident(), CacheConfig(block_cache_mb=0)) as cache:
            list(cache.items(DAY1))


def test_a_cache_without_block_cache_opens_and_serves(tmp_path):
    """block.cache.mb = 0 (documented: no block cache) is a valid setting: index and filter blocks then stay in
    the table readers instead of a cache that does not exist (RocksDB refuses the combination)."""
    keys = [f"key-{i:06d}" for i in range(5_000)]
    with RecordIndexCache(tmp_path / "c", ident(), CacheConfig(block_cache_mb=0)) as cache:
        cache.load_partition(DAY1, keys, ["fg-1"] * len(keys), synced_seq=1)
    with RecordIndexCache(tmp_path / "c", ident(), CacheConfig(block_cache_mb=0)) as cache:
        assert cache.lookup(DAY1, keys[:10] + ["new"]) == ["fg-1"] * 10 + [None]


def test_a_damaged_location_dictionary_is_a_typed_error_naming_the_family(tmp_path):
    """A family's location list is stored bytes like any other: garbage there stops the open with a
    CacheCorruptError naming the cache and the family, instead of entries decoded against a made-up list."""
    from dbidx.cache.sst_builder import LOCATIONS_KEY
    from dbidx.cache.store import Store
    from dbidx.errors import CacheCorruptError

    with RecordIndexCache(tmp_path / "c", ident()) as cache:
        cache.load_partition(DAY1, ["k1"], ["fg-1"], synced_seq=1)
        cf = cache.partitions()[DAY1].cf
    store = Store(tmp_path / "c", CacheConfig()).open()
    try:
        store.cf(cf)[LOCATIONS_KEY] = b"\x92\x01\x02"  # a list, but of numbers
    finally:
        store.close()
    with pytest.raises(
        CacheCorruptError,
        match=rf"cache {tmp_path / 'c'}: the location dictionary of column family "
        rf"'{cf}' is damaged .*delete the cache directory",
    ):
        RecordIndexCache(tmp_path / "c", ident()).open()


def test_stored_values_outside_the_canonical_map_decode_strictly(tmp_path):
    """A lookup's fast map knows each location's canonical varint; any other stored value takes the strict path: a
    non-minimal varint still names its location, an index past the dictionary is damage, never an absent key."""
    from dbidx.errors import CacheCorruptError

    table = make_table(tmp_path)
    cache = open_cache(table, 0, tmp_path / "caches")
    try:
        cache.load_partition("p", ["a", "b", "c"], ["fg-0", "fg-1", "fg-0"], table.timeline.latest_seq)
        view = cache.store.cf(cache.partitions()["p"].cf)
        odd, past = codec.encode_keys_binary(pa.array(["odd", "past"])).to_pylist()
        view[odd] = b"\x81\x00"  # index 1, in two bytes
        assert cache.lookup("p", ["a", "odd", "b", "zz"]) == ["fg-0", "fg-1", "fg-1", None]
        view[past] = b"\x7f"  # index 127 of a 2-entry dictionary
        with pytest.raises(CacheCorruptError, match="location #127"):
            cache.lookup("p", ["a", "past"])
        del view
    finally:
        cache.close()


@pytest.mark.parametrize("locations", [1, 3])
@pytest.mark.parametrize("arrive_sorted", [True, False])
def test_a_load_reads_back_every_location_sorted_or_not(tmp_path, locations, arrive_sorted):
    """A partition slice with one location (every key written with the same value) or several, its keys arriving
    sorted (an index file's entries, no sort) or not: every key reads back with its own location, and the
    fills count each location's keys."""
    keys = [str(uuid.UUID(int=i * 7919 + 1)) for i in range(2_000)]
    if arrive_sorted:
        keys.sort()
    locs = [f"fg-{i % locations}" for i in range(len(keys))]
    cache = RecordIndexCache(tmp_path / "c", ident()).open()
    cache.load_partition(DAY1, pa.array(keys), pa.array(locs), synced_seq=1)
    assert cache.lookup(DAY1, keys + ["absent"]) == locs + [None]
    assert cache.fills(DAY1) == {f"fg-{j}": locs.count(f"fg-{j}") for j in range(locations)}
    cache.close()
