"""Domain metadata read back from a Delta log (data/delta_domains.py): from JSON versions and from a checkpoint
delta-rs wrote, a domain's last action winning and a removed one gone; a damaged domain or a gap in the log is a
CorruptFileError naming where; the clustering check keeps a table clustered by its string key only."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from dbidx.data.delta_domains import CLUSTERING_DOMAIN, check_clustering, clustering_columns, domains_at
from dbidx.errors import CorruptFileError, DeltaFeatureError
from dbidx.storage.fileio import FileIO

SCHEMA = pa.schema([("id", pa.string()), ("v", pa.int64())])


def _table(tmp_path: Path) -> tuple[Path, FileIO]:
    path = tmp_path / "t"
    write_deltalake(str(path), pa.table({"id": ["a", "b"], "v": pa.array([1, 2], pa.int64())}))
    return path, FileIO.from_uri(str(path))


def _commit(path: Path, version: int, *domains: dict) -> None:
    lines = [{"commitInfo": {"timestamp": 1, "operation": "test"}}] + [{"domainMetadata": d} for d in domains]
    (path / "_delta_log" / f"{version:020d}.json").write_text("".join(json.dumps(a) + "\n" for a in lines))


def _clustering(*columns: str) -> dict:
    config = {"clusteringColumns": [[c] for c in columns], "domainName": CLUSTERING_DOMAIN}
    return {"domain": CLUSTERING_DOMAIN, "configuration": json.dumps(config), "removed": False}


def test_domains_from_versions_and_a_checkpoint(tmp_path: Path) -> None:
    path, io = _table(tmp_path)
    _commit(path, 1, _clustering("v"), {"domain": "app.x", "configuration": "1", "removed": False})
    _commit(path, 2, _clustering("id"))
    assert clustering_columns(domains_at(io, 1), "t") == [["v"]]
    assert domains_at(io, 2) == {CLUSTERING_DOMAIN: _clustering("id")["configuration"], "app.x": "1"}
    DeltaTable(str(path)).create_checkpoint()  # version 2's checkpoint holds both domains
    for v in (0, 1, 2):
        (path / "_delta_log" / f"{v:020d}.json").unlink()
    _commit(path, 3, {"domain": "app.x", "configuration": "1", "removed": True})
    assert domains_at(io, 3) == {CLUSTERING_DOMAIN: _clustering("id")["configuration"]}
    assert clustering_columns(domains_at(io, 3), "t") == [["id"]]


def test_damage_is_named(tmp_path: Path) -> None:
    path, io = _table(tmp_path)
    _commit(path, 1, {"configuration": "{}"})
    with pytest.raises(CorruptFileError, match=r"00000000000000000001.json.*no domain name"):
        domains_at(io, 1)
    _commit(path, 1, {"domain": CLUSTERING_DOMAIN, "configuration": "not json"})
    with pytest.raises(CorruptFileError, match="delta.clustering domain of here is not a JSON object"):
        clustering_columns(domains_at(io, 1), "here")
    _commit(path, 1, {"domain": CLUSTERING_DOMAIN, "configuration": '{"clusteringColumns": "id"}'})
    with pytest.raises(CorruptFileError, match="names no column list"):
        clustering_columns(domains_at(io, 1), "here")
    _commit(path, 3, _clustering("id"))  # version 2 missing
    with pytest.raises(CorruptFileError, match=r"00000000000000000002.json is missing"):
        domains_at(io, 3)


def test_only_a_string_key_may_be_the_clustering_column() -> None:
    check_clustering([], "id", SCHEMA, "t")
    check_clustering([["id"]], "id", SCHEMA, "t")
    with pytest.raises(DeltaFeatureError, match=r"clustered by \['v'\].*Remedy: .*CLUSTER BY \(id\)"):
        check_clustering([["id"], ["v"]], "id", SCHEMA, "t")
    with pytest.raises(DeltaFeatureError, match=r"clustered by \['v'\]"):
        check_clustering([["v"]], "v", SCHEMA, "t")  # an integer key: dbidx writes no statistics for it
    with pytest.raises(DeltaFeatureError, match=r"clustered by \['s.id'\]"):
        check_clustering([["s", "id"]], "id", SCHEMA, "t")
