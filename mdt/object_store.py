"""Object stores: `storage_options` for pyarrow and for the conditional-put client, and create-if-absent itself.

Why a second client: every commit is published by creating `timeline/completed/<seq>.json` only if it does not
exist yet. S3 (since 2024), GCS, Azure Blob, MinIO, R2 and moto all offer that as a conditional PUT
(`If-None-Match: *`, generation preconditions), but `pyarrow.fs` does not expose it. `obstore` (the Python binding
of the Rust `object_store` crate, the one delta-rs commits through) does, with one call (`put(mode="create")`) for
S3, GCS and Azure, and is picklable, so Spark tasks can carry it. Data and index files keep going through
`pyarrow.fs`; only files that must be created exactly once use obstore.

`storage_options` follow delta-rs: `endpoint` (or `aws_endpoint_url`), `region`, `access_key_id`,
`secret_access_key`, `session_token`, `allow_http`, ...; anything not given comes from the usual environment
variables (AWS_*, GOOGLE_*, AZURE_*), which both clients read.
"""
from __future__ import annotations

from typing import Any, Mapping
from urllib.parse import urlparse

import pyarrow.fs as pafs

from dbidx.errors import ConfigError, InvalidInputError

CONDITIONAL_PUT_SCHEMES = {"s3": "s3", "s3a": "s3", "gs": "gs", "gcs": "gs", "az": "az", "abfs": "abfs",
                           "abfss": "abfs"}
_ALIASES = {  # delta-rs style names -> one canonical name
    "endpoint": "endpoint", "endpoint_url": "endpoint", "aws_endpoint": "endpoint", "aws_endpoint_url": "endpoint",
    "region": "region", "aws_region": "region",
    "access_key_id": "access_key_id", "aws_access_key_id": "access_key_id",
    "secret_access_key": "secret_access_key", "aws_secret_access_key": "secret_access_key",
    "session_token": "session_token", "aws_session_token": "session_token",
    "allow_http": "allow_http", "aws_allow_http": "allow_http",
}


def normalize_options(options: Mapping[str, Any] | None) -> dict[str, str]:
    """Storage options with canonical names (unknown names are kept as given, for obstore's own keys)."""
    out: dict[str, str] = {}
    for key, value in (options or {}).items():
        if not isinstance(key, str) or value is None:
            raise ConfigError(f"storage option {key!r} = {value!r}: names and values must be strings")
        out[_ALIASES.get(key.lower(), key)] = str(value)
    return out


def _truthy(value: str | None) -> bool:
    return str(value).lower() in ("1", "true", "yes", "on")


def pyarrow_filesystem(uri: str, options: Mapping[str, str]) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem and root path of a table URI, built with the storage options."""
    scheme = urlparse(uri).scheme.lower()
    if options and CONDITIONAL_PUT_SCHEMES.get(scheme) == "s3":
        kwargs: dict[str, Any] = {}
        endpoint = options.get("endpoint")
        if endpoint:
            parsed = urlparse(endpoint if "://" in endpoint else f"https://{endpoint}")
            kwargs["endpoint_override"] = parsed.netloc
            kwargs["scheme"] = parsed.scheme
        for ours, theirs in (("region", "region"), ("access_key_id", "access_key"),
                             ("secret_access_key", "secret_key"), ("session_token", "session_token")):
            if options.get(ours):
                kwargs[theirs] = options[ours]
        parsed = urlparse(uri)
        return pafs.S3FileSystem(**kwargs), f"{parsed.netloc}{parsed.path}".rstrip("/")
    fs, path = pafs.FileSystem.from_uri(uri)
    return fs, path


class ConditionalPut:
    """Create-if-absent of one object through obstore; picklable (the store is built lazily in each process)."""

    def __init__(self, uri: str, options: Mapping[str, str]) -> None:
        parsed = urlparse(uri)
        self.kind = CONDITIONAL_PUT_SCHEMES[parsed.scheme.lower()]
        self.bucket_url = f"{parsed.scheme}://{parsed.netloc}"
        self.prefix = parsed.path.strip("/")
        self.options = dict(options)
        self._store: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"kind": self.kind, "bucket_url": self.bucket_url, "prefix": self.prefix, "options": self.options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._store = None

    def _client(self) -> Any:
        if self._store is None:
            try:
                from obstore.store import from_url
            except ImportError as exc:
                raise ConfigError(
                    "committing to a table on an object store needs the conditional-put client obstore: "
                    "pip install 'dbidx[object-store]' (or give the table a commit_lock)") from exc
            config = {k: v for k, v in self.options.items() if k not in ("endpoint", "allow_http") and
                      k not in _ALIASES.values()}
            if self.kind == "s3":
                for ours, theirs in (("endpoint", "aws_endpoint"), ("region", "aws_region"),
                                     ("access_key_id", "aws_access_key_id"),
                                     ("secret_access_key", "aws_secret_access_key"),
                                     ("session_token", "aws_session_token")):
                    if self.options.get(ours):
                        config[theirs] = self.options[ours]
            allow_http = _truthy(self.options.get("allow_http")) or \
                str(self.options.get("endpoint", "")).startswith("http://")
            self._store = from_url(self.bucket_url, config=config or None,
                                   client_options={"allow_http": True} if allow_http else None)
        return self._store

    def create(self, rel: str, data: bytes) -> bool:
        """Put `data` at `rel` (table-relative) only if nothing is there; False if something already was."""
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        key = f"{self.prefix}/{rel}" if self.prefix else rel
        try:
            obstore.put(self._client(), key, data, mode="create")
            return True
        except (AlreadyExistsError, PreconditionError):
            return False
        except OSError as exc:
            raise InvalidInputError(f"conditional put of {self.bucket_url}/{key} failed: {exc}") from exc
