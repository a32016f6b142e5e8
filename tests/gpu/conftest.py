"""What the GPU tests share: the small bf16 Llama (GQA, 3 layers) most of them run on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from checkpoints import build_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(
        tmp_path_factory.mktemp("gpu") / "llama",
        "llama",
        std=0.1,
        dtype=torch.bfloat16,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_hidden_layers=3,
    )
