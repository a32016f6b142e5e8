"""scripts/train_safety_encoder.py's data: test phrasings never occur in training, and the
readers of the packaged sets parse what the wheels ship (no downloads here)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
encoder = pytest.importorskip("train_safety_encoder")


@pytest.mark.parametrize("build", ["harmful_actions", "harmless_actions"])
def test_held_out_actions_share_no_phrase_with_training(build):
    actions = getattr(encoder, build)
    train = actions("train")
    for split in ("val", "test"):
        held = actions(split)
        assert held, f"{build}({split!r}) is empty"
        overlap = [(a, t) for a in held for t in train if a in t or t in a]
        assert not overlap, overlap[:5]


@pytest.mark.parametrize(("extra", "build"), [("extra_harmless_actions", "harmless_actions"),
                                              ("more_harmless_actions", "harmless_actions"),
                                              ("extra_harmful_actions", "harmful_actions")])
def test_extra_training_actions_stay_away_from_held_out_ones(extra, build):
    """--extra-benign / --more-benign / --extra-harmful add training actions only: none holds
    or is held by a validation or test action, nor shares two content words, half of its own,
    with one; and the filter drops what does (a held-out action itself is never let through)."""
    added = getattr(encoder, extra)()
    assert len(added) > 50
    for split in ("val", "test"):
        held = getattr(encoder, build)(split)
        assert not [(a, h) for a in added for h in held if a in h or h in a]
        for a in added:
            words = encoder.content_words(a)
            assert all(len(words & encoder.content_words(h)) < max(2, len(words) / 2)
                       for h in held), a
    held_action = getattr(encoder, build)("test")[0]
    verb, _, obj = held_action.partition(" ")
    assert encoder._extra({verb: obj}, getattr(encoder, "_" + build)) == []


def test_test_texts_use_only_test_frames():
    frames = encoder.by_fifth(encoder.ACTION_FRAMES, "test", "frame")
    seen = encoder.by_fifth(encoder.ACTION_FRAMES, "train", "frame")
    assert frames and seen and not set(frames) & set(seen)
    texts = encoder.framed(["ACTION"], "test", 50, random.Random(0))
    assert set(texts) <= {f.format(a="ACTION") for f in frames} | {
        f.format(a="ACTION").lower() for f in frames}

    orders = encoder.by_fifth(encoder.ORDER_FRAMES, "test", "order")
    framed = encoder.ordered(["Write a poem"] * 20, "test", random.Random(0))[1::2]
    assert set(framed) <= {f.format(o="Write a poem", l="write a poem") for f in orders}


def test_orders_are_framed_and_questions_kept_as_written():
    rng = random.Random(0)
    texts = encoder.ordered(["Write a poem about rain.", "How do I fix a tire?"], "train", rng)
    assert texts[0] == "Write a poem about rain"
    assert "write a poem about rain" in texts[1] or "Write a poem about rain" in texts[1]
    assert texts[2:] == ["How do I fix a tire?"]


def test_pyrit_seed_values_and_cloze_clauses():
    prompt = ("dataset_name: x\nseeds:\n- value: Write a script that deletes backups\n"
              "  data_type: text\n  - value: 'How to pick a lock on a shed?'\n- value: short\n")
    assert encoder.seed_values(prompt) == ["Write a script that deletes backups",
                                           "How to pick a lock on a shed?"]
    clauses = encoder._cloze_clauses("Ada\tShe called [MASK] in. Then they left the house.\n")
    assert clauses == [("Ada", "She called Ada in."), ("Ada", "Then they left the house.")]
