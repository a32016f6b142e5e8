"""The routed experts on CUDA in Triton: one launch per projection over all active experts, with
the weights in the model dtype or as MXFP4 tensor-core fragments (weights/mxfp4.py's
`Mxfp4Fragments`, kernels/mxfp4_mma.py; gpt-oss's experts, repacked at load).

Two layouts of the (token, expert) pairs, both free of host syncs and of data-dependent shapes,
so a CUDA graph captures them:
- few pairs (decode): each pair is its own row, a GEMV against its expert's weights. gate_up
  and down run over (pair, column block) programs (at batch 1 a token's k experts side by
  side, not one after another); down writes each pair's weighted row in float32 and a small
  kernel sums the k slots in order. MXFP4 fragments run `frag_gemv.frag_gemv` (inline
  mma.sync) here, for a bfloat16 x; other dtypes take the sorted layout.
- more pairs: the pairs are sorted by expert on the device into blocks of BLOCK_M rows, each
  expert's rows padded to a whole block in buffers sized for the worst case (as fused-MoE
  kernels do); each block runs a tiled tl.dot against its one expert (MXFP4 fragments decoded
  a chunk of 64 columns at a time, `mxfp4_mma.frag_tile`). down finishes as in the decode
  layout.

Values are rounded to the model dtype where the PyTorch path rounds them (after each projection,
after the activation). The decode layout's kernels and the routing take programmatic dependent
launch (kernels/pdl.py): each launches while the one before it finishes and waits for it before
its first read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from noesis.kernels import pdl
from noesis.kernels.asm import bf16x2_asm, word_aligned
from noesis.kernels.frag_gemv import frag_gemv, frag_matmul
from noesis.kernels.pdl import gdc_launch_dependents, gdc_wait
from noesis.kernels.row_gemv import _or
from noesis.weights.mxfp4 import Mxfp4Fragments, Mxfp4Weight

Weight = torch.Tensor | Mxfp4Fragments


@dataclass(frozen=True)
class Tiles:
    """Columns per program, the K tile and warps of one kernel."""

    block_n: int
    block_k: int
    num_warps: int


# Decode (gate_up, down) in the model dtype: narrow column blocks, so that even one token's pairs
# fill the GPU. The best of sweeps at batch 1 (`benchmarks/moe_gemv_sweep.py --tiles gemv`,
# RESULTS.md) on the H200: Qwen3-30B-A3B's down on 8-column blocks.
GEMV_TILES = (Tiles(16, 256, 4), Tiles(8, 256, 4))
SORTED = Tiles(64, 64, 4)
# The fragment-layout MXFP4 GEMV (mxfp4_mma): (tiles of 16 rows a program, warps sharing a
# tile's chunks, chunks of 64 columns a warp's iteration) for gate_up and down; the best of
# `benchmarks/mxfp4_fragments.py --tiles` on the H200 (RESULTS.md, seventeenth session).
FRAG_TILES = ((1, 4, 2), (1, 4, 2))
# The sorted layout over fragments: tiles of 16 rows a program for gate_up (8 columns of gate
# and of up each) and down.
FRAG_SORTED_TILES = (8, 4)
# Warps of the routing kernel: one program a token, whose k passes each reduce over the experts
# twice. On one warp the reductions are register shuffles; on Triton's default of 4 they also
# cross warps through shared memory (sm_90 PTX at 128 experts and top 8: 53 barriers against 0).
# Chosen from that count, not timed yet: moe_gemv_sweep.py times 2 and 4 against it.
ROUTE_WARPS = 1


def uses_gemv(num_pairs: int, num_experts: int, top_k: int) -> bool:
    """Pairs as rows while they are few against the experts (repeats of an expert are rare and
    sorting would cost more than they do): up to a quarter of the experts, at least top_k."""
    return num_pairs <= max(top_k, num_experts // 4)


def block_rows(num_pairs: int, num_experts: int) -> int:
    """Rows per sorted block: small while each expert gets few pairs (padding is wasted work)."""
    per_expert = num_pairs / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64


def experts(
    x: torch.Tensor,  # [T, H]
    ids: torch.Tensor,  # [T, k]
    weights: torch.Tensor,  # [T, k]
    gate_up: Weight,  # [E, 2I, H]
    down: Weight,  # [E, H, I]
    limit: float | None,
    alpha: float,
    gate_up_bias: torch.Tensor | None = None,  # [E, 2I]
    down_bias: torch.Tensor | None = None,  # [E, H]
    residual: torch.Tensor | None = None,  # [T, H]
) -> torch.Tensor:
    """sum over k of weights[t, k] * expert_{ids[t, k]}(x[t]) -> [T, H] in x's dtype (then +
    residual, rounded again, in the same kernel); the activation is silu(gate) * up, or
    gpt-oss's clamped SwiGLU when `limit` is set."""
    _check(x, ids, weights, gate_up, down, gate_up_bias, down_bias)
    if residual is not None and (residual.shape != x.shape or not residual.is_contiguous()):
        raise ValueError(f"residual {list(residual.shape)} is not a contiguous {list(x.shape)}")
    tokens, top_k = ids.shape
    if tokens == 0:
        return torch.empty_like(x) if residual is None else residual.clone()
    x, ids, weights = x.contiguous(), ids.contiguous(), weights.contiguous()
    glu = dict(limit=0.0 if limit is None else float(limit), alpha=float(alpha))
    glu["CLAMP"] = limit is not None
    act = torch.empty(tokens * top_k, down.shape[2], dtype=x.dtype, device=x.device)  # [P, I]
    gemv = uses_gemv(tokens * top_k, gate_up.shape[0], top_k)
    if isinstance(gate_up, Mxfp4Fragments):  # the mma GEMV multiplies bfloat16
        run = _frag_experts if gemv and x.dtype == torch.bfloat16 else _frag_sorted_experts
    else:
        run = _gemv_experts if gemv else _sorted_experts
    partial = run(x, ids, weights, gate_up, down, gate_up_bias, down_bias, act, glu)
    return _sum_slots(partial, tokens, top_k, x.dtype, residual)


