"""A throwaway Spark standalone cluster (one master, two workers) started from the installed pyspark, for tests.

Why a real cluster and not `local[n]`: in local mode the driver, the executors and every Python worker share one
JVM and one set of local dirs, so nothing shows what happens when a shard's task moves to another machine's cache,
when an executor JVM dies mid-job, or where caches land inside a worker's Spark-managed directories. Each worker
here has its own SPARK_LOCAL_DIRS and SPARK_WORKER_DIR, like two machines would.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyspark

from tools.spark_cds import jvm_options_for_tests

SPARK_HOME = Path(pyspark.__file__).parent
STARTUP_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0
# Short-lived JVMs on a small machine: the C1 compiler only and the serial collector start faster and leave the cores
# to the work (the tests' jobs are tiny; nothing runs long enough for C2 to pay off); `make test` adds its class-data
# archive of Spark's classes (tools/spark_cds.py).
JVM_OPTIONS = jvm_options_for_tests()


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def java_missing() -> bool:
    """Whether there is no Java to run Spark's master and workers with."""
    java_home = os.environ.get("JAVA_HOME")
    return shutil.which("java") is None and not (java_home and (Path(java_home) / "bin" / "java").exists())


@dataclass
class WorkerNode:
    """One worker process and the directories that stand for its machine's disks."""

    name: str
    host: str  # the address it binds and is reached at: its own per worker, as two machines have
    local_dir: Path  # SPARK_LOCAL_DIRS: Spark's scratch space on this "machine"; caches live below it
    work_dir: Path  # SPARK_WORKER_DIR: executors' working directories (archives are unpacked there)
    webui_port: int
    process: subprocess.Popen | None = None


@dataclass
class StandaloneCluster:
    """A master and workers started with spark-class; `stop()` ends every process group it started."""

    root: Path
    num_workers: int = 2
    worker_memory: str = "1g"
    master_port: int = 0
    master_webui_port: int = 0
    master: subprocess.Popen | None = None
    workers: list[WorkerNode] = field(default_factory=list)

    @property
    def url(self) -> str:
        """The master URL a driver connects to."""
        return f"spark://127.0.0.1:{self.master_port}"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of the cluster's processes: this interpreter for Python workers, no user Spark conf."""
        conf_dir = self.root / "conf"
        conf_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update(
            SPARK_HOME=str(SPARK_HOME),
            SPARK_CONF_DIR=str(conf_dir),
            PYSPARK_PYTHON=sys.executable,
            SPARK_NO_DAEMONIZE="1",
            SPARK_DAEMON_JAVA_OPTS=JVM_OPTIONS,
        )
        env.pop("PYSPARK_DRIVER_PYTHON", None)
        # Nothing of the caller's own set-up may decide where caches land: the point is dbidx's default location.
        for name in [n for n in env if n.startswith("DBIDX_CACHE_") or n == "SPARK_LOCAL_DIRS"]:
            env.pop(name)
        env.update(extra)
        return env

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        """Start spark-class in its own process group (so stop() also reaches the executors it forks)."""
        log = open(self.root / f"{name}.log", "wb")
        try:
            return subprocess.Popen(
                [str(SPARK_HOME / "bin" / "spark-class"), *args],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            log.close()

    def start(self) -> "StandaloneCluster":
        """Start the master, then the workers, and wait until every worker has registered."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.master_port, self.master_webui_port = free_port(), free_port()
        try:
            # 1. The master.
            self.master = self._spawn(
                "master",
                [
                    "org.apache.spark.deploy.master.Master",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.master_port),
                    "--webui-port",
                    str(self.master_webui_port),
                ],
                self.env(),
            )
            # 2. The workers, each with its own local and work dirs (its own "disk").
            for i in range(self.num_workers):
                # 127.0.0.1, 127.0.0.2, ...: one loopback address per worker, so Spark sees different hosts (a
                # speculative copy of a task only runs on a host where no attempt of it runs).
                node = WorkerNode(
                    f"worker{i}",
                    f"127.0.0.{i + 1}",
                    self.root / f"worker{i}" / "local",
                    self.root / f"worker{i}" / "work",
                    free_port(),
                )
                node.local_dir.mkdir(parents=True)
                node.work_dir.mkdir(parents=True)
                env = self.env(SPARK_LOCAL_DIRS=str(node.local_dir), SPARK_WORKER_DIR=str(node.work_dir))
                node.process = self._spawn(
                    node.name,
                    [
                        "org.apache.spark.deploy.worker.Worker",
                        self.url,
                        "--host",
                        node.host,
                        "--cores",
                        "1",
                        "--memory",
                        self.worker_memory,
                        "--webui-port",
                        str(node.webui_port),
                        "--work-dir",
                        str(node.work_dir),
                    ],
                    env,
                )
                self.workers.append(node)
            # 3. Wait for the master to report every worker alive.
            self.wait_for_workers(self.num_workers)
        except BaseException:
            self.stop()
            raise
        return self

    def state(self) -> dict[str, Any]:
        """The master's JSON view (workers, applications)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.master_webui_port}/json/", timeout=5) as answer:
            return json.load(answer)

    def wait_for_workers(self, count: int, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Poll the master until `count` workers are alive; fail with the logs' tails if it does not happen."""
        deadline = time.monotonic() + timeout_s
        seen: Any = None
        while time.monotonic() < deadline:
            for proc in [self.master] + [w.process for w in self.workers]:
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"a cluster process exited with {proc.returncode}\n{self.log_tails()}")
            try:
                seen = self.state().get("aliveworkers")
                if seen == count:
                    return
            except (urllib.error.URLError, OSError, ValueError):
                pass  # the master's UI is not up yet
            time.sleep(0.2)
        raise RuntimeError(f"{seen} of {count} workers registered within {timeout_s:.0f} s\n{self.log_tails()}")

    def log_tails(self, lines: int = 15) -> str:
        """The last lines of every process log: what a failure message shows."""
        parts = []
        for log in sorted(self.root.glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    def worker_of(self, local_dirs: str) -> WorkerNode:
        """The worker whose local dir contains a path (e.g. a Python worker's SPARK_LOCAL_DIRS)."""
        for node in self.workers:
            if Path(local_dirs.split(",")[0]).is_relative_to(node.local_dir):
                return node
        raise LookupError(f"{local_dirs} is under no worker's local dir")

    def stop(self) -> None:
        """SIGTERM every process group (workers first, then the master), then SIGKILL what is still alive."""
        groups = [w.process for w in self.workers if w.process is not None]
        groups += [self.master] if self.master is not None else []
        for proc in groups:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in groups:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        # The group may outlive its leader (an executor JVM, a Python daemon): kill whatever is left.
        for proc in groups:
            _signal_group(proc, signal.SIGKILL)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def _signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    """Signal a child's process group (its pid: it was started in a new session); gone already is fine."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_driver(
    script: Path, args: list[str], env: dict[str, str], timeout_s: float, submit: list[str] | None = None
) -> subprocess.CompletedProcess:
    """Run a driver application in its own process (a JVM hosts one SparkContext, and the test session has one).

    submit: arguments for spark-submit (then the script runs through it, as a user would), else plain python.
    """
    if submit is None:
        command = [sys.executable, str(script), *args]
    else:
        command = [str(SPARK_HOME / "bin" / "spark-submit"), *submit, str(script), *args]
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _signal_group(proc, signal.SIGKILL)
        out, _ = proc.communicate()
        raise RuntimeError(f"driver {script.name} timed out after {timeout_s:.0f} s:\n{out[-4000:]}") from None
    return subprocess.CompletedProcess(command, proc.returncode, out, None)
