"""Weight-only int4/int8 projections kept packed in memory: AWQ and GPTQ checkpoints, and the
`noesis quantize` writer.

- `scheme`: what a checkpoint's quantization_config declares (`WeightQuant`), checked once.
- `packing`: the in-memory packed layout and the AWQ / GPTQ checkpoint layouts converted into it.
- `linear`: `PackedLinear`, the projection a quantized checkpoint's model uses.
- `kernel`: the dequantizing Triton matmul (CUDA).
- `int4_fragments`: int4 codes laid out as tensor-core fragments for `kernel.fragment_gemv`
  (measured against the stored layout by benchmarks/int4_fragments.py; not yet loaded into
  models).
- `gguf_packed`: GGUF files' block-quantized projections kept packed (`GGUFLinear`).
- `quantize`: round-to-nearest quantization of a float checkpoint (`noesis quantize`).
- `info`: what `noesis info` says about a packed checkpoint's weight bytes.
"""
