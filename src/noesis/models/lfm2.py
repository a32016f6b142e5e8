"""LFM2: a pre-norm decoder whose layers are either attention (q/k norms, GQA) or a gated short
convolution, with Hugging Face names.

A conv layer projects x to (B, C, x'), convolves B * x' over time per channel with a short causal
kernel (3 taps), gates the result by C and projects it back. Its only memory of the past is the
kernel - 1 previous inputs of the convolution, kept per sequence in `kv/conv_state.py`: read when a
sequence continues (decode, a later prefill chunk), ignored when it starts at position 0, written
after every step. `weights/mapping.py` declares the few renamed tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from noesis.models.config import ModelConfig
from noesis.models.layers import Attention, GatedMLP, RMSNorm

if TYPE_CHECKING:
    from noesis.kv.conv_state import ConvLayerState
    from noesis.runner.inputs import AttentionMetadata


class ShortConv(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dim, kernel, bias = config.hidden_size, config.conv_kernel, config.conv_bias
        self.kernel = kernel
        self.in_proj = nn.Linear(dim, 3 * dim, bias=bias)
        self.conv = nn.Conv1d(dim, dim, kernel, groups=dim, bias=bias)  # weight [D, 1, K]
        self.out_proj = nn.Linear(dim, dim, bias=bias)

    def forward(self, x: torch.Tensor, state: ConvLayerState, meta: AttentionMetadata):
        gate_in, gate_out, values = self.in_proj(x).chunk(3, dim=-1)  # B, C, x: [T, D] each
        inputs = gate_in * values
        out = torch.empty_like(inputs)
        for span in meta.prefills:
            rows = slice(span.q_start, span.q_start + span.q_len)
            slot = state.slot_of_page[span.pages[:1]]  # [1]
            fresh = span.ctx_len == span.q_len  # starts at position 0: nothing before it
            out[rows] = self._span(inputs[rows], state.inputs, slot, fresh)
        if meta.decode_rows.numel():
            slots = state.slot_of_page[meta.decode_pages[:, 0]]  # [Bd]
            out[meta.decode_rows] = self._decode(inputs[meta.decode_rows], state.inputs, slots)
        return self.out_proj(gate_out * out)

    def _span(self, inputs, states, slot, fresh: bool) -> torch.Tensor:
        """One sequence's new inputs [n, D] after its stored ones (zeros when fresh)."""
        # index_select, not states[slot[0]]: a tensor index would read the slot back to the host
        past = torch.zeros_like(states[0]) if fresh else states.index_select(0, slot)[0]
        window = torch.cat((past, inputs))  # [K-1+n, D]
        states.index_copy_(0, slot, window[None, 1 - self.kernel :])
        taps = self._taps()
        n = inputs.shape[0]
        out = sum(window[j : j + n] * taps[j] for j in range(self.kernel))
        return out if self.conv.bias is None else out + self.conv.bias

    def _decode(self, inputs, states, slots) -> torch.Tensor:
        """One new input per sequence [Bd, D], each after its slot's stored ones."""
        window = torch.cat((states[slots], inputs[:, None]), dim=1)  # [Bd, K, D]
        states.index_copy_(0, slots, window[:, 1:])
        out = (window * self._taps()).sum(dim=1)  # [Bd, D]
        return out if self.conv.bias is None else out + self.conv.bias

    def _taps(self) -> torch.Tensor:
        """The depthwise kernel [K, D], oldest input first. The taps are summed in float
        arithmetic of the inputs' dtype rather than by conv1d, which cuDNN may run in TF32."""
        return self.conv.weight[:, 0, :].T


class Lfm2Layer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.is_conv = layer_index in config.conv_layers
        if self.is_conv:
            self.conv = ShortConv(config)
        else:
            self.self_attn = Attention(config, layer_index)
        self.feed_forward = GatedMLP(config)
        self.operator_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, residual, cos, sin, cache, meta, attention):
        """Pre-norm block on the residual stream; returns (block output, residual so far)."""
        normed, residual = self.operator_norm.add_forward(hidden, residual)
        if self.is_conv:
            hidden = self.conv(normed, cache, meta)
        else:
            hidden = self.self_attn(normed, cos, sin, cache, meta, attention)
        normed, residual = self.ffn_norm.add_forward(hidden, residual)
        return self.feed_forward(normed), residual


class Lfm2Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Lfm2Layer(config, i) for i in range(config.num_layers))
        self.embedding_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)  # the final norm


class Lfm2LM(nn.Module):
    """Token ids [T] -> (hidden, residual) [T, D]; `compute_logits` projects chosen rows."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Lfm2Model(config)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(self, input_ids, cos, sin, caches, meta, attention):
        hidden = self.model.embed_tokens(input_ids)  # [T, D]
        residual = None
        for layer, cache in zip(self.model.layers, caches, strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, cache, meta, attention)
        return hidden, residual

    def compute_logits(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """Final norm and LM head over the chosen rows only: [B, D] -> [B, V] float32."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        hidden, _ = self.model.embedding_norm.add_forward(hidden, residual)
        return F.linear(hidden, weight).float()
