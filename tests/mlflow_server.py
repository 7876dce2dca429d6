"""A real `mlflow server` on 127.0.0.1 for tests: started, stopped and restarted by PID."""

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(root: Path, port: int, timeout_s: float = 90) -> subprocess.Popen:
    """Start a server on `port` with its store in `root` (the same root keeps the same runs) and
    return once /health answers."""
    mlflow_bin = Path(sys.executable).with_name("mlflow")
    log = root / "server.log"
    proc = subprocess.Popen(
        [str(mlflow_bin), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root / 'server.db'}", "--artifacts-destination", str(root / "artifacts")],
        stdout=open(log, "a"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: uvicorn workers are stopped with it
        # MLflow 3 also starts a pool of background job consumers that take CPU from the tests
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass  # not listening yet
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_tree(proc)
            raise RuntimeError("mlflow server did not start:\n" + log.read_text()[-2000:])
        time.sleep(0.5)


def stop_tree(proc: subprocess.Popen) -> None:
    """Stop a server by its PID and every descendant (even one that left the process group)."""
    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    for p in family:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            continue  # already gone
    _, alive = psutil.wait_procs(family, timeout=15)
    for p in alive:
        p.kill()
    proc.wait(timeout=15)
