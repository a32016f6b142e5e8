"""The binding gate's engine caller: branch groups. A request run as several branches (the
server's best_of > n) tells the engine which of its requests are branches and how many of them
must finish (`keep`, its n); every GATE_EVERY tokens the engine scores the live branches for the
policy (ControlPolicy.should_prune: -entropy, -contradiction, +schema validity) and stops the
ones it names, finish_reason "pruned". What this module adds to the gate's own cap (a share of the
live branches per check, with hysteresis) is the group's: at most `max_prune_rate` of all its
branches are ever pruned, and never so many that fewer than `keep` could finish."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from noesis.control.gate import Branch
from noesis.errors import InvalidRequest
from noesis.planner.sequence import FinishReason
from noesis.structured.harmony_grammar import tool_schemas

if TYPE_CHECKING:
    from noesis.control.policy import ControlPolicy, ControlState
    from noesis.engine.request import RequestState
    from noesis.harmony.encoding import HarmonyEncoding

GATE_EVERY = 16  # tokens of the group's shortest live branch between two checks


@dataclass(slots=True)
class BranchGroup:
    states: dict[str, RequestState]  # request id -> its state, kept after it ends
    keep: int  # branches that must be able to finish
    policy: ControlPolicy  # whose should_prune decides
    control: ControlState  # the policy's: its gate keeps the hysteresis streaks
    tools: dict[str, dict[str, Any]]  # declared tool name -> its parameters schema
    max_pruned: int  # over the group's life
    next_check: int = GATE_EVERY
    pruned: list[str] = field(default_factory=list)
    contradiction: dict[str, float] = field(default_factory=dict)  # latest sidecar score


class BranchGate:
    """The engine's branch groups, checked after each step (never waiting on anything). A group
    reads its branches' RequestStates: the whole generation so far (a delta output holds only its
    last tokens), and after a branch ends, all it wrote."""

    def __init__(self, encoding: HarmonyEncoding | None = None) -> None:
        self.encoding = encoding  # a Harmony model's: tool calls are read for schema validity
        self.groups: dict[str, BranchGroup] = {}  # by each member's request id
        self.pruned_total = 0

    def add(self, states: dict[str, RequestState], keep: int, policy: ControlPolicy,
            control: ControlState, tools: list[dict[str, Any]] | None = None,
            max_prune_rate: float = 0.4) -> None:
        ids = tuple(states)
        if not 1 <= keep <= len(ids):
            raise InvalidRequest(f"keep must be in [1, {len(ids)}] for {len(ids)} branches, "
                                 f"got {keep}")
        taken = [rid for rid in ids if rid in self.groups]
        if taken:
            raise InvalidRequest(f"request {taken[0]} is already a branch of another group")
        max_pruned = min(len(ids) - keep, math.floor(max_prune_rate * len(ids)))
        group = BranchGroup(dict(states), keep, policy, control, tool_schemas(tools or []),
                            max_pruned)
        for rid in ids:
            self.groups[rid] = group

    def observe(self, contradiction: dict[str, float], pending: Iterable[str] = ()) -> list[str]:
        """After a step: `contradiction` the latest scores the contradiction sidecar returned,
        `pending` the requests whose grammar is still compiling (not running yet, not gone
        either). The request ids to prune now."""
        pending = set(pending)
        for rid, score in contradiction.items():
            if rid in self.groups:
                self.groups[rid].contradiction[rid] = score
        prune: list[str] = []
        for group in {id(g): g for g in self.groups.values()}.values():
            waiting = pending.intersection(group.states)
            running = {rid: st for rid, st in group.states.items()
                       if not st.seq.finished and rid not in waiting}  # fmt: skip
            if not running and not waiting:
                self._forget(group)  # every branch has ended
                continue
            if len(group.pruned) >= group.max_pruned or waiting or not running:
                continue  # nothing left to prune, or checked once every branch runs
            shortest = min(len(st.seq.token_ids) - st.seq.prompt_len for st in running.values())
            if shortest < group.next_check:
                continue
            group.next_check = shortest + GATE_EVERY
            prune += self._check(group, running)
        return prune

    def _check(self, group: BranchGroup, running: dict[str, RequestState]) -> list[str]:
        """Score the running branches and those that answered; prune what the policy names,
        within the group's room."""
        done = {rid: st for rid, st in group.states.items()
                if st.seq.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)}  # fmt: skip
        branches = {rid: self._branch(group, rid, st) for rid, st in running.items()}
        branches |= {rid: self._branch(group, rid, st, _final_text(st.text))
                     for rid, st in done.items()}  # fmt: skip
        named = group.policy.should_prune(group.control, branches)
        room = min(group.max_pruned - len(group.pruned), len(running) + len(done) - group.keep)
        chosen = [rid for rid in named if rid in running][: max(0, room)]
        group.pruned += chosen
        self.pruned_total += len(chosen)
        return chosen

    def _branch(self, group: BranchGroup, rid: str, state: RequestState,
                answer: str | None = None) -> Branch:
        entropies = [m.entropy for m in state.token_metrics or () if m is not None]
        mean = sum(entropies) / len(entropies) if entropies else 0.0
        generated = state.seq.token_ids[state.seq.prompt_len :]
        return Branch(mean, answer, self._schema_valid(group, generated),
                      group.contradiction.get(rid))

    def _schema_valid(self, group: BranchGroup, token_ids: list[int]) -> bool | None:
        """Whether the branch's complete tool calls name declared tools with arguments that
        validate (None: no complete call yet, no tools declared, or not a Harmony model)."""
        if self.encoding is None or not group.tools:
            return None
        if self.encoding.special.call not in token_ids:  # no call closed (a live branch: its
            return None  # <|call|> ends it): nothing to parse
        from noesis.harmony.parser import FUNCTIONS, parse_completion
        from noesis.tools.builtin import validate

        calls = [m for m in parse_completion(self.encoding, token_ids).messages
                 if m.recipient and m.recipient.startswith(FUNCTIONS)
                 and m.stop not in (None, "truncated")]  # still being written: not judged
        if not calls:
            return None
        for call in calls:
            schema = group.tools.get(call.recipient.removeprefix(FUNCTIONS))
            try:
                arguments = json.loads(call.content)
            except ValueError:
                return False
            if schema is None or validate(schema, arguments):
                return False
        return True

    def _forget(self, group: BranchGroup) -> None:
        for rid in group.states:
            self.groups.pop(rid, None)


def _final_text(text: str) -> str | None:
    from noesis.sidecars.safety import final_channel

    answer = final_channel(text).strip()
    return answer or None
