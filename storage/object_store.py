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
from urllib.parse import unquote, urlparse

import pyarrow.fs as pafs

from dbidx.errors import ConfigError, StoreUnavailableError

CONDITIONAL_PUT_SCHEMES = {
    "s3": "s3",
    "s3a": "s3",
    "gs": "gs",
    "gcs": "gs",
    "az": "az",
    "abfs": "abfs",
    "abfss": "abfs",
}
_OBSTORE_SCHEME = {"s3": "s3", "gs": "gs", "az": "az", "abfs": "abfs"}
_ALIASES = {  # delta-rs style names -> one canonical name
    "endpoint": "endpoint",
    "endpoint_url": "endpoint",
    "aws_endpoint": "endpoint",
    "aws_endpoint_url": "endpoint",
    "region": "region",
    "aws_region": "region",
    "access_key_id": "access_key_id",
    "aws_access_key_id": "access_key_id",
    "secret_access_key": "secret_access_key",
    "aws_secret_access_key": "secret_access_key",
    "session_token": "session_token",
    "aws_session_token": "session_token",
    "allow_http": "allow_http",
    "aws_allow_http": "allow_http",
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


def endpoint_url(options: Mapping[str, str]) -> str | None:
    """The endpoint as a full URL: a bare `host:port` gets http:// when allow_http is set, else https://."""
    endpoint = options.get("endpoint")
    if not endpoint:
        return None
    if "://" in endpoint:
        return endpoint.rstrip("/")
    return ("http://" if _truthy(options.get("allow_http")) else "https://") + endpoint.rstrip("/")


def pyarrow_filesystem(uri: str, options: Mapping[str, str]) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem and root path of a table URI, built with the storage options (S3: translated to
    pyarrow's S3FileSystem arguments; other stores take their settings from the URI and the environment)."""
    scheme = urlparse(uri).scheme.lower()
    if options and CONDITIONAL_PUT_SCHEMES.get(scheme) == "s3":
        kwargs: dict[str, Any] = {}
        endpoint = endpoint_url(options)
        if endpoint:
            parsed = urlparse(endpoint)
            kwargs["endpoint_override"] = parsed.netloc
            kwargs["scheme"] = parsed.scheme
        for ours, theirs in (
            ("region", "region"),
            ("access_key_id", "access_key"),
            ("secret_access_key", "secret_key"),
            ("session_token", "session_token"),
        ):
            if options.get(ours):
                kwargs[theirs] = options[ours]
        parsed = urlparse(uri)
        # Decode the path like FileSystem.from_uri does, so one URI names one table with or without options.
        return pafs.S3FileSystem(**kwargs), unquote(f"{parsed.netloc}{parsed.path}").rstrip("/")
    fs, path = pafs.FileSystem.from_uri(uri)
    return fs, path


class ConditionalPut:
    """Create-if-absent of one object through obstore; picklable (the store is built lazily in each process)."""

    def __init__(self, scheme: str, root: str, options: Mapping[str, str]) -> None:
        """`root` is the table's root as pyarrow resolved it (`bucket/prefix`, decoded), so both clients address
        exactly the same objects."""
        self.kind = CONDITIONAL_PUT_SCHEMES[scheme.lower()]
        bucket, _, prefix = root.strip("/").partition("/")
        self.bucket_url = f"{_OBSTORE_SCHEME[self.kind]}://{bucket}"
        self.prefix = prefix
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
                    "pip install 'dbidx[object-store]' (or give the table a commit_lock)"
                ) from exc
            config = {
                k: v
                for k, v in self.options.items()
                if k not in ("endpoint", "allow_http") and k not in _ALIASES.values()
            }
            if self.kind == "s3":
                if endpoint_url(self.options):
                    config["aws_endpoint"] = endpoint_url(self.options)
                for ours, theirs in (
                    ("region", "aws_region"),
                    ("access_key_id", "aws_access_key_id"),
                    ("secret_access_key", "aws_secret_access_key"),
                    ("session_token", "aws_session_token"),
                ):
                    if self.options.get(ours):
                        config[theirs] = self.options[ours]
            allow_http = str(endpoint_url(self.options) or "").startswith("http://") or _truthy(
                self.options.get("allow_http")
            )
            try:
                self._store = from_url(
                    self.bucket_url, config=config or None, client_options={"allow_http": True} if allow_http else None
                )
            except Exception as exc:  # obstore's errors are not OSErrors: bad keys, unknown schemes
                raise ConfigError(
                    f"cannot configure the conditional-put client for {self.bucket_url}: {exc} "
                    "(check the storage options)"
                ) from exc
        return self._store

    def create(self, rel: str, data: bytes) -> bool:
        """Put `data` at `rel` (table-relative) only if nothing is there; False if something already was."""
        import obstore
        from obstore.exceptions import (
            AlreadyExistsError,
            PermissionDeniedError,
            PreconditionError,
            UnauthenticatedError,
        )

        key = f"{self.prefix}/{rel}" if self.prefix else rel
        client = self._client()
        try:
            obstore.put(client, key, data, mode="create")
            return True
        except (AlreadyExistsError, PreconditionError):
            return False
        except (PermissionDeniedError, UnauthenticatedError) as exc:
            raise ConfigError(
                f"the object store refused the conditional put of {self.bucket_url}/{key}: {exc} "
                "(check the credentials in the storage options or the environment)"
            ) from exc
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
                raise
            raise StoreUnavailableError(
                f"conditional put of {self.bucket_url}/{key} failed: {type(exc).__name__}: {exc}"
            ) from exc
