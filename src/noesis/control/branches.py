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

if TYPE_CHECKING:
    from noesis.control.policy import ControlPolicy, ControlState
    from noesis.engine.request import RequestState
    from noesis.harmony.encoding import HarmonyEncoding

GATE_EVERY = 16  # tokens of the group's shortest live branch between two checks


@dataclass(slots=True)
class BranchGroup:
    ids: tuple[str, ...]
    keep: int  # branches that must be able to finish
    policy: ControlPolicy  # whose should_prune decides
    state: ControlState  # the policy's: its gate keeps the hysteresis streaks
    tools: dict[str, dict[str, Any]]  # declared tool name -> its parameters schema
    max_pruned: int  # over the group's life
    next_check: int = GATE_EVERY
    pruned: list[str] = field(default_factory=list)
    finished: dict[str, Branch] = field(default_factory=dict)  # their final scores
    contradiction: dict[str, float] = field(default_factory=dict)  # latest sidecar score


class BranchGate:
    """The engine's branch groups, checked after each step (never waiting on anything)."""

    def __init__(self, encoding: HarmonyEncoding | None = None) -> None:
        self.encoding = encoding  # a Harmony model's: tool calls are read for schema validity
        self.groups: dict[str, BranchGroup] = {}  # by each member's request id
        self.pruned_total = 0

    def add(self, request_ids: Iterable[str], keep: int, policy: ControlPolicy,
            state: ControlState, tools: list[dict[str, Any]] | None = None,
            max_prune_rate: float = 0.4) -> None:
        ids = tuple(request_ids)
        if len(set(ids)) != len(ids):
            raise InvalidRequest("branch request ids must differ")
        if not 1 <= keep <= len(ids):
            raise InvalidRequest(f"keep must be in [1, {len(ids)}] for {len(ids)} branches, "
                                 f"got {keep}")
        taken = [rid for rid in ids if rid in self.groups]
        if taken:
            raise InvalidRequest(f"request {taken[0]} is already a branch of another group")
        max_pruned = min(len(ids) - keep, math.floor(max_prune_rate * len(ids)))
        group = BranchGroup(ids, keep, policy, state, _schemas(tools), max_pruned)
        for rid in ids:
            self.groups[rid] = group

    def observe(self, live: dict[str, RequestState], finished: dict[str, Any],
                contradiction: dict[str, float], pending: Iterable[str] = ()) -> list[str]:
        """After a step: `live` the engine's requests in flight, `finished` the outputs of the
        branches that ended this step (request id -> RequestOutput), `contradiction` the latest
        scores the contradiction sidecar returned, `pending` the requests whose grammar is still
        compiling (not running yet, not gone either). The request ids to prune now."""
        pending = set(pending)
        for rid, score in contradiction.items():
            if rid in self.groups:
                self.groups[rid].contradiction[rid] = score
        for rid, out in finished.items():
            group = self.groups.get(rid)
            if group is not None and rid not in group.pruned:
                group.finished[rid] = self._branch(group, rid, out.token_ids, out.token_metrics,
                                                   answer=_final_text(out.text))
        prune: list[str] = []
        for group in {id(g): g for g in self.groups.values()}.values():
            members = {rid: live[rid] for rid in group.ids if rid in live}
            if not members:
                if not pending.intersection(group.ids):
                    self._forget(group)  # every branch has ended
                continue
            if len(group.pruned) >= group.max_pruned:
                continue
            shortest = min(len(s.seq.token_ids) - s.seq.prompt_len for s in members.values())
            if shortest < group.next_check or pending.intersection(group.ids):
                continue  # checked once every branch runs
            group.next_check = shortest + GATE_EVERY
            prune += self._check(group, members)
        return prune

    def _check(self, group: BranchGroup, members: dict[str, RequestState]) -> list[str]:
        branches = dict(group.finished)
        for rid, state in members.items():
            generated = state.seq.token_ids[state.seq.prompt_len :]
            branches[rid] = self._branch(group, rid, generated, state.token_metrics)
        named = group.policy.should_prune(group.state, branches)
        room = min(group.max_pruned - len(group.pruned), len(members) + len(group.finished)
                   - group.keep)
        chosen = [rid for rid in named if rid in members][: max(0, room)]
        group.pruned += chosen
        self.pruned_total += len(chosen)
        return chosen

    def _branch(self, group: BranchGroup, rid: str, token_ids: list[int],
                metrics: list | None, answer: str | None = None) -> Branch:
        entropies = [m.entropy for m in metrics or () if m is not None]
        mean = sum(entropies) / len(entropies) if entropies else 0.0
        return Branch(mean, answer, self._schema_valid(group, token_ids),
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
        for rid in group.ids:
            self.groups.pop(rid, None)


def _schemas(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    schemas = {}
    for tool in tools or ():
        function = tool.get("function", tool)
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            schemas[function["name"]] = function.get("parameters") or {"type": "object"}
    return schemas


def _final_text(text: str) -> str | None:
    from noesis.sidecars.safety import final_channel

    answer = final_channel(text).strip()
    return answer or None
