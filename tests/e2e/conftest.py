"""End-to-end fixtures: the real `noesis serve` in a subprocess on 127.0.0.1, a tiny checkpoint.

One shared server (session scope) serves most tests, test_embeddings.py's BERT included; a
strict one (a key, a queue of one, CORS) serves test_limits.py and test_cors.py; a spare one
serves, in turn, the tests that disturb a server (overlapped steps, a killed engine process, a
SIGTERM drain). Tests that need other flags, or that kill the server uncleanly, start their own
with `ServerProcess`. Each start costs seconds of both CPU cores (two processes import torch), so
starts are shared where the flags allow. Every request loop in this tier is bounded.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from checkpoints import build_checkpoint, build_sentence_bert

MODEL_NAME = "tiny-chat"
BERT_NAME = "mini-bert"  # the shared server's --embedding-model
CONTEXT = 1024
STRICT_KEY = "sk-test-123"  # the strict server's, from $NOESIS_API_KEY
CORS_ORIGIN = "http://localhost:3000"  # one of the strict server's two CORS origins
SHUTDOWN_DEADLINE = 3.0  # the spare server's --shutdown-timeout


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`python -m noesis.cli serve ...` on a free loopback port, with its log in a file."""

    def __init__(self, model: Path, log_dir: Path, *args: str, env: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"server-{self.port}.log"
        command = [
            sys.executable,
            "-m",
            "noesis.cli",
            "serve",
            "--model",
            str(model),
            "--served-model-name",
            MODEL_NAME,
            "--device",
            "cpu",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            # the safety sidecar (on by default) would score the random model's text on the
            # CI's two cores; tests that want it pass --safety or a --sidecars file after this
            "--no-safety",
            *args,
        ]
        full_env = {k: v for k, v in os.environ.items() if k != "NOESIS_API_KEY"}
        full_env |= {"OMP_NUM_THREADS": "1", **(env or {})}
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=full_env
        )
        self._wait_healthy(timeout=90)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout} s:\n{self.log()}")

    def log(self, tail: int | None = 5000) -> str:
        text = self.log_path.read_text(errors="replace")
        return text[-tail:] if tail else text

    def client(self, api_key: str = "unused", **options) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, **options)

    def async_client(self, api_key: str = "unused") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0)

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of /metrics, plus labelled ones under 'name{labels}'."""
        text = httpx.get(self.url + "/metrics", timeout=5).text
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    def wait_idle(self, timeout: float = 10) -> dict[str, float]:
        """Wait until no sequence runs or waits and no KV page is referenced."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = m["noesis_running_sequences"] == 0 and m["noesis_queue_depth"] == 0
            if idle and m["noesis_kv_pages_used"] == 0 and m["noesis_requests_in_flight"] == 0:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout} s: {m}")
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("e2e-model")
    return build_checkpoint(root / "tiny", "llama", max_position_embeddings=CONTEXT)


@pytest.fixture(scope="session")
def start_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """Factory for servers with extra flags; all are stopped at the end of the session."""
    started: list[ServerProcess] = []
    log_dir = tmp_path_factory.mktemp("server-logs")

    def start(*args: str, env: dict | None = None) -> ServerProcess:
        server = ServerProcess(tiny_model, log_dir, *args, env=env)
        started.append(server)
        return server

    yield start
    for server in started:
        code = server.stop()
        assert code == 0, f"server exited with {code}:\n{server.log()}"
        assert "Traceback" not in server.log(tail=None), server.log()


@pytest.fixture(scope="session")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny sentence-transformers BERT, served beside the decoder by the shared server."""
    return build_sentence_bert(tmp_path_factory.mktemp("e2e-bert") / BERT_NAME, max_seq_length=12)


@pytest.fixture(scope="session")
def server(start_server, bert_dir: Path) -> ServerProcess:
    """The shared server: defaults, with room for the concurrency tests, and a BERT embedder."""
    return start_server("--max-queue", "128", "--max-n", "8", "--embedding-model", str(bert_dir))


@pytest.fixture(scope="session")
def strict_server(start_server) -> ServerProcess:
    """One running sequence, one waiting, the API key from the environment, /metrics left open,
    CORS for two origins."""
    return start_server(
        "--max-num-seqs",
        "1",
        "--max-queue",
        "1",
        "--metrics-public",
        "--cors-origins",
        f"{CORS_ORIGIN}, https://app.example",
        env={"NOESIS_API_KEY": STRICT_KEY},
    )


@pytest.fixture(scope="session")
def _spare_servers() -> list[ServerProcess]:
    return []


@pytest.fixture
def spare_server(start_server, _spare_servers: list[ServerProcess]) -> ServerProcess:
    """A server that a test may disturb: steps overlapped (`--overlap-steps`, the CUDA default,
    forced on here on the CPU), a short shutdown deadline. Each test leaves it serving and idle
    (its counters moved on), but a test that stops it; the next test then gets a fresh one."""
    if not _spare_servers or _spare_servers[-1].process.poll() is not None:
        _spare_servers.append(
            start_server(
                "--max-queue",
                "128",
                "--overlap-steps",
                "--shutdown-timeout",
                str(SHUTDOWN_DEADLINE),
            )
        )
    return _spare_servers[-1]


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return server.client()


def chat(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]
