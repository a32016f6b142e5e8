"""Best-of turns under the binding gate, as a turn generator over a noesis.LLM: each turn is
sampled as `best_of` branches (seeds apart), the engine's binding gate (noesis.control.branches)
may stop the weakest early, and the most likely branch left (cumulative logprob, as the
server's best_of ranks) is the turn. What the ablation ladder's "+gate" rung runs; the server
gates its own best_of requests the same way."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

from noesis.engine.outputs import best_of
from noesis.session import AssistantTurn, BatchedTurnGenerator, TurnRequest
from noesis.structured.grounding import user_texts

SEED_STRIDE = 1_000_003  # branch i of a seeded turn samples with seed + i * SEED_STRIDE


class BranchedTurns(BatchedTurnGenerator):
    """TurnGenerator: `LLM.generate_turns` with every turn sampled as `best_of` branches, gated
    by the conversation's policy (a Session's), else the LLM's (LLM(control=...)).
    A greedy turn would give `best_of` equal branches: it runs once, as asked. `decoded` counts
    the tokens of every branch (what the GPU paid), `pruned` the branches the gate stopped."""

    def __init__(self, llm, best_of: int = 4) -> None:
        if best_of < 2:
            raise ValueError(f"best_of must be at least 2, got {best_of}")
        self.llm, self.best_of = llm, best_of
        self.decoded = 0
        self.pruned = 0

    def generate_turns(
        self, requests: Sequence[TurnRequest], cancel: threading.Event | None = None
    ) -> list[AssistantTurn]:
        from noesis.llm import _assistant_turn  # noesis.llm imports the control package

        llm = self.llm
        inputs = [llm._turn_inputs(r.messages, r.tools, r.tool_choice, r.deterministic,
                                   **r.options) for r in requests]  # fmt: skip
        # The conversation's policy (a Session's TurnControl) gates its branches, else the LLM's
        policies = [getattr(params.control, "policy", None) or llm.engine.control.policy
                    for _, params in inputs]
        if any(policy is None for policy in policies):
            raise ValueError("gated branches need a control policy: a Session with control= or "
                             "LLM(..., control='default')")
        width = [1 if params.greedy else self.best_of for _, params in inputs]
        prompts, params = [], []
        for (prompt, base), count in zip(inputs, width, strict=True):
            for i in range(count):
                seed = None if base.seed is None else (base.seed + i * SEED_STRIDE) % 2**63
                params.append(dataclasses.replace(base, seed=seed, metrics=True,
                                                  logprobs=base.logprobs or 0))  # fmt: skip
                prompts.append(prompt)
        ids = llm._add_all(prompts, params)
        start = 0
        for r, count, policy in zip(requests, width, policies, strict=True):
            group = ids[start : start + count]
            start += count
            if count > 1:
                texts = user_texts(r.messages)
                llm.engine.add_branches(group, 1, r.tools, texts[0] if texts else None, policy)
        outputs = llm._run_to_completion(ids, False, cancel)
        self.decoded += sum(len(out.token_ids) for out in outputs)
        self.pruned += sum(out.finish_reason == "pruned" for out in outputs)
        fmt = llm._turn_format_for_turns()
        turns, start = [], 0
        for (prompt, _), count in zip(inputs, width, strict=True):
            (out,) = best_of(outputs[start : start + count], count, 1)
            start += count
            turns.append(_assistant_turn(fmt.parse(out.token_ids, prompt), prompt,
                                         out.token_ids, out.finish_reason, out.token_metrics))
        return turns
