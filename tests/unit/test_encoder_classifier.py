"""EncoderClassifier (noesis.sidecars.encoder_classifier): a sentence-transformers checkpoint with
a linear head, against transformers' BertModel, mean pooling and the head in float64 on the same
random weights; the safety sidecar on it; malformed folders refused by name."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from checkpoints import build_sentence_bert
from safetensors.torch import save_file

from noesis.errors import CheckpointError
from noesis.sidecars.encoder_classifier import EncoderClassifier, is_encoder_classifier
from noesis.sidecars.runtime import Placement, Window
from noesis.sidecars.safety import SafetySidecar

LABELS = ["safe", "unsafe"]


def classifier_dir(path, labels=LABELS, max_tokens=8, head=True, seed=1, threshold=None):
    """A tiny random sentence-BERT (with a Normalize module the head must not read through) plus
    a "classifier" table (with a recommended threshold if given) and a head in a second
    safetensors file."""
    build_sentence_bert(path, max_seq_length=12)
    config = json.loads((path / "config.json").read_text())
    config["classifier"] = {"labels": labels, "max_tokens": max_tokens}
    if threshold is not None:
        config["classifier"]["threshold"] = threshold
    (path / "config.json").write_text(json.dumps(config))
    if head:
        gen = torch.Generator().manual_seed(seed)
        save_file({"classifier.weight": torch.randn(len(labels), 32, generator=gen),
                   "classifier.bias": torch.randn(len(labels), generator=gen)},
                  str(path / "head.safetensors"))  # fmt: skip
    return path


def reference(path, texts, max_tokens):
    """softmax(W mean_pool(BertModel(ids)) + b) in float64, each text cut to max_tokens with its
    [SEP] kept (as training cut them)."""
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    model = transformers.BertModel.from_pretrained(path).double().eval()
    head = load_file(str(path / "head.safetensors"))
    rows = []
    for text in texts:
        ids = tokenizer.encode(text).ids
        ids = ids if len(ids) <= max_tokens else ids[: max_tokens - 1] + ids[-1:]
        with torch.no_grad():
            hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        logits = head["classifier.weight"].double() @ hidden.mean(0) + head["classifier.bias"]
        rows.append(torch.softmax(logits, dim=-1))
    return torch.stack(rows).float()


def test_probabilities_match_transformers_and_the_head(tmp_path):
    path = classifier_dir(tmp_path / "clf")
    assert is_encoder_classifier(path)
    classifier = EncoderClassifier(path)
    assert classifier.labels == tuple(LABELS) and classifier.max_tokens == 8
    texts = ["the quick brown fox", "hello world jumps over the lazy dogs and the fox", "blue"]
    got = classifier.probabilities(texts)
    assert got.shape == (3, 2)
    torch.testing.assert_close(got, reference(path, texts, 8), atol=1e-5, rtol=0)
    # the cut matters: the second text is longer than 8 tokens
    uncut = EncoderClassifier.__new__(EncoderClassifier)
    uncut.__dict__.update(classifier.__dict__, max_tokens=12)
    assert not torch.allclose(uncut.probabilities(texts[1:2]), got[1:2], atol=1e-4)


def test_the_safety_sidecar_loads_it_and_blocks_past_its_threshold(tmp_path):
    path = classifier_dir(tmp_path / "clf")
    text = "the quick brown fox jumps over the lazy dogs."  # one clause
    p_unsafe = float(EncoderClassifier(path).probabilities([text])[0, 1])
    window = Window("r", text, text, False, 0)
    assert 0.02 < p_unsafe < 0.98  # (the seeded head: room on both sides)
    for threshold, decision in ((p_unsafe + 0.01, None), (p_unsafe - 0.01, "block")):
        sidecar = SafetySidecar.load(path, threshold=threshold)
        verdict = sidecar.run(window)
        assert verdict.clause == text and abs(verdict.p_unsafe - p_unsafe) < 1e-6
        assert sidecar.decide(verdict) == decision


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_safety_sidecar_runs_the_encoder_where_its_placement_says(tmp_path, device):
    """`[sidecars.safety] device = "cuda"` puts the encoder on the GPU (its worker's calls go
    under a low-priority stream), with the CPU's probabilities."""
    path = classifier_dir(tmp_path / "clf")
    text = "the quick brown fox jumps over the lazy dogs."
    sidecar = SafetySidecar.load(path, placement=Placement(device))
    assert sidecar.classifier.encoder.device.type == device
    expected = EncoderClassifier(path).probabilities([text])[0, 1]
    verdict = sidecar.run(Window("r", text, text, False, 0))
    assert abs(verdict.p_unsafe - float(expected)) < 1e-4