def route(logits: torch.Tensor, top_k: int, routing: str, renormalize: bool):
    """noesis.kernels.moe.route in one launch (a program per token) instead of torch's three to
    five (softmax, topk, sum, divide): the same float32 arithmetic, the same output dtypes;
    equal logits are taken lowest expert first."""
    tokens, num_experts = logits.shape
    softmax_first = routing != "topk_softmax"
    dtype = torch.float32 if softmax_first else logits.dtype
    weights = torch.empty(tokens, top_k, dtype=dtype, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    if tokens:
        _route_kernel[(tokens,)](
            logits.contiguous(), weights, ids, E=num_experts, TOP_K=top_k,
            BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_K=triton.next_power_of_2(top_k),
            SOFTMAX_FIRST=softmax_first, RENORMALIZE=softmax_first and renormalize,
            num_warps=ROUTE_WARPS, **pdl.pdl_launch(logits),
        )  # fmt: skip
    return weights, ids


def align_by_expert(flat_ids: torch.Tensor, num_experts: int, block_m: int):
    """Pair ids [P] -> (rows [R] int32: the pair in each row, P on padding rows; experts [B]
    int32: the expert of each block of block_m rows, -1 past the last used block). R = B *
    block_m with B = ceil(P / block_m) + min(E, P), enough whatever the routing; no host sync."""
    num_pairs = flat_ids.numel()
    num_blocks = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    device = flat_ids.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))  # bincount would sync
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)  # [E]
    order = torch.argsort(flat_ids, stable=True)  # [P] pairs grouped by expert
    expert_of = flat_ids[order]
    rank = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[expert_of]
    dest = (block_end - blocks)[expert_of] * block_m + rank
    rows = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    rows[dest] = order.to(torch.int32)
    block_ids = torch.arange(num_blocks, device=device)
    experts = torch.searchsorted(block_end, block_ids, right=True)  # E past the used blocks
    experts = torch.where(experts < num_experts, experts, -1).to(torch.int32)
    return rows, experts


