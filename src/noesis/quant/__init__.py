"""Weight-only int4/int8 projections kept packed in memory: AWQ and GPTQ checkpoints, and the
`noesis quantize` writer.

- `scheme`: what a checkpoint's quantization_config declares (`WeightQuant`), checked once.
- `packing`: the in-memory packed layout and the AWQ / GPTQ checkpoint layouts converted into it.
- `linear`: `PackedLinear`, the projection a quantized checkpoint's model uses.
- `kernel`: the dequantizing Triton matmul (CUDA).
- `gguf_packed`: GGUF files' block-quantized projections kept packed (`GGUFLinear`).
- `quantize`: round-to-nearest quantization of a float checkpoint (`noesis quantize`).
- `info`: what `noesis info` says about a packed checkpoint's weight bytes.
"""