def test_the_safety_sidecar_scores_a_batch_of_windows_as_one_by_one(tmp_path):
    sidecar = SafetySidecar.load(classifier_dir(tmp_path / "clf"), threshold=0.5)
    texts = ["the quick brown fox. jumps over the lazy dogs.", "", "hello world, blue fox."]
    windows = [Window("r", t, t, False, 0) for t in texts]
    batch = sidecar.run_batch(windows)
    assert batch[1] is None  # no text: nothing to score
    for verdict, window in zip(batch, windows, strict=True):
        alone = sidecar.run(window)
        assert (verdict is None) == (alone is None)
        if alone is not None:  # padded beside longer texts: the same scores
            assert verdict.clause == alone.clause and abs(verdict.p_unsafe - alone.p_unsafe) < 1e-5


def test_malformed_classifier_folders_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="head"):
        EncoderClassifier(classifier_dir(tmp_path / "no-head", head=False))
    wrong = classifier_dir(tmp_path / "three", labels=["a", "b", "c"], seed=2)
    save_file({"classifier.weight": torch.zeros(2, 32), "classifier.bias": torch.zeros(2)},
              str(wrong / "head.safetensors"))  # two rows for three labels
    with pytest.raises(CheckpointError, match="does not fit 3 labels"):
        EncoderClassifier(wrong)
    plain = build_sentence_bert(tmp_path / "plain", max_seq_length=12)
    assert not is_encoder_classifier(plain)
    with pytest.raises(CheckpointError, match="'classifier' must be a table"):
        EncoderClassifier(plain)
    other = classifier_dir(tmp_path / "labels", labels=["ok", "bad"])
    with pytest.raises(Exception, match="needs the label 'unsafe'"):
        SafetySidecar.load(other)


def test_a_sidecars_file_points_the_safety_sidecar_at_a_classifier_folder(tmp_path):
    from noesis.sidecars.config import load_sidecars

    path = classifier_dir(tmp_path / "clf")
    file = tmp_path / "sidecars.toml"
    file.write_text(f'[sidecars.safety]\nmodel = "{path}"\nthreshold = 0.7\n')
    (spec,) = load_sidecars(file).sidecars
    assert spec.model == str(path.resolve())
    runtime = load_sidecars(file).build()
    try:
        sidecar = runtime.lanes["safety"].sidecar
        assert isinstance(sidecar.classifier, EncoderClassifier) and sidecar.threshold == 0.7
    finally:
        runtime.close()