def _gemv_experts(x, ids, weights, gate_up, down, gate_up_bias, down_bias, act, glu):
    tokens, top_k = ids.shape
    hidden, inner = x.shape[1], act.shape[1]
    tiles = GEMV_TILES[0]
    _gemv_gate_up[(tokens * top_k, triton.cdiv(inner, tiles.block_n))](
        x, ids, gate_up, _or(gate_up_bias, x), act, glu["limit"], glu["alpha"], TOP_K=top_k,
        H=hidden, I=inner, HAS_BIAS=gate_up_bias is not None, CLAMP=glu["CLAMP"],
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, num_warps=tiles.num_warps,
        **pdl.pdl_launch(x),
    )  # fmt: skip
    tiles = GEMV_TILES[1]
    partial = torch.empty(tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    _gemv_down[(tokens * top_k, triton.cdiv(hidden, tiles.block_n))](
        act, ids, weights, down, _or(down_bias, x), partial, H=hidden, I=inner,
        HAS_BIAS=down_bias is not None, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps, **pdl.pdl_launch(x),
    )  # fmt: skip
    return partial


def _frag_experts(x, ids, weights, gate_up, down, gate_up_bias, down_bias, act, glu):
    x = word_aligned(x)  # read as int32 words
    tokens, top_k = ids.shape
    hidden, inner = x.shape[1], act.shape[1]
    no_asm = not bf16x2_asm(x.device)  # the same condition: sm_80 on, not interpreted
    tiles, split, chunks = FRAG_TILES[0]
    _frag_gate_up[(tokens * top_k, triton.cdiv(gate_up.tiles, tiles))](
        x, ids, gate_up.words, gate_up.scales, _or(gate_up_bias, x), act, glu["limit"],
        glu["alpha"], TOP_K=top_k, H=hidden, I=inner, NT=gate_up.tiles, KC=gate_up.chunks,
        HAS_BIAS=gate_up_bias is not None, CLAMP=glu["CLAMP"], WARPS=tiles, KSPLIT=split,
        CH=chunks, NO_ASM=no_asm, num_warps=tiles * split, **pdl.pdl_launch(x),
    )  # fmt: skip
    tiles, split, chunks = FRAG_TILES[1]
    partial = torch.empty(tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    _frag_down[(tokens * top_k, triton.cdiv(down.tiles, tiles))](
        act, ids, weights, down.words, down.scales, _or(down_bias, x), partial, H=hidden,
        I=inner, NT=down.tiles, KC=down.chunks, HAS_BIAS=down_bias is not None, WARPS=tiles,
        KSPLIT=split, CH=chunks, NO_ASM=no_asm, num_warps=tiles * split, **pdl.pdl_launch(x),
    )  # fmt: skip
    return partial


def _sum_slots(partial: torch.Tensor, tokens: int, top_k: int, dtype: torch.dtype,
               residual: torch.Tensor | None):
    """[T * k, H] float32 weighted expert outputs -> [T, H] in dtype, summed in slot order, then
    + residual [T, H] (rounded again) if given."""
    hidden = partial.shape[1]
    out = torch.empty(tokens, hidden, dtype=dtype, device=partial.device)
    block = min(1024, triton.next_power_of_2(hidden))
    _sum_slots_kernel[(tokens, triton.cdiv(hidden, block))](
        partial, out, out if residual is None else residual, TOP_K=top_k, H=hidden,
        BLOCK=block, RESIDUAL=residual is not None, **pdl.pdl_launch(partial),
    )  # fmt: skip
    return out


def _sorted_blocks(x, ids, num_experts):
    """(pair of each row, expert of each block, rows a block, tl.dot precision) of the sorted
    layout."""
    block_m = block_rows(ids.numel(), num_experts)
    rows, block_experts = align_by_expert(ids.flatten(), num_experts, block_m)
    return rows, block_experts, block_m, "ieee" if x.dtype == torch.float32 else "tf32"


def _sorted_experts(x, ids, weights, gate_up, down, gate_up_bias, down_bias, act, glu):
    tokens, top_k = ids.shape
    hidden, inner = x.shape[1], act.shape[1]
    num_pairs = tokens * top_k
    rows, block_experts, block_m, precision = _sorted_blocks(x, ids, gate_up.shape[0])
    num_blocks = block_experts.numel()
    tiles = SORTED
    _sorted_gate_up[(num_blocks, triton.cdiv(inner, tiles.block_n))](
        x, rows, block_experts, gate_up, _or(gate_up_bias, x), act, num_pairs, glu["limit"],
        glu["alpha"], TOP_K=top_k, H=hidden, I=inner, HAS_BIAS=gate_up_bias is not None,
        CLAMP=glu["CLAMP"], BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        PRECISION=precision, num_warps=tiles.num_warps,
    )  # fmt: skip
    partial = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)  # [P, H]
    _sorted_down[(num_blocks, triton.cdiv(hidden, tiles.block_n))](
        act, rows, block_experts, weights, down, _or(down_bias, x), partial, num_pairs,
        H=hidden, I=inner, HAS_BIAS=down_bias is not None, BLOCK_M=block_m,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, PRECISION=precision,
        num_warps=tiles.num_warps,
    )  # fmt: skip
    return partial


def _frag_sorted_experts(x, ids, weights, gate_up, down, gate_up_bias, down_bias, act, glu):
    tokens, top_k = ids.shape
    hidden, inner = x.shape[1], act.shape[1]
    rows, block_experts, block_m, precision = _sorted_blocks(x, ids, gate_up.shape[0])
    num_pairs, num_blocks = tokens * top_k, block_experts.numel()
    tiles = FRAG_SORTED_TILES[0]
    _frag_sorted_gate_up[(num_blocks, triton.cdiv(gate_up.tiles, tiles))](
        x, rows, block_experts, gate_up.words, gate_up.scales, _or(gate_up_bias, x), act,
        num_pairs, glu["limit"], glu["alpha"], TOP_K=top_k, H=hidden, I=inner, NT=gate_up.tiles,
        KC=gate_up.chunks, HAS_BIAS=gate_up_bias is not None, CLAMP=glu["CLAMP"],
        BLOCK_M=block_m, TILES=tiles, PRECISION=precision, num_warps=4,
    )  # fmt: skip
    tiles = FRAG_SORTED_TILES[1]
    partial = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)  # [P, H]
    _frag_sorted_down[(num_blocks, triton.cdiv(down.tiles, tiles))](
        act, rows, block_experts, weights, down.words, down.scales, _or(down_bias, x), partial,
        num_pairs, H=hidden, I=inner, NT=down.tiles, KC=down.chunks,
        HAS_BIAS=down_bias is not None, BLOCK_M=block_m, TILES=tiles, PRECISION=precision,
        num_warps=4,
    )  # fmt: skip
    return partial


