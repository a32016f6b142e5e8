"""The decode GEMV over fragment-layout weights (MXFP4 experts, int4 projections) with the
weights brought in by the bulk tensor copy engine (TMA, Hopper on), written in Gluon.

`frag_gemv` (frag_gemv.py) keeps each warp's next chunks in registers, so a warp has about one
iteration of loads in flight and a multiprocessor some tens of KB: at gpt-oss-20b's shapes
(batch 1) the expert GEMVs ran at 1.5-1.9 TB/s. Here a program asks the copy engine for its
whole slab of weights at once (every stage's copy is issued before the first is read, each
completing on its own mbarrier), so the bytes in flight are bounded by shared memory (9-10
programs of ~24 KB a multiprocessor), not by registers. The arithmetic per chunk is
frag_gemv's inline mma (MXFP4_CHUNK_ASM, INT4_*_CHUNK_ASM) on the same lanes: shared memory
holds the global layout, [tiles, chunks, 128 words], and lane l reads its words 4l .. 4l + 3.

A program: one row of x (MXFP4: one (token, expert) pair) and TILES tiles of 16 rows, every
chunk of K in NSTAGE stages of STAGE chunks (the copy engine zero-fills chunks past K's); x
and the scale words come by plain loads (x from L1). Under PDL the copies start as early as
their addresses are known: int4's weights before the wait (they never change); the experts'
after it (the routing kernel wrote the ids), and with EARLY down's before its wait (the ids
are two kernels old), with RELEASE gate_up lets down launch once its copies are issued.

Off by default (moe_triton.TMA, quant.kernel.TMA): an experiment, not yet faster. Its first
version (16-byte innermost copy boxes) ran 12-40% slower than frag_gemv on an H100
(benchmarks/RESULTS.md, twenty-fourth session); this one, 512-byte rows, is compiled and
checked for sm_90 on the CPU but not yet timed. `benchmarks/mxfp4_fragments.py --tma` and
`int4_fragments.py --tma` time it beside frag_gemv; if it does not win there, delete it.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from noesis.kernels.frag_gemv import INT4_CONSTRAINTS
from noesis.kernels.int4_mma import INT4_BF16_CHUNK_ASM, INT4_F16_CHUNK_ASM
from noesis.kernels.mxfp4_mma import MXFP4_CHUNK_ASM

# (tiles a program, chunks a stage, warps) for gate_up and down at batch 1.
TMA_TILES = ((1, 16, 4), (1, 16, 4))
# Under PDL (module docstring): gate_up releases down early, down fetches before its wait.
RELEASE, EARLY = False, False


@gluon.constexpr_function
def _chunk_layout(warps):
    """[tiles, chunks, 32 lanes, 4] with lane l of a warp on its own 4 words, warps along the
    chunks; its slice over the last dimension holds the running sums."""
    return gl.BlockedLayout([1, 1, 1, 4], [1, 1, 32, 1], [1, warps, 1, 1], [3, 2, 1, 0])


@gluon.jit
def _tma_issue(w_desc, expert, tile0, NT: gl.constexpr, KC: gl.constexpr, TILES: gl.constexpr,
               STAGE: gl.constexpr):  # fmt: skip
    """Every stage's copy of tiles tile0 .. tile0 + TILES - 1 of expert's (rows of the
    [E * NT, KC, 128] words) set going -> (shared memory, its mbarriers). Tiles past NT get
    the next expert's words (the caller masks them), past the last expert zeros."""
    NSTAGE: gl.constexpr = (KC + STAGE - 1) // STAGE
    row = (expert * NT + tile0).to(gl.int32)  # the copy engine's coordinates are 32-bit
    smem = gl.allocate_shared_memory(gl.int32, [NSTAGE, TILES, STAGE, 128], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NSTAGE):
        mbarrier.init(bars.index(s), count=1)
    for s in gl.static_range(NSTAGE):  # every copy in flight before the first is read
        mbarrier.expect(bars.index(s), w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(w_desc, [row, s * STAGE, 0],
                                        bars.index(s), smem.index(s))  # fmt: skip
    return smem, bars


@gluon.jit
def _tma_sums(smem, bars, x_row, s_ptr, expert, tile0, NT: gl.constexpr, KC: gl.constexpr,
              K: gl.constexpr, TILES: gl.constexpr, STAGE: gl.constexpr, WARPS: gl.constexpr,
              FORMAT: gl.constexpr, GC: gl.constexpr, NG: gl.constexpr):  # fmt: skip
    """_tma_issue's tiles times x_row -> (sums of rows g, of rows g + 8) [TILES, 32] float32,
    lane-major like frag_gemv's, each stage read as its copy lands. FORMAT, GC and NG as
    frag_gemv's: MXFP4 (a scale word per tile, chunk and g) or int4 (a scale and a zero word
    per tile, group of GC chunks and g; NG groups a tile)."""
    row_tile0 = expert * NT + tile0
    NSTAGE: gl.constexpr = (KC + STAGE - 1) // STAGE
    L4: gl.constexpr = _chunk_layout(WARPS)
    L3: gl.constexpr = gl.SliceLayout(3, L4)
    LW: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 1, 32], [1, WARPS, 1], [2, 1, 0])
    t3 = gl.arange(0, TILES, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))[:, None, None]
    c3 = gl.arange(0, STAGE, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))[None, :, None]
    l3 = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))[None, None, :]
    q4 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4))))
    q4 = q4[None, None, None, :]
    xw = x_row.to(gl.pointer_type(gl.uint32))
    sum_g = gl.zeros([TILES, STAGE, 32], gl.float32, L3)
    sum_h = gl.zeros([TILES, STAGE, 32], gl.float32, L3)
    for s in gl.static_range(NSTAGE):
        c = s * STAGE + c3
        ok = c < KC
        s_ok = ok & (tile0 + t3 < NT)
        if FORMAT == 0:
            sw = gl.load(s_ptr + ((row_tile0 + t3).to(gl.int64) * KC + c) * 8 + l3 // 4,
                         mask=s_ok, other=0)  # fmt: skip
        else:
            p_at = (((row_tile0 + t3).to(gl.int64) * NG + c // GC) * 8 + l3 // 4) * 2
            pw = gl.load(s_ptr + p_at, mask=s_ok, other=0)
            zw = gl.load(s_ptr + p_at + 1, mask=s_ok, other=0)
        x_at = gl.expand_dims(c * 32 + (l3 % 4) * 4, 3) + q4  # [1, STAGE, 32, 4]
        if K % 64 == 0:  # whole chunks: the chunk's mask covers x (16-byte loads)
            xa = gl.load(xw + x_at, mask=gl.expand_dims(ok, 3), other=0)
            xb = gl.load(xw + x_at + 16, mask=gl.expand_dims(ok, 3), other=0)
        else:
            xa = gl.load(xw + x_at, mask=gl.expand_dims(ok, 3) & (x_at < K // 2), other=0)
            xb = gl.load(xw + x_at + 16, mask=gl.expand_dims(ok, 3) & (x_at + 16 < K // 2),
                         other=0)  # fmt: skip
        mbarrier.wait(bars.index(s), 0)
        words = smem.index(s).load(LW)  # lane l: its words 4l .. 4l + 3 of each chunk
        w0, w1, w2, w3 = _quad(gl.reshape(words, [TILES, STAGE, 32, 4]), L3)
        x0, x1, x2, x3 = _quad(xa, L3)
        x4, x5, x6, x7 = _quad(xb, L3)
        if FORMAT == 0:
            sum_g, sum_h = gl.inline_asm_elementwise(
                MXFP4_CHUNK_ASM, "=f,=f,f,f,r,r,r,r,r,r,r,r,r,r,r,r,r",
                [sum_g, sum_h, w0, w1, w2, w3, x0, x1, x2, x3, x4, x5, x6, x7, sw],
                dtype=(gl.float32, gl.float32), is_pure=True, pack=1,
            )  # fmt: skip
        else:
            operands = [sum_g, sum_h, w0, w1, w2, w3, x0, x1, x2, x3, x4, x5, x6, x7, pw, zw]
            sum_g, sum_h = gl.inline_asm_elementwise(
                INT4_F16_CHUNK_ASM if FORMAT == 2 else INT4_BF16_CHUNK_ASM, INT4_CONSTRAINTS,
                operands, dtype=(gl.float32, gl.float32), is_pure=True, pack=1,
            )  # fmt: skip
    for s in gl.static_range(NSTAGE):
        mbarrier.invalidate(bars.index(s))
    sum_g, sum_h = gl.sum(sum_g, axis=1), gl.sum(sum_h, axis=1)
    if FORMAT == 0:  # MXFP4's codes were value x 2^-126, x's pairs x 2^100: 2^26 back
        sum_g, sum_h = sum_g * 67108864.0, sum_h * 67108864.0
    return sum_g, sum_h


@gluon.jit
def _quad(t, layout: gl.constexpr):
    """[..., 4] -> its four columns, each in `layout`."""
    even, odd = gl.split(gl.reshape(t, [t.shape[0], t.shape[1], t.shape[2], 2, 2]))
    a, c = gl.split(even)
    b, d = gl.split(odd)
    return (gl.convert_layout(a, layout), gl.convert_layout(b, layout),
            gl.convert_layout(c, layout), gl.convert_layout(d, layout))  # fmt: skip


@gluon.jit
def _tma_gate_up(
    x_ptr, ids_ptr, w_desc, s_ptr, bias_ptr, act_ptr, limit, alpha,
    TOP_K: gl.constexpr, H: gl.constexpr, I: gl.constexpr, NT: gl.constexpr, KC: gl.constexpr,
    HAS_BIAS: gl.constexpr, CLAMP: gl.constexpr, TILES: gl.constexpr, STAGE: gl.constexpr,
    WARPS: gl.constexpr, PDL: gl.constexpr, RELEASE: gl.constexpr,
):  # fmt: skip
    """act[p, cols] = glu(x[p // k] @ gate_up[ids[p]].T): moe_triton._frag_gate_up's contract."""
    if PDL:
        gdc_wait()  # the expert ids and x
    pair = gl.program_id(0)
    expert = gl.load(ids_ptr + pair)
    tile0 = gl.program_id(1) * TILES
    smem, bars = _tma_issue(w_desc, expert, tile0, NT, KC, TILES, STAGE)
    if PDL and RELEASE:  # down may start (and fetch its weights) while these compute
        gdc_launch_dependents()
    x_row = x_ptr + (pair // TOP_K).to(gl.int64) * H
    gate, up = _tma_sums(smem, bars, x_row, s_ptr, expert, tile0, NT, KC, H, TILES, STAGE,
                         WARPS, 0, 1, 1)  # fmt: skip  (MXFP4)
    if PDL and not RELEASE:
        gdc_launch_dependents()
    L2: gl.constexpr = gate.type.layout
    t = gl.arange(0, TILES, layout=gl.SliceLayout(1, L2))[:, None]
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, L2))[None, :]
    cols = (tile0 + t) * 8 + lane // 4
    ok = (lane % 4 == 0) & (cols < I)
    if HAS_BIAS:
        bias = bias_ptr + expert.to(gl.int64) * 2 * I + cols
        gate += gl.load(bias, mask=ok, other=0.0).to(gl.float32)
        up += gl.load(bias + I, mask=ok, other=0.0).to(gl.float32)
    dtype: gl.constexpr = act_ptr.dtype.element_ty
    gate = gate.to(dtype).to(gl.float32)
    up = up.to(dtype).to(gl.float32)
    if CLAMP:  # gpt-oss
        gate = gl.minimum(gate, limit)
        up = gl.minimum(gl.maximum(up, -limit), limit)
        hidden = (up + 1) * gate / (1 + gl.exp(-gate * alpha))
    else:
        hidden = gate / (1 + gl.exp(-gate)) * up
    gl.store(act_ptr + pair.to(gl.int64) * I + cols, hidden.to(dtype), mask=ok)


@gluon.jit
def _tma_down(
    act_ptr, ids_ptr, weights_ptr, w_desc, s_ptr, bias_ptr, out_ptr,
    H: gl.constexpr, I: gl.constexpr, NT: gl.constexpr, KC: gl.constexpr,
    HAS_BIAS: gl.constexpr, TILES: gl.constexpr, STAGE: gl.constexpr, WARPS: gl.constexpr,
    PDL: gl.constexpr, EARLY: gl.constexpr,
):  # fmt: skip
    """out[p, rows] = weight[p] * (act[p] @ down[ids[p]].T) in float32: _frag_down's contract."""
    pair = gl.program_id(0)
    tile0 = gl.program_id(1) * TILES
    if PDL and not EARLY:
        gdc_wait()
    # EARLY: the ids were written two kernels back, done before gate_up released this one
    expert = gl.load(ids_ptr + pair)
    smem, bars = _tma_issue(w_desc, expert, tile0, NT, KC, TILES, STAGE)
    if PDL and EARLY:
        gdc_wait()  # act
    # the epilogue's operands first: fewer pointers live across the chunks (none spilled)
    L2: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(3, _chunk_layout(WARPS)))  # the sums'
    t = gl.arange(0, TILES, layout=gl.SliceLayout(1, L2))[:, None]
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, L2))[None, :]
    rows = (tile0 + t) * 16 + lane // 4
    ok_g = (lane % 4 == 0) & (rows < H)
    ok_h = (lane % 4 == 0) & (rows + 8 < H)
    b_g = gl.zeros([TILES, 32], gl.float32, L2)
    b_h = gl.zeros([TILES, 32], gl.float32, L2)
    if HAS_BIAS:
        bias = bias_ptr + expert.to(gl.int64) * H + rows
        b_g = gl.load(bias, mask=ok_g, other=0.0).to(gl.float32)
        b_h = gl.load(bias + 8, mask=ok_h, other=0.0).to(gl.float32)
    weight = gl.load(weights_ptr + pair).to(gl.float32)
    act_row = act_ptr + pair.to(gl.int64) * I
    y_g, y_h = _tma_sums(smem, bars, act_row, s_ptr, expert, tile0, NT, KC, I, TILES, STAGE,
                         WARPS, 0, 1, 1)  # fmt: skip  (MXFP4)
    if PDL:
        gdc_launch_dependents()
    out = out_ptr + pair.to(gl.int64) * H + rows
    dtype: gl.constexpr = act_ptr.dtype.element_ty
    gl.store(out, (y_g + b_g).to(dtype).to(gl.float32) * weight, mask=ok_g)
    gl.store(out + 8, (y_h + b_h).to(dtype).to(gl.float32) * weight, mask=ok_h)


@gluon.jit
def _tma_int4_gemv(
    x_ptr, w_desc, p_ptr, out_ptr, N: gl.constexpr, NT: gl.constexpr, KC: gl.constexpr,
    K: gl.constexpr, NG: gl.constexpr, GC: gl.constexpr, TILES: gl.constexpr,
    STAGE: gl.constexpr, WARPS: gl.constexpr, FORMAT: gl.constexpr, PDL: gl.constexpr,
):  # fmt: skip
    """quant.kernel._int4_frag_gemv's contract: out[r, rows] = x[r] @ W[rows].T for TILES tiles
    of 16 rows, rounded to out's dtype. The weights never change, so their copies start before
    PDL's wait, under the kernel before."""
    tile0 = gl.program_id(1) * TILES
    smem, bars = _tma_issue(w_desc, 0, tile0, NT, KC, TILES, STAGE)
    if PDL:
        gdc_wait()  # x
    r = gl.program_id(0).to(gl.int64)
    sum_g, sum_h = _tma_sums(smem, bars, x_ptr + r * K, p_ptr, 0, tile0, NT, KC, K, TILES,
                             STAGE, WARPS, FORMAT, GC, NG)  # fmt: skip
    if PDL:
        gdc_launch_dependents()
    L2: gl.constexpr = sum_g.type.layout
    t = gl.arange(0, TILES, layout=gl.SliceLayout(1, L2))[:, None]
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, L2))[None, :]
    rows = (tile0 + t) * 16 + lane // 4
    ok = lane % 4 == 0
    dtype: gl.constexpr = out_ptr.dtype.element_ty
    gl.store(out_ptr + r * N + rows, sum_g.to(dtype), mask=ok & (rows < N))
    gl.store(out_ptr + r * N + rows + 8, sum_h.to(dtype), mask=ok & (rows + 8 < N))


