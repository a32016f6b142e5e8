"""The GPU benchmark scripts' own logic, run on the CPU (Triton's interpreter, float32, tiny
shapes), so that a lease on the lent GPU is not spent finding a bug in them. Their timing needs
CUDA graphs and is not run here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gemv_fused  # noqa: E402
import gpu_decode  # noqa: E402
import graph_ab  # noqa: E402
import sampling  # noqa: E402

from noesis.kernels import ops, pdl, row_gemv  # noqa: E402


@pytest.fixture
def tiny_layers(monkeypatch):
    monkeypatch.setattr(gemv_fused, "DEVICE", "cpu")
    monkeypatch.setattr(gemv_fused, "DTYPE", torch.float32)
    monkeypatch.setattr(gemv_fused, "VOCAB", 200)
    torch.manual_seed(0)
    return gemv_fused.Layers(hidden=64, inter=96, heads=4, kv_heads=2, head_dim=16)


def test_gemv_fused_compares_each_fused_kernel_with_its_unfused_steps(tiny_layers):
    for name, mode in gemv_fused.MODES.items():
        for config in [(4, 32, 4, 1), (8, 64, 4, 3)]:
            assert gemv_fused.reference_error(tiny_layers, name, config) < 1e-5, (name, config)
        assert mode in (row_gemv.PLAIN, row_gemv.GLU, row_gemv.QKV)
    configs = dict.fromkeys(("qkv", "o", "gate_up", "down"), (4, 32, 4, 1))
    for fused in (False, True):
        tiny_layers.layer(fused, configs)  # runs the four layers both ways


@pytest.mark.parametrize("kind", [{"bias": True}, {"qk_norm": True}], ids=["gpt-oss", "qwen3"])
def test_gemv_fused_moe_shapes_compare_attention_router_and_head(tiny_layers, kind):
    """The MoE shapes' kernels (biases; per-head q/k norms in the RoPE kernel) against the
    unfused steps: the projections, the router over the stored norm, the LM head."""
    layers = gemv_fused.Layers(hidden=64, heads=4, kv_heads=2, head_dim=16, experts=8, **kind)
    assert list(layers.modes) == ["qkv", "o", "router", "lm_head"]
    for name in layers.modes:
        assert gemv_fused.reference_error(layers, name, (4, 32, 4, 1)) < 1e-5, name


def test_swept_configs_reach_the_engine_through_graph_ab(tmp_path, monkeypatch):
    report = {"llama-1b": {
        "qkv": {"mode": 2, "n": 3072, "k": 2048, "config": [4, 1024, 8, 3], "fused_us": 5.0},
        "o": {"mode": 0, "n": 2048, "k": 2048, "config": None},  # every config failed
        "layer_fused_us": [1.0, 1.1],
    }}
    assert gemv_fused.best_configs(report) == {"2,3072,2048": [4, 1024, 8, 3]}
    path = tmp_path / "fusion.json"
    path.write_text(json.dumps(report))
    monkeypatch.setattr(row_gemv, "ROW_GEMV_TUNED", {})
    graph_ab.load_tuned(f"{path},{tmp_path / 'missing.json'}")  # a missing file is skipped
    weight = torch.empty(3072, 2048)
    assert row_gemv.row_gemv_config(row_gemv.QKV, weight) == (4, 1024, 8, 3)


@pytest.mark.parametrize(("what", "module", "flag"), [
    ("gemv", ops, "ONE_ROW_GEMV"), ("fusion", ops, "ONE_ROW_FUSION"),
    ("pdl", pdl, "PDL"),
])
def test_graph_ab_settings_flip_their_flag(monkeypatch, what, module, flag):
    monkeypatch.setattr(module, flag, None)
    monkeypatch.setattr(ops, "ONE_ROW_FUSION", ops.ONE_ROW_FUSION)  # restored afterwards
    variants = graph_ab.settings(what)
    assert list(variants) == [f"{what} on", f"{what} off"]
    for name, apply in variants.items():
        apply()
        assert getattr(module, flag) is name.endswith("on")
    if what == "pdl":
        assert ops.ONE_ROW_FUSION  # PDL is timed on the fused path


def test_the_config_table_is_written_one_config_per_line():
    table = {"NVIDIA H200": {"0,2048,2048": [4, 2048, 4, 1], "2,3072,2048": [4, 1024, 4, 1]},
             "NVIDIA H100 80GB HBM3": {"1,16384,2048": [2, 2048, 4, 3]}}
    text = gemv_fused.format_table(table)
    assert json.loads(text) == table
    assert '  "0,2048,2048": [4, 2048, 4, 1],\n' in text
    assert len(text.splitlines()) == 2 + 2 * 2 + 3  # braces, a GPU's two lines, one per config
    assert json.loads(gemv_fused.format_table({})) == {}


def test_gpu_decode_full_asks_for_every_column():
    args = gpu_decode.parse_args(["--full", "--shapes", "llama-1b"])
    assert (args.batches, args.hf_batches, args.hf_compile) == ("8,32,64,128",) * 2 + ("llama-1b",)
    assert not args.no_hf
    assert gpu_decode.parse_args([]).hf_compile == ""  # without it, transformers eager alone
    for off in ("--no-hf", "--no-hf-eager"):
        with pytest.raises(SystemExit):
            gpu_decode.parse_args(["--full", off])


def test_transformers_decode_runs_get_a_cache_of_their_own_length(tmp_path, monkeypatch):
    """transformers keeps every later static cache as long as the longest generation so far: the
    2,048-token TTFT must come after the decode runs, or they attend over 2,049 slots. Run on
    the CPU, where generate uses the static cache without compiling."""
    import transformers.generation.utils as generation
    from checkpoints import build_checkpoint

    path = build_checkpoint(tmp_path / "m", vocab_size=30016, hidden_size=32, intermediate_size=64,
                            max_position_embeddings=4096)
    sizes = []

    class Recording(generation.StaticCache):
        def __init__(self, *args, max_cache_len, **kwargs):
            sizes.append(max_cache_len)
            super().__init__(*args, max_cache_len=max_cache_len, **kwargs)

    monkeypatch.setattr(generation, "StaticCache", Recording)
    monkeypatch.setattr(gpu_decode, "NEW_TOKENS", 4)
    result = gpu_decode.bench_transformers(path, True, batches=[2], device="cpu")
    assert sizes and max(sizes[:-4]) < 2048 <= min(sizes[-4:])  # the four 2,048-token runs last
    assert set(result) >= {"ttft_128_ms", "ttft_2048_ms", "decode_tok_s", "batches"}
    assert result["batches"][2]["decode_tok_s"] > 0


def test_gpu_decode_records_the_reference_library_versions():
    import transformers

    versions = gpu_decode.library_versions()
    assert versions["transformers"] == transformers.__version__
    assert set(versions) == {"triton", "transformers"}


@pytest.mark.parametrize("name", [n for n, s in sampling.SETTINGS.items() if s[0] > 0])
def test_sampling_benchmarks_reference_path_picks_the_samplers_tokens(name):
    """The benchmark times its sampled settings against `torch_passes`, the path the race
    kernel (CUDA) and the candidate and blocked races (CPU) replaced; both must pick the same
    tokens, and each setting turns on exactly the filters it names."""
    from noesis.sampling.sampler import sample

    setting = sampling.SETTINGS[name]
    t = sampling.tensors(setting, 3, "cpu")
    logits = torch.randn(3, 5000, generator=torch.Generator().manual_seed(1)) * 2
    assert sample(logits, t).token_ids.equal(sampling.torch_passes(logits, t))
    filters = {"top_k": t.top_k, "top_p": t.top_p, "min_p": t.min_p}
    if all(f is None for f in filters.values()):
        assert "top" not in name and "min_p" not in name
        return
    for key, column in filters.items():
        on = (column > 0).all() if key != "top_p" else (column < 1).all()
        assert bool(on) == (key in name), key
