"""A local S3-protocol server for the tests (moto's, from the `dev` extra), and the options to reach it."""

from __future__ import annotations

import socket
from typing import Iterator

import pytest


def s3_server() -> Iterator[dict[str, str]]:
    """Start moto's S3 server on a free loopback port with one bucket; yields the storage options."""
    try:
        from moto.server import ThreadedMotoServer
    except ImportError:
        pytest.skip("moto[server] is not installed (pip install -e '.[dev]'): no local S3 server to test against")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    try:
        server.start()
    except Exception as exc:  # noqa: BLE001 - any failure to start is a skip with its reason
        pytest.skip(f"the local S3 server (moto) could not start: {exc}")
    options = {
        "endpoint": f"http://127.0.0.1:{port}",
        "region": "us-east-1",
        "access_key_id": "testing",
        "secret_access_key": "testing",
        "allow_http": "true",
    }
    import pyarrow.fs as pafs

    fs = pafs.S3FileSystem(
        access_key="testing",
        secret_key="testing",
        endpoint_override=f"127.0.0.1:{port}",
        scheme="http",
        region="us-east-1",
        allow_bucket_creation=True,
    )
    fs.create_dir("dbidx-test")
    try:
        yield options
    finally:
        server.stop()