def _check(x, ids, weights, gate_up, down, gate_up_bias, down_bias) -> None:
    num_experts, two_inner, hidden = gate_up.shape
    inner = two_inner // 2
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"x {list(x.shape)} does not match gate_up {list(gate_up.shape)}")
    if tuple(down.shape) != (num_experts, hidden, inner):
        raise ValueError(f"down {list(down.shape)} does not match gate_up {list(gate_up.shape)}")
    if ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"ids {list(ids.shape)} and weights {list(weights.shape)} must both "
                         f"be [{x.shape[0]}, k]")  # fmt: skip
    for name, tensor in (("gate_up", gate_up), ("down", down)):
        if isinstance(tensor, Mxfp4Weight):
            raise TypeError(f"{name}: MXFP4 experts run as tensor-core fragments on CUDA; "
                            "repack them with Mxfp4Fragments.pack (a load does)")  # fmt: skip
        if isinstance(tensor, Mxfp4Fragments):  # built contiguous by Mxfp4Fragments.pack
            if tensor.gate_up != (name == "gate_up"):
                raise ValueError(f"{name}'s fragments were packed as "
                                 f"{'gate_up' if tensor.gate_up else 'down'}'s")  # fmt: skip
            continue
        if tensor.dtype != x.dtype or not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous {x.dtype}, got {tensor.dtype}")
    for name, bias, size in (
        ("gate_up_bias", gate_up_bias, two_inner),
        ("down_bias", down_bias, hidden),
    ):
        if bias is not None and (
            tuple(bias.shape) != (num_experts, size) or not bias.is_contiguous()
        ):
            raise ValueError(
                f"{name} {list(bias.shape)} is not a contiguous [{num_experts}, {size}]"
            )