@functools.cache
def usable(device: torch.device) -> bool:
    """The copy engine and mbarriers: Hopper (compute capability 9.0) or later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def descriptor(frags, tiles: int, stage: int) -> TensorDescriptor:
    """The [E * NT, KC, 128] view of fragment words (int4's: [NT, KC, 128]), copied
    [tiles, stage, 128] at a time: 512-byte rows (the first version's [.., 32, 4] boxes, 16
    bytes innermost, timed 12-40% slower than frag_gemv). Kept on `frags` (Mxfp4Fragments or
    Int4Fragments), whose weights never move, per block shape."""
    words = frags.words
    cache = frags.__dict__.setdefault("_tma_descriptors", {})
    key = (words.data_ptr(), tiles, stage)  # a caller that swaps words gets a new one
    if key not in cache:
        flat = words.view(-1, words.shape[-3], 128)  # 512-byte rows: one chunk of one tile
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)
        cache[key] = TensorDescriptor.from_tensor(flat, [tiles, stage, 128], layout)
    return cache[key]


def tma_experts(x, ids, weights, gate_up, down, gate_up_bias, down_bias, act, glu, pdl_options,
                or_x):  # fmt: skip
    """moe_triton._frag_experts through the copy engine: act filled, the weighted float32
    partial [T * k, H] returned."""
    tokens, top_k = ids.shape
    hidden, inner = x.shape[1], act.shape[1]
    tiles, stage, warps = TMA_TILES[0]
    _tma_gate_up[(tokens * top_k, triton.cdiv(gate_up.tiles, tiles))](
        x, ids, descriptor(gate_up, tiles, stage), gate_up.scales, or_x(gate_up_bias),
        act, glu["limit"], glu["alpha"], TOP_K=top_k, H=hidden, I=inner, NT=gate_up.tiles,
        KC=gate_up.chunks, HAS_BIAS=gate_up_bias is not None, CLAMP=glu["CLAMP"], TILES=tiles,
        STAGE=stage, WARPS=warps, RELEASE=RELEASE, num_warps=warps, **pdl_options,
    )  # fmt: skip
    tiles, stage, warps = TMA_TILES[1]
    partial = torch.empty(tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    _tma_down[(tokens * top_k, triton.cdiv(down.tiles, tiles))](
        act, ids, weights, descriptor(down, tiles, stage), down.scales, or_x(down_bias),
        partial, H=hidden, I=inner, NT=down.tiles, KC=down.chunks,
        HAS_BIAS=down_bias is not None, TILES=tiles, STAGE=stage, WARPS=warps, EARLY=EARLY,
        num_warps=warps, **pdl_options,
    )  # fmt: skip
    return partial


# (tiles a program, chunks a stage, warps) for the int4 one-row GEMV.
INT4_TILES = (1, 16, 4)


def tma_int4_gemv(x: torch.Tensor, frags, out: torch.Tensor, fmt: int, pdl_options: dict):
    """quant.kernel.fragment_gemv through the copy engine: out [M, N] = x [M, K] @ W^T."""
    tiles, stage, warps = INT4_TILES
    _tma_int4_gemv[(x.shape[0], triton.cdiv(frags.tiles, tiles))](
        x, descriptor(frags, tiles, stage), frags.params, out, N=frags.out_features,
        NT=frags.tiles, KC=frags.chunks, K=x.shape[1], NG=frags.groups,
        GC=frags.group_size // 64, TILES=tiles, STAGE=stage, WARPS=warps, FORMAT=fmt,
        num_warps=warps, **pdl_options,
    )  # fmt: skip
    return out
