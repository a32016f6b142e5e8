"""Shared fixtures: tiny checkpoints built once per session, and the models loaded from them."""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run under Triton's interpreter, which `triton.jit` chooses when
# a kernel is defined: set before any test module imports a kernel module, so that no order of
# test files can leave some kernels compiled-only (a kernel module imported by a file that does
# not interpret, then called from an interpreted kernel, fails). test_kernels_compile's and
# test_quant_compile's child processes drop it to compile for sm_90.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from checkpoints import SPECS, build_checkpoint, load_reference  # noqa: E402

from noesis import LLM  # noqa: E402

# The models here are tiny: intra-op threads only add synchronization, and on a loaded 2-core CI
# machine spinning OpenMP workers made the suite several times slower.
torch.set_num_threads(1)


class Checkpoints:
    """Builds each named checkpoint of `checkpoints.SPECS` once, and caches what is loaded from it.

    Cached LLMs are shared between tests: a test must leave its engine idle (every request
    finished or aborted), which is itself something the tests check.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._paths: dict[str, Path] = {}
        self._llms: dict[tuple[str, str], LLM] = {}
        self._references: dict[tuple[str, torch.dtype], torch.nn.Module] = {}

    def path(self, name: str) -> Path:
        if name not in self._paths:
            spec = SPECS[name]
            self._paths[name] = build_checkpoint(
                self.root / name, spec.family, **copy.deepcopy(spec.config)
            )
        return self._paths[name]

    def copy(self, name: str, dest: Path) -> Path:
        """A private copy of a checkpoint that a test may damage."""
        return Path(shutil.copytree(self.path(name), dest))

    def llm(self, name: str, dtype: str = "float32") -> LLM:
        key = (name, dtype)
        if key not in self._llms:
            self._llms[key] = self.new_llm(name, dtype=dtype)
        return self._llms[key]

    def new_llm(self, name: str, dtype: str = "float32", **options) -> LLM:
        options = {**SPECS[name].engine, **options}
        return LLM(str(self.path(name)), device="cpu", dtype=dtype, progress=False, **options)

    def reference(self, name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        key = (name, dtype)
        if key not in self._references:
            self._references[key] = load_reference(self.path(name), dtype)
        return self._references[key]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Modules whose selected tests wait on a slow child process of their own may start it now
    (`start_in_background()`), so that it runs beside the tests before them: the tests run on
    one core (one torch thread), the CI machine has two."""
    if session.config.option.collectonly:
        return
    if hasattr(session.config, "workerinput"):
        # a pytest-xdist worker: every worker collects every test, so starting here would run
        # each child once per worker; the module's fixture starts it in the worker that runs it
        return
    for module in {item.module for item in session.items if isinstance(item, pytest.Function)}:
        start = getattr(module, "start_in_background", None)
        if start is not None:
            _background.append(start())


def pytest_sessionfinish(session: pytest.Session) -> None:
    for process in _background:
        if process is not None and process.poll() is None:  # its tests did not run
            process.kill()
            process.wait()


_background: list = []


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="session")
def whisper():
    """Whisper tiny.en (faster-whisper), loaded once for the voice tests."""
    from noesis.voice.asr import WhisperRecognizer

    return WhisperRecognizer(threads=2)


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A few hundred corpus items, tokenized: the training tests' data, built once."""
    from noesis.tiny import data

    directory = tmp_path_factory.mktemp("tiny-data")
    config = data.DataConfig(
        seed=3,
        train_items=240,
        heldout_items=40,
        tokenizer_items=240,
        vocab_size=600,
        chunk_items=100,
    )
    data.build(directory, config, workers=1)
    return directory
