"""A local cluster for the scale-out test: Redis, an S3-compatible server (moto) and Celery
workers running Dagster's celery executor, all on 127.0.0.1, each started and stopped here."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent  # workers import the project from here


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait(ready, what: str, proc: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        if ready():
            return
        time.sleep(0.3)
    raise RuntimeError(f"{what} not ready after {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextmanager
def _service(cmd: list[str], log: Path, what: str, ready, env: dict[str, str] | None = None,
             timeout: float = 60.0, cwd: Path | None = None) -> Iterator[subprocess.Popen]:
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
    try:
        _wait(ready, what, proc, log, timeout)
        yield proc
    finally:
        _stop(proc)


def _redis_up(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextmanager
def redis_server(workdir: Path) -> Iterator[str]:
    """A throwaway Redis on 127.0.0.1 (no persistence); yields its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (Debian: apt-get install redis-server)")
    port = free_port()
    cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
           "--dir", str(workdir)]
    with _service(cmd, workdir / "redis.log", "redis-server", lambda: _redis_up(port)):
        yield f"redis://127.0.0.1:{port}"


def _http_up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1):
            return True
    except OSError:
        return False


@contextmanager
def s3_server(workdir: Path) -> Iterator[str]:
    """moto's S3-compatible server on 127.0.0.1; yields its endpoint URL."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with _service(cmd, workdir / "moto.log", "moto server", lambda: _http_up(endpoint + "/moto-api/")):
        yield endpoint


def create_bucket(endpoint: str, bucket: str) -> None:
    import boto3

    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="test", aws_secret_access_key="test",
                 region_name="us-east-1").create_bucket(Bucket=bucket)


@contextmanager
def celery_worker(name: str, queues: list[str], env: dict[str, str], workdir: Path) -> Iterator[subprocess.Popen]:
    """A Celery worker of orchestration.celery_app on the given queues, one task at a time (solo
    pool), exactly as the deployment guide starts one."""
    log = workdir / f"{name}.log"
    cmd = [sys.executable, "-m", "celery", "-A", "updatelens.orchestration.celery_app", "worker",
           "-Q", ",".join(queues), "-n", f"{name}@%h",
           "--pool", "solo", "--prefetch-multiplier", "1", "-l", "INFO"]
    with _service(cmd, log, f"celery worker {name}", lambda: "ready." in log.read_text(), env=env, timeout=120,
                  cwd=REPO):
        yield