# ---- kernels ---------------------------------------------------------------------------------


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr, E: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, SOFTMAX_FIRST: tl.constexpr,
    RENORMALIZE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One token: softmax over the experts then the top k (renormalized if asked), or the top
    k logits then a softmax over them; k passes of max / lowest index of the max."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + token * E + experts, mask=experts < E, other=float("-inf"))
    scores = logits.to(tl.float32)
    if SOFTMAX_FIRST:
        exp = tl.exp(scores - tl.max(scores, 0))
        scores = tl.where(experts < E, exp / tl.sum(exp, 0), float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    values = tl.full((BLOCK_K,), float("-inf"), tl.float32)  # slots past k stay -inf
    chosen = tl.zeros((BLOCK_K,), tl.int64)
    for slot in tl.static_range(TOP_K):
        best = tl.max(scores, 0)
        index = tl.min(tl.where(scores == best, experts, BLOCK_E), 0)
        values = tl.where(slots == slot, best, values)
        chosen = tl.where(slots == slot, index.to(tl.int64), chosen)
        scores = tl.where(experts == index, float("-inf"), scores)
    if not SOFTMAX_FIRST:
        exp = tl.exp(values - tl.max(values, 0))  # 0 past k
        values = exp / tl.sum(exp, 0)
    if RENORMALIZE:
        values = values / tl.sum(tl.where(slots < TOP_K, values, 0.0), 0)
    out = token * TOP_K + slots
    tl.store(weights_ptr + out, values.to(weights_ptr.dtype.element_ty), mask=slots < TOP_K)
    tl.store(ids_ptr + out, chosen, mask=slots < TOP_K)


@triton.jit
def _gemv_gate_up(
    x_ptr, ids_ptr, w_ptr, bias_ptr, act_ptr, limit, alpha,
    TOP_K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, HAS_BIAS: tl.constexpr,
    CLAMP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """act[p, cols] = glu(x[p // k] @ gate_up[ids[p]].T): one pair, BLOCK_N columns of gate and
    the same of up, read as 2 * BLOCK_N interleaved rows (gate, up, gate, ...)."""
    if PDL:
        gdc_wait()  # the expert ids
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    r = tl.arange(0, 2 * BLOCK_N)
    cols = tl.program_id(1) * BLOCK_N + r // 2
    rows = cols + (r % 2) * I
    x_row = x_ptr + (pair // TOP_K).to(tl.int64) * H
    acc = _gemv(x_row, w_ptr, expert, rows, cols < I, 2 * I, H, 2 * BLOCK_N, BLOCK_K)
    if PDL:
        gdc_launch_dependents()
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * 2 * I + rows, mask=cols < I, other=0.0).to(tl.float32)
    gate, up = tl.split(tl.reshape(acc.to(act_ptr.dtype.element_ty), (BLOCK_N, 2)))
    hidden = _glu(gate.to(tl.float32), up.to(tl.float32), limit, alpha, CLAMP)
    out_cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    hidden = hidden.to(act_ptr.dtype.element_ty)
    tl.store(act_ptr + pair.to(tl.int64) * I + out_cols, hidden, mask=out_cols < I)


@triton.jit
def _gemv_down(
    act_ptr, ids_ptr, weights_ptr, w_ptr, bias_ptr, out_ptr,
    H: tl.constexpr, I: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[p, cols] = weight[p] * (act[p] @ down[ids[p]].T) in float32, one pair per program
    (a token's k pairs run side by side; _sum_slots_kernel adds them)."""
    if PDL:
        gdc_wait()  # the activations
    pair = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    act_row = act_ptr + pair.to(tl.int64) * I
    y = _gemv(act_row, w_ptr, expert, cols, col_ok, H, I, BLOCK_N, BLOCK_K)
    if PDL:
        gdc_launch_dependents()
    if HAS_BIAS:
        y += tl.load(bias_ptr + expert * H + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = y.to(act_ptr.dtype.element_ty).to(tl.float32)
    y *= tl.load(weights_ptr + pair).to(tl.float32)
    tl.store(out_ptr + pair.to(tl.int64) * H + cols, y, mask=col_ok)


@triton.jit
def _frag_gate_up(
    x_ptr, ids_ptr, w_ptr, s_ptr, bias_ptr, act_ptr, limit, alpha,
    TOP_K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, NT: tl.constexpr, KC: tl.constexpr,
    HAS_BIAS: tl.constexpr, CLAMP: tl.constexpr, WARPS: tl.constexpr, KSPLIT: tl.constexpr,
    CH: tl.constexpr, NO_ASM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """act[p, cols] = glu(x[p // k] @ gate_up[ids[p]].T) over fragment-layout weights, WARPS
    tiles a program, whose rows g and g + 8 are gate and up of column 8T + g."""
    pair, expert, tile0, gate, up = _pair_frag_gemv(x_ptr, TOP_K, ids_ptr, w_ptr, s_ptr, NT, KC,
                                                    H, WARPS, KSPLIT, CH, NO_ASM, PDL)  # fmt: skip
    m = tl.arange(0, WARPS * 32)
    cols = (tile0 + m // 32) * 8 + (m % 32) // 4
    ok = (m % 4 == 0) & (cols < I)
    if HAS_BIAS:
        gate += tl.load(bias_ptr + expert * 2 * I + cols, mask=ok, other=0.0).to(tl.float32)
        up += tl.load(bias_ptr + expert * 2 * I + I + cols, mask=ok, other=0.0).to(tl.float32)
    dtype = act_ptr.dtype.element_ty
    hidden = _glu(gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), limit, alpha, CLAMP)
    tl.store(act_ptr + pair.to(tl.int64) * I + cols, hidden.to(dtype), mask=ok)


@triton.jit
def _frag_down(
    act_ptr, ids_ptr, weights_ptr, w_ptr, s_ptr, bias_ptr, out_ptr,
    H: tl.constexpr, I: tl.constexpr, NT: tl.constexpr, KC: tl.constexpr,
    HAS_BIAS: tl.constexpr, WARPS: tl.constexpr, KSPLIT: tl.constexpr, CH: tl.constexpr,
    NO_ASM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[p, rows] = weight[p] * (act[p] @ down[ids[p]].T) in float32 over fragment-layout
    weights (_sum_slots_kernel adds a token's k pairs)."""
    pair, expert, tile0, y_g, y_h = _pair_frag_gemv(act_ptr, 1, ids_ptr, w_ptr, s_ptr, NT, KC, I,
                                                    WARPS, KSPLIT, CH, NO_ASM, PDL)  # fmt: skip
    m = tl.arange(0, WARPS * 32)
    rows = (tile0 + m // 32) * 16 + (m % 32) // 4
    weight = tl.load(weights_ptr + pair).to(tl.float32)
    out = out_ptr + pair.to(tl.int64) * H
    bias = bias_ptr + expert * H
    ok = m % 4 == 0
    _frag_down_rows(y_g, rows, ok, bias, weight, out, act_ptr, H, HAS_BIAS)
    _frag_down_rows(y_h, rows + 8, ok, bias, weight, out, act_ptr, H, HAS_BIAS)


@triton.jit
def _pair_frag_gemv(x_ptr, PAIRS_A_ROW: tl.constexpr, ids_ptr, w_ptr, s_ptr, NT: tl.constexpr,
                    KC: tl.constexpr, K: tl.constexpr, WARPS: tl.constexpr, KSPLIT: tl.constexpr,
                    CH: tl.constexpr, NO_ASM: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """The decode layout's program over fragments: its pair, expert and first tile, and
    frag_gemv of x's row pair // PAIRS_A_ROW [K], between PDL's wait and release."""
    if PDL:
        gdc_wait()  # the expert ids and x
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // PAIRS_A_ROW).to(tl.int64) * K
    tile0 = tl.program_id(1) * WARPS
    sums_g, sums_h = frag_gemv(x_row, w_ptr, s_ptr, expert, tile0, NT, KC, K, WARPS, KSPLIT, CH,
                               NO_ASM, 0, 1, 1)  # fmt: skip  (FORMAT 0: MXFP4)
    if PDL:
        gdc_launch_dependents()
    return pair, expert, tile0, sums_g, sums_h


@triton.jit
def _frag_down_rows(y, rows, ok, bias, weight, out, act_ptr, H: tl.constexpr,
                    HAS_BIAS: tl.constexpr):  # fmt: skip
    ok = ok & (rows < H)
    if HAS_BIAS:
        y += tl.load(bias + rows, mask=ok, other=0.0).to(tl.float32)
    y = y.to(act_ptr.dtype.element_ty).to(tl.float32) * weight
    tl.store(out + rows, y, mask=ok)


@triton.jit
def _frag_sorted_gate_up(
    x_ptr, rows_ptr, experts_ptr, w_ptr, s_ptr, bias_ptr, act_ptr, num_pairs, limit, alpha,
    TOP_K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, NT: tl.constexpr, KC: tl.constexpr,
    HAS_BIAS: tl.constexpr, CLAMP: tl.constexpr, BLOCK_M: tl.constexpr, TILES: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """_sorted_gate_up over fragment-layout weights: one block of BLOCK_M pairs of one expert,
    TILES tiles (8 columns of gate, the tiles' rows g, and of up, rows g + 8)."""
    expert = tl.load(experts_ptr + tl.program_id(0))
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    pairs, pair_ok = _block_pairs(rows_ptr, num_pairs, BLOCK_M)
    tile0 = tl.program_id(1) * TILES
    x_rows = x_ptr + (pairs // TOP_K).to(tl.int64) * H
    gate, up = frag_matmul(x_rows, pair_ok, w_ptr, s_ptr, expert, tile0, NT, KC, H, TILES, BLOCK_M,
                           PRECISION, 0, 1, 1, 0, KC)  # fmt: skip  (FORMAT 0: MXFP4)
    cols = tile0 * 8 + tl.arange(0, 8 * TILES)
    col_ok = cols < I
    if HAS_BIAS:
        bias = bias_ptr + expert * 2 * I + cols
        gate += tl.load(bias, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(bias + I, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dtype = act_ptr.dtype.element_ty
    hidden = _glu(gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), limit, alpha, CLAMP)
    out = act_ptr + pairs.to(tl.int64)[:, None] * I + cols[None, :]
    tl.store(out, hidden.to(dtype), mask=pair_ok[:, None] & col_ok[None, :])


@triton.jit
def _frag_sorted_down(
    act_ptr, rows_ptr, experts_ptr, weights_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, num_pairs,
    H: tl.constexpr, I: tl.constexpr, NT: tl.constexpr, KC: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, TILES: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """_sorted_down over fragment-layout weights: tile T's rows g and g + 8 are output rows
    16T + g and 16T + 8 + g."""
    expert = tl.load(experts_ptr + tl.program_id(0))
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    pairs, pair_ok = _block_pairs(rows_ptr, num_pairs, BLOCK_M)
    tile0 = tl.program_id(1) * TILES
    act_rows = act_ptr + pairs.to(tl.int64) * I
    low, high = frag_matmul(act_rows, pair_ok, w_ptr, s_ptr, expert, tile0, NT, KC, I, TILES,
                            BLOCK_M, PRECISION, 0, 1, 1, 0, KC)  # fmt: skip  (FORMAT 0: MXFP4)
    r = tl.arange(0, 8 * TILES)
    rows = (tile0 + r // 8) * 16 + r % 8
    weight = tl.load(weights_ptr + pairs, mask=pair_ok, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + pairs.to(tl.int64)[:, None] * H
    bias = bias_ptr + expert * H
    _frag_down_block(low, rows, pair_ok, weight, out, bias, act_ptr, H, HAS_BIAS)
    _frag_down_block(high, rows + 8, pair_ok, weight, out, bias, act_ptr, H, HAS_BIAS)


@triton.jit
def _frag_down_block(acc, rows, pair_ok, weight, out, bias, act_ptr, H: tl.constexpr,
                     HAS_BIAS: tl.constexpr):  # fmt: skip
    row_ok = rows < H
    if HAS_BIAS:
        acc += tl.load(bias + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    acc = acc.to(act_ptr.dtype.element_ty).to(tl.float32) * weight
    tl.store(out + rows[None, :], acc, mask=pair_ok[:, None] & row_ok[None, :])


@triton.jit
def _block_pairs(rows_ptr, num_pairs, BLOCK_M: tl.constexpr):
    """The sorted layout's block of BLOCK_M pair ids (num_pairs on padding rows) and which are
    real."""
    pairs = tl.load(rows_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    return pairs, pairs < num_pairs


@triton.jit
def _sum_slots_kernel(partial_ptr, out_ptr, res_ptr, TOP_K: tl.constexpr, H: tl.constexpr,
                      BLOCK: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """out[t, cols] = sum over slots 0 .. k - 1, in order, of partial[t * k + slot, cols], in the
    output dtype, plus res[t, cols] with RESIDUAL."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    total = tl.zeros((BLOCK,), tl.float32)
    for slot in tl.static_range(TOP_K):
        row = (token * TOP_K + slot).to(tl.int64) * H
        total += tl.load(partial_ptr + row + cols, mask=ok, other=0.0)
    out = total.to(out_ptr.dtype.element_ty)
    if RESIDUAL:
        out += tl.load(res_ptr + token.to(tl.int64) * H + cols, mask=ok, other=0.0)
    tl.store(out_ptr + token.to(tl.int64) * H + cols, out, mask=ok)


@triton.jit
def _sorted_gate_up(
    x_ptr, rows_ptr, experts_ptr, w_ptr, bias_ptr, act_ptr, num_pairs, limit, alpha,
    TOP_K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, HAS_BIAS: tl.constexpr,
    CLAMP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """One block of BLOCK_M pairs of one expert, BLOCK_N columns of gate and of up."""
    expert = tl.load(experts_ptr + tl.program_id(0))
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    pairs, pair_ok = _block_pairs(rows_ptr, num_pairs, BLOCK_M)
    r = tl.arange(0, 2 * BLOCK_N)
    cols = tl.program_id(1) * BLOCK_N + r // 2
    rows = cols + (r % 2) * I
    x_rows = x_ptr + (pairs // TOP_K).to(tl.int64) * H
    acc = _tile_matmul(x_rows, pair_ok, w_ptr, expert, rows, cols < I, 2 * I, H, BLOCK_M,
                       2 * BLOCK_N, BLOCK_K, PRECISION)  # fmt: skip
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * 2 * I + rows, mask=cols < I, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    gate, up = tl.split(tl.reshape(acc.to(act_ptr.dtype.element_ty), (BLOCK_M, BLOCK_N, 2)))
    hidden = _glu(gate.to(tl.float32), up.to(tl.float32), limit, alpha, CLAMP)
    out_cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    out = act_ptr + pairs.to(tl.int64)[:, None] * I + out_cols[None, :]
    hidden = hidden.to(act_ptr.dtype.element_ty)
    tl.store(out, hidden, mask=pair_ok[:, None] & (out_cols < I)[None, :])


@triton.jit
def _sorted_down(
    act_ptr, rows_ptr, experts_ptr, weights_ptr, w_ptr, bias_ptr, out_ptr, num_pairs,
    H: tl.constexpr, I: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """out[p, cols] = weight[p] * (act[p] @ down[expert].T) in float32, for a block of pairs."""
    expert = tl.load(experts_ptr + tl.program_id(0))
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    pairs, pair_ok = _block_pairs(rows_ptr, num_pairs, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    act_rows = act_ptr + pairs.to(tl.int64) * I
    acc = _tile_matmul(act_rows, pair_ok, w_ptr, expert, cols, col_ok, H, I, BLOCK_M, BLOCK_N,
                       BLOCK_K, PRECISION)  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * H + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    acc = acc.to(act_ptr.dtype.element_ty).to(tl.float32)
    acc *= tl.load(weights_ptr + pairs, mask=pair_ok, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + pairs.to(tl.int64)[:, None] * H + cols[None, :]
    tl.store(out, acc, mask=pair_ok[:, None] & col_ok[None, :])


@triton.jit
def _gemv(x_row, w_ptr, expert, rows, row_ok, N: tl.constexpr, K: tl.constexpr,
          ROWS: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """W[expert, rows] @ x_row -> [ROWS] float32, K in BLOCK_K tiles."""
    # Each iteration issues the next tile's loads before it computes on this one: a plain range
    # loop is not software-pipelined.
    acc = tl.zeros((ROWS, BLOCK_K), tl.float32)
    x, w = _plain_tile(x_row, w_ptr, expert, rows, row_ok, 0, N, K, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        next_x, next_w = _plain_tile(x_row, w_ptr, expert, rows, row_ok, k0 + BLOCK_K, N, K,
                                     BLOCK_K)  # fmt: skip
        acc += w.to(tl.float32) * x[None, :]
        x, w = next_x, next_w
    return tl.sum(acc, axis=1)


@triton.jit
def _plain_tile(x_row, w_ptr, expert, rows, row_ok, k0, N: tl.constexpr, K: tl.constexpr,
                BLOCK_K: tl.constexpr):  # fmt: skip
    """x's K tile at k0 as float32 and W[expert, rows]'s (0 past K)."""
    cols = k0 + tl.arange(0, BLOCK_K)
    x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + expert * N * K + rows[:, None] * K + cols[None, :],
                mask=row_ok[:, None] & (cols < K)[None, :], other=0.0)  # fmt: skip
    return x, w


@triton.jit
def _tile_matmul(x_rows, x_ok, w_ptr, expert, rows, row_ok, N: tl.constexpr, K: tl.constexpr,
                 BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr):  # fmt: skip
    """x[BLOCK_M rows at x_rows] @ W[expert, rows].T -> [BLOCK_M, ROWS] float32."""
    acc = tl.zeros((BLOCK_M, ROWS), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows[:, None] + cols[None, :],
                    mask=x_ok[:, None] & (cols < K)[None, :], other=0.0)  # fmt: skip
        w = tl.load(w_ptr + expert * N * K + rows[:, None] * K + cols[None, :],
                    mask=row_ok[:, None] & (cols < K)[None, :], other=0.0)  # fmt: skip
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _glu(gate, up, limit, alpha, CLAMP: tl.constexpr):
    if CLAMP:  # gpt-oss
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        return (up + 1) * gate * tl.sigmoid(gate * alpha)
    return gate * tl.sigmoid(gate) * up
