"""Where caches live on a node: the base path rule (the node's Spark local dir, else the user's cache dir) and the
private directories under it, created with owner-only permissions and checked for free space before a cache opens.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Mapping

from dbidx.config import ENV_PREFIX, PREFIX
from dbidx.errors import ConfigError


_SPARK_OWNED_DIR = re.compile(r"^(blockmgr|executor|spark)-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}$")


def node_local_root(spark_dir: str) -> Path:
    """The node's own local dir above the Spark-owned scratch directories of one executor or application.

    Why: inside a Python worker SPARK_LOCAL_DIRS is the executor's block-manager dir, e.g.
    `<local dir>/spark-<uuid>/executor-<uuid>/blockmgr-<uuid>` (standalone) or `<spark.local.dir>/spark-<uuid>/
    blockmgr-<uuid>` (local mode). Spark deletes those when the executor or application ends, so a cache under them
    would be cold in every new application; the directory above them is the disk the cluster provisions for the node
    and outlives both. Only components named like Spark's own (prefix + UUID) are stripped, and never past a mount
    point: on Kubernetes the pod's volume is mounted at `/var/data/spark-<uuid>` itself, and the directory above it
    is the container's own filesystem (small, maybe not writable), so the mount is the node's local dir there.
    """
    path = Path(spark_dir)
    while _SPARK_OWNED_DIR.match(path.name) and path.parent != path and not os.path.ismount(path):
        path = path.parent
    return path


def default_base_path(spark_local_dir: str | None = None, environ: Mapping[str, str] | None = None) -> Path:
    """Where caches live when no config names a base path (`base_path_choice` tells which rule chose it)."""
    return base_path_choice(spark_local_dir, environ)[0]


def base_path_choice(spark_local_dir: str | None = None, environ: Mapping[str, str] | None = None) -> tuple[Path, str]:
    """The default base path of the caches and the rule that chose it. One rule for Spark tasks and the CLI, so
    `dbidx cache ...` finds the caches a local job made:

    1. DBIDX_CACHE_BASE_PATH of the process (an executor's own environment);
    2. else the node's Spark local dir (SPARK_LOCAL_DIRS, else spark.local.dir; above the per-executor and
       per-application directories, see node_local_root) + /dbidx-cache, unless that local dir is the system's
       temporary directory (Spark's default, which local mode uses): then rule 3;
    3. else the user's cache dir ($XDG_CACHE_HOME/dbidx, else ~/.cache/dbidx); never a bare /tmp.

    Why: SPARK_LOCAL_DIRS is the disk the cluster manager provisions for executor scratch data (sized for it, local
    to the node); a shared /tmp is often small, tmpfs, noexec or wiped, and is where a local job and the CLI would
    otherwise disagree. Caches a dead executor left behind are removed by the abandoned-cache sweep
    (cache/reaper.py). docs/DEPLOY.md has the per-cluster-manager caveats.
    """
    env = os.environ if environ is None else environ
    if env.get(ENV_PREFIX + "BASE_PATH"):  # set per node, e.g. spark.executorEnv.DBIDX_CACHE_BASE_PATH
        return Path(env[ENV_PREFIX + "BASE_PATH"]), f"{ENV_PREFIX}BASE_PATH"
    for candidate, name in ((env.get("SPARK_LOCAL_DIRS"), "SPARK_LOCAL_DIRS"), (spark_local_dir, "spark.local.dir")):
        first = (candidate or "").split(",")[0].strip()
        if first:
            root = node_local_root(first)
            if not _is_temp_dir(root, env):
                return root / "dbidx-cache", f"{name} ({first})"
    xdg = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME") or Path.home()) / ".cache")
    return Path(xdg) / "dbidx", "the user cache dir ($XDG_CACHE_HOME/dbidx, else ~/.cache/dbidx)"


def _is_temp_dir(path: Path, env: Mapping[str, str]) -> bool:
    """Whether a directory is the system's temporary directory (/tmp, /var/tmp, $TMPDIR)."""
    temps = {"/tmp", "/var/tmp", env.get("TMPDIR") or "/tmp", tempfile.gettempdir()}
    return os.path.realpath(path) in {os.path.realpath(t) for t in temps}


def make_private_dirs(path: Path) -> None:
    """Create a directory and its missing parents, each private to the user (0700, whatever the umask); existing
    directories are left as they are (they are the user's)."""
    missing = []
    probe = Path(path)
    while not probe.exists():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    for directory in reversed(missing):
        directory.mkdir(mode=0o700, exist_ok=True)
        os.chmod(directory, 0o700)


def check_private_dir(path: Path) -> None:
    """Refuse a cache directory another user owns or that group or others may write (ConfigError naming the fix).

    Why: whoever can write a directory can rename what is in it, so a base directory prepared by another user (a
    shared `/tmp` path made 0777 before our first job) would let that user swap our shard directories for theirs
    and serve us forged index entries. ssh refuses key files on the same grounds. A missing directory passes: we
    create it ourselves, 0700.
    """
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"cache directory {path} cannot be inspected: {exc.strerror or exc}") from exc
    if info.st_uid != os.geteuid():
        raise ConfigError(
            f"cache directory {path} is owned by uid {info.st_uid}, not by this user (uid "
            f"{os.geteuid()}): another user could replace the caches in it. Point "
            f"{PREFIX}base.path (or DBIDX_CACHE_BASE_PATH) at a directory you own, or remove {path}"
        )
    if info.st_mode & 0o022:
        raise ConfigError(
            f"cache directory {path} is writable by group or others (mode "
            f"{oct(info.st_mode & 0o777)}): another user could replace the caches in it. Run "
            f"`chmod go-w {path}` or point {PREFIX}base.path at a private directory"
        )


def prepare_dir(path: Path, min_free_mb: int = 64) -> Path:
    """Create a private (0700) cache directory and check it is usable: ours alone (it and its parent, the base
    path: `check_private_dir`), writable and not full."""
    for existing in (path.parent, path):  # before creating anything inside them
        check_private_dir(existing)
    try:
        make_private_dirs(path)
    except OSError as exc:
        raise ConfigError(f"cache directory {path} cannot be created: {exc.strerror or exc}") from exc
    check_private_dir(path)
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"cache directory {path} is not writable by this user")
    free_mb = shutil.disk_usage(path).free // (1 << 20)
    if free_mb < min_free_mb:
        raise ConfigError(
            f"cache directory {path} has only {free_mb} MB free (need at least {min_free_mb} MB); "
            "point hoodie.index.cache.rocksdb.base.path at a larger local disk"
        )
    return path