def test_the_models_recommended_threshold_is_the_sidecars_default(tmp_path):
    """A classifier's config may recommend a threshold (its validation split's choice): the
    safety sidecar takes it unless its config or caller sets one; without it, 0.8."""
    from noesis.sidecars.config import load_sidecars
    from noesis.sidecars.safety import DEFAULT_THRESHOLD

    text = "the quick brown fox jumps over the lazy dogs."
    path = classifier_dir(tmp_path / "plain")
    p_unsafe = float(EncoderClassifier(path).probabilities([text])[0, 1])
    window = Window("r", text, text, False, 0)
    recommending = classifier_dir(tmp_path / "rec", threshold=round(p_unsafe - 0.01, 4))
    assert EncoderClassifier(recommending).threshold == round(p_unsafe - 0.01, 4)
    assert EncoderClassifier(path).threshold is None
    sidecar = SafetySidecar.load(recommending)
    assert sidecar.threshold == round(p_unsafe - 0.01, 4)
    assert sidecar.decide(sidecar.run(window)) == "block"
    assert SafetySidecar.load(recommending, threshold=0.99).threshold == 0.99
    assert SafetySidecar.load(path).threshold == DEFAULT_THRESHOLD
    file = tmp_path / "sidecars.toml"
    file.write_text(f'[sidecars.safety]\nmodel = "{recommending}"\n')
    (spec,) = load_sidecars(file).sidecars
    assert spec.threshold is None and "threshold the model's" in spec.describe()
    runtime = load_sidecars(file).build()
    try:
        assert runtime.lanes["safety"].sidecar.threshold == round(p_unsafe - 0.01, 4)
    finally:
        runtime.close()
    for bad in (0, 1.5, "high", True):
        config = json.loads((recommending / "config.json").read_text())
        config["classifier"]["threshold"] = bad
        (recommending / "config.json").write_text(json.dumps(config))
        with pytest.raises(CheckpointError, match="classifier.threshold"):
            EncoderClassifier(recommending)


def _rewrite(folder, change):
    """The folder's encoder weights (model.safetensors) passed through `change`."""
    from safetensors.torch import load_file

    state = load_file(str(folder / "model.safetensors"))
    save_file({k: v.contiguous() for k, v in change(state).items()},
              str(folder / "model.safetensors"))


def _int8_rows(state):
    """Each matrix as int8 codes and a scale a row (the bundled classifier's storage, as
    train_safety_encoder.py --export writes it with noesis quantize's int8 rounding)."""
    from noesis.quant.quantize import quantize_int8

    out = {}
    for name, value in state.items():
        if value.dim() == 2 and value.is_floating_point():
            codes, zeros, scales = quantize_int8(value, -1)
            out[name] = (codes - zeros).to(torch.int8)
            out[name + ".row_scale"] = scales[:, 0]
        else:
            out[name] = value
    return out


def test_int8_row_storage_loads_as_its_float_values(tmp_path):
    import shutil

    texts = ["the quick brown fox", "hello world jumps over the lazy dogs", "blue"]
    stored = classifier_dir(tmp_path / "int8")
    original = EncoderClassifier(stored).probabilities(texts)
    _rewrite(stored, _int8_rows)
    as_float = tmp_path / "float"
    shutil.copytree(stored, as_float)

    def dequantize(state):
        return {name: value.float() * state[name + ".row_scale"].float()[:, None]
                if value.dtype == torch.int8 else value
                for name, value in state.items() if not name.endswith(".row_scale")}

    _rewrite(as_float, dequantize)
    got = EncoderClassifier(stored).probabilities(texts)
    torch.testing.assert_close(got, EncoderClassifier(as_float).probabilities(texts), atol=1e-6,
                               rtol=0)
    assert not torch.equal(got, original)  # the codes were rounded, and that is what loads
    torch.testing.assert_close(got, original, atol=2e-2, rtol=0)


def test_int8_row_storage_without_its_scales_or_with_stray_ones_is_refused(tmp_path):
    from noesis.errors import CheckpointMismatch

    missing = classifier_dir(tmp_path / "missing")
    _rewrite(missing, lambda s: {k: v for k, v in _int8_rows(s).items()
                                 if k != "embeddings.word_embeddings.weight.row_scale"})
    with pytest.raises(CheckpointMismatch, match="word_embeddings.weight.row_scale"):
        EncoderClassifier(missing)
    stray = classifier_dir(tmp_path / "stray")
    _rewrite(stray, lambda s: {**s, "encoder.nothing.row_scale": torch.ones(3)})
    with pytest.raises(CheckpointMismatch, match="row scales of no encoder tensor"):
        EncoderClassifier(stray)
    wrong = classifier_dir(tmp_path / "wrong")
    _rewrite(wrong, lambda s: {k: v[:2] if k.endswith("word_embeddings.weight.row_scale") else v
                               for k, v in _int8_rows(s).items()})
    with pytest.raises(CheckpointMismatch, match="need \\["):
        EncoderClassifier(wrong)
