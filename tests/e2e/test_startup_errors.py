"""`noesis serve` on a checkpoint it must refuse exits quickly, non-zero, with one clear line on
stderr and no traceback; SIGTERM while the engine process still loads leaves no process behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import free_port

START_TIMEOUT_S = 30  # a start-up that hangs fails the test instead of blocking it
GONE_TIMEOUT_S = 15


def serve_command(model: str | Path) -> list[str]:
    return [
        sys.executable, "-m", "noesis.cli", "serve", "--model", str(model), "--device", "cpu",
        "--port", str(free_port()), "--log-level", "warning",
    ]


def serve_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "NOESIS_API_KEY"}
    return env | {"OMP_NUM_THREADS": "1", **extra}


def child_pids(pid: int) -> list[int]:
    """Processes whose parent is `pid`, from /proc."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # exited meanwhile
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                children.append(int(entry.name))
    return children


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for a reaper that may never come)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """The pids still running after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while (alive := [pid for pid in pids if running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def kill_tree(process: subprocess.Popen, children: list[int]) -> None:
    """Clean up after a failed test: the server we started, then its children we recorded."""
    if process.poll() is None:
        process.kill()
        process.wait()
    for pid in children:
        if running(pid):
            os.kill(pid, signal.SIGKILL)


def fifo_config(model: Path) -> None:
    (model / "config.json").unlink()
    os.mkfifo(model / "config.json")


def absurd_vocab(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    config["vocab_size"] = 10**12
    (model / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("damage", "shown"),
    [
        (fifo_config, "config.json is a named pipe (FIFO), not a regular file"),
        (absurd_vocab, "config.json: vocab_size: 1,000,000,000,000 is above the limit"),
    ],
)
def test_refused_checkpoint_exits_with_one_clear_line(tiny_model, tmp_path, damage, shown):
    model = Path(shutil.copytree(tiny_model, tmp_path / "broken"))
    damage(model)
    process = subprocess.Popen(
        serve_command(model), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env=serve_env(),
    )
    children: list[int] = []
    try:
        _, stderr = process.communicate(timeout=START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        children = child_pids(process.pid)
        kill_tree(process, children)
        pytest.fail(f"noesis serve still starting after {START_TIMEOUT_S} s")
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert process.returncode != 0
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1 and lines[0].startswith("noesis: error: "), stderr
    assert shown in lines[0], stderr


def test_sigterm_while_the_engine_loads_leaves_no_process(tmp_path):
    """The engine process asks a Hub that accepts and never answers: it stays in loading (for
    minutes, by huggingface_hub's timeouts and retries) until the server is stopped."""
    with socket.socket() as hub:
        hub.bind(("127.0.0.1", 0))
        hub.listen(8)
        hub.settimeout(START_TIMEOUT_S)
        env = serve_env(
            HF_ENDPOINT=f"http://127.0.0.1:{hub.getsockname()[1]}", HF_HOME=str(tmp_path / "hf"),
            HF_HUB_OFFLINE="0", HF_HUB_DISABLE_TELEMETRY="1",
        )
        process = subprocess.Popen(
            serve_command("noesis-test/never-answers"), stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, env=env,
        )
        children: list[int] = []
        connection = None
        try:
            connection, _ = hub.accept()  # the model is being resolved: loading has begun
            children = child_pids(process.pid)
            assert children, "the server has no engine process"
            process.send_signal(signal.SIGTERM)
            process.wait(START_TIMEOUT_S)
            left = wait_gone(children, GONE_TIMEOUT_S)
            assert not left, f"engine process(es) {left} outlived the server by {GONE_TIMEOUT_S} s"
        finally:
            kill_tree(process, children)
            if connection is not None:  # open until now: a closed one would end the wait
                connection.close()
