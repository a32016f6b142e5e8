"""Deterministic traces: what an engine run needs to be replayed token for token.

A trace is JSON lines: a header (model and tokenizer hashes, a draft model's hash, engine
config, device, dtype, versions), then in engine order each admitted request (prompt ids,
sampling parameters with its resolved seed, grammar) and abort, keyed by the engine step before
which it happened, each step's batch composition (request, tokens fed, proposals verified) and
the tokens each step produced, and each request's finish. Replaying re-adds the requests at the
same steps: the scheduler is deterministic, so the same batches run the same kernels and sample
the same ids.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from noesis.errors import NoesisError
from noesis.sampling.params import SamplingParams
from noesis.structured.matcher import GrammarSpec

TRACE_VERSION = 1
FULL_HASH_BYTES = 1 << 30  # files up to this size are hashed whole; larger ones are sampled
SAMPLE_CHUNK = 1 << 20
SAMPLES_PER_FILE = 64
# Engine options that do not change what runs: progress bars, where files go; and sidecars,
# whose decisions are recorded (a block: a "content_filter" finish at its step) and replayed as
# recorded, not recomputed (their verdicts arrive a varying number of steps late).
IGNORED_OPTIONS = ("progress", "telemetry", "trace", "sidecars")


class TraceError(NoesisError):
    """A trace that cannot be replayed: unreadable, corrupted, or made with another model."""


def file_hash(paths: list[Path]) -> str:
    """sha256 over the files' names, sizes and bytes; a file over FULL_HASH_BYTES contributes
    its header and SAMPLES_PER_FILE evenly spaced 1 MiB chunks (its size and tensor index are
    still exact), so a 16 GB checkpoint hashes in well under a second from the page cache."""
    digest = hashlib.sha256()
    for path in sorted(paths, key=lambda p: p.name):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}\n".encode())
        with open(path, "rb") as handle:
            if size <= FULL_HASH_BYTES:
                for block in iter(lambda h=handle: h.read(1 << 24), b""):
                    digest.update(block)
                continue
            stride = (size - SAMPLE_CHUNK) // (SAMPLES_PER_FILE - 1)
            for index in range(SAMPLES_PER_FILE):
                handle.seek(index * stride)
                digest.update(handle.read(SAMPLE_CHUNK))
    return digest.hexdigest()


def model_hashes(model_dir: Path) -> tuple[str, str]:
    """(model hash: config.json and the safetensors files, tokenizer hash: the other files). A
    single-file checkpoint (GGUF) holds both: its one hash is both."""
    if model_dir.is_file():
        digest = file_hash([model_dir])
        return digest, digest
    files = [p for p in model_dir.iterdir() if p.is_file()]
    weights = [p for p in files if p.suffix == ".safetensors" or p.name == "config.json"]
    tokenizer = [
        p
        for p in files
        if p.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template"))
    ]
    return file_hash(weights), file_hash(tokenizer)


def checkpoint_path(model: str | Path) -> Path:
    """What a model argument names, resolved as the loader does: a GGUF file as it is, else
    the checkpoint directory (local, bundled or from the hub)."""
    from noesis.weights.gguf import is_gguf
    from noesis.weights.hub import resolve_model_dir

    return Path(model) if is_gguf(model) else resolve_model_dir(model)


def check_hashes(header: dict[str, Any], model: str | None) -> Path:
    """The checkpoint a replay runs (`model`, else the trace's), once its files hash as the
    recording's did: the model, the tokenizer and a draft model's weights; TraceError if not."""
    model_path = checkpoint_path(model or header["model"])
    model_hash, tokenizer_hash = model_hashes(model_path)
    found = [("model", model_path, model_hash), ("tokenizer", model_path, tokenizer_hash)]
    speculative = header["engine"].get("speculative") or {}
    if "draft_hash" in header:  # traces from before it was recorded have none to compare
        draft_path = checkpoint_path(speculative["draft"])
        found.append(("draft", draft_path, model_hashes(draft_path)[0]))
    for name, path, value in found:
        if header[f"{name}_hash"] != value:
            raise TraceError(
                f"the trace was recorded with {name} hash {header[f'{name}_hash'][:16]}..., "
                f"{path} has {value[:16]}...: a replay needs the same {name} files"
            )
    return model_path


def params_to_dict(params: SamplingParams, seed: int) -> dict[str, Any]:
    """A request's sampling parameters as JSON. A conversation's control (an object,
    noesis.control.turns.TurnControl) is recorded as the state its knobs start from, which a
    replay restores (noesis.control.record)."""
    from noesis.control.record import record_state

    control = params.control
    out = dataclasses.asdict(dataclasses.replace(params, control=control is not False))
    if getattr(control, "state", None) is not None:
        out["control_state"] = record_state(control.policy, control.state)
    out["seed"] = seed
    out["stop"], out["stop_token_ids"] = list(params.stop), list(params.stop_token_ids)
    return out


def params_from_dict(data: dict[str, Any]) -> SamplingParams:
    from noesis.control.record import RecordedControl

    data = dict(data)
    grammar = data.pop("grammar", None)
    if grammar is not None:
        grammar = GrammarSpec(**grammar)
    state = data.pop("control_state", None)
    if state is not None:
        data["control"] = RecordedControl(state)
    return SamplingParams(**data, grammar=grammar)


class TraceWriter:
    """Appends a run's events to a trace file, one JSON line each, written through."""

    def __init__(self, path: str | Path | None, header: dict[str, Any]) -> None:
        """path None: keep the records in `records` (what a replay compares)."""
        self._file: IO[str] | None = None
        self.records: list[dict[str, Any]] | None = None
        if path is None:
            self.records = []
        else:
            self._file = open(path, "w", buffering=1)  # noqa: SIM115
        self.write({"kind": "header", "version": TRACE_VERSION, **header})

    def write(self, record: dict[str, Any]) -> None:
        if self.records is not None:
            self.records.append(record)
        elif self._file is not None:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


@dataclass
class Trace:
    header: dict[str, Any]
    events: list[dict[str, Any]]  # everything after the header, in order

    @property
    def requests(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == "add"]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == kind]


REQUIRED = {
    "header": ("version", "model", "model_hash", "tokenizer_hash", "engine", "device", "dtype"),
    "add": ("step", "request_id", "prompt", "params"),
    "abort": ("step", "request_id"),
    "step": ("step", "rows"),
    "tokens": ("step", "out"),
    "finish": ("request_id", "reason", "token_ids"),
    "warm_up": ("step",),
    "decision": ("step", "request_id", "values"),
}


def load_trace(path: str | Path) -> Trace:
    """Read and check a trace; TraceError names the first bad line."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"cannot read the trace {path}: {exc}") from exc
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(
                f"{path}:{number}: not JSON ({exc.msg}); the trace is corrupted"
            ) from None
        kind = record.get("kind") if isinstance(record, dict) else None
        if kind not in REQUIRED or any(key not in record for key in REQUIRED[kind]):
            raise TraceError(
                f"{path}:{number}: not a trace record of a known kind with its "
                f"fields ({str(record)[:80]})"
            )
        records.append(record)
    if not records or records[0]["kind"] != "header":
        raise TraceError(f"{path}: no header: not a noesis trace")
    if records[0]["version"] != TRACE_VERSION:
        raise TraceError(
            f"{path}: trace version {records[0]['version']}, this noesis reads {TRACE_VERSION}"
        )
    return Trace(records[0], records[1:])
