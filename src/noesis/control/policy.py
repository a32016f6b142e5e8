"""ControlPolicy: the seed's nextPhi / shouldPrune / toolVsEmit as a protocol, with the default
policy (Φ controller, EFE-lite, binding gate) and the null policy (the request's own knobs, the
model's own choices). Policies are stateless across conversations: each conversation carries a
ControlState that `begin` makes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from noesis.control.belief import BeliefState
from noesis.control.efe import Decision, EfeConfig, EfeScores, tool_vs_emit
from noesis.control.gate import BindingGate, Branch, GateConfig
from noesis.control.phi import Phi, PhiConfig, PhiController
from noesis.errors import InvalidRequest
from noesis.sampling.metrics import TokenMetrics


@dataclass(slots=True)
class ControlState:
    """One conversation's control: its belief, its Φ, the last emit-vs-tool scores."""

    belief: BeliefState
    phi: PhiController
    last_efe: EfeScores | None = None
    gate: BindingGate | None = None
    decisions: list[str] = field(default_factory=list)  # one per generation: the tool_choice


class ControlPolicy(Protocol):
    name: str

    def begin(self, base: Phi) -> ControlState: ...

    def next_phi(self, state: ControlState, metrics: TokenMetrics | None) -> Phi:
        """Fold one token's metrics into the belief; the knobs for the next token."""
        ...

    def should_prune(self, state: ControlState, branches: dict[int, Branch]) -> list[int]:
        """Keys of the branches (n > 1) to stop now."""
        ...

    def tool_vs_emit(self, state: ControlState) -> Decision:
        """At the header boundary: allow, force or forbid a tool call."""
        ...


class NullPolicy:
    """No control: the request's own knobs, every branch kept, the model decides. The belief is
    still kept (for telemetry)."""

    name = "none"

    def begin(self, base: Phi) -> ControlState:
        return ControlState(BeliefState(), PhiController(base))

    def next_phi(self, state: ControlState, metrics: TokenMetrics | None) -> Phi:
        state.belief.observe(metrics)
        return state.phi.base

    def should_prune(self, state: ControlState, branches: dict[int, Branch]) -> list[int]:
        return []

    def tool_vs_emit(self, state: ControlState) -> Decision:
        return Decision.ALLOW


class DefaultPolicy:
    name = "default"

    def __init__(
        self,
        phi: PhiConfig | None = None,
        efe: EfeConfig | None = None,
        gate: GateConfig | None = None,
    ) -> None:
        self.phi_config = phi or PhiConfig()
        self.efe_config = efe or EfeConfig()
        self.gate_config = gate or GateConfig()

    def begin(self, base: Phi) -> ControlState:
        return ControlState(BeliefState(), PhiController(base, self.phi_config),
                            gate=BindingGate(self.gate_config))  # fmt: skip

    def next_phi(self, state: ControlState, metrics: TokenMetrics | None) -> Phi:
        state.belief.observe(metrics)
        return state.phi.update(metrics, state.belief)

    def should_prune(self, state: ControlState, branches: dict[int, Branch]) -> list[int]:
        assert state.gate is not None
        return state.gate.prune(branches)

    def tool_vs_emit(self, state: ControlState) -> Decision:
        state.last_efe = tool_vs_emit(state.belief, self.efe_config)
        return state.last_efe.decision


POLICIES: dict[str, type] = {"default": DefaultPolicy, "none": NullPolicy}


def make_policy(control: str | ControlPolicy | None) -> ControlPolicy | None:
    """A policy by name ("default", "none"), a policy object as given, or None (no control)."""
    if control is None or not isinstance(control, str):
        return control
    if control not in POLICIES:
        raise InvalidRequest(f"unknown control {control!r} (available: {', '.join(POLICIES)})")
    return POLICIES[control]()
