"""The control plane (AIF-lite): per-session belief, the Φ controller, think budget, emit-vs-tool
and the binding gate, behind one ControlPolicy. Pure Python: it reads per-token metrics that the
sampler computes on the device (noesis.sampling.metrics) and never touches a tensor."""

from noesis.control.belief import BeliefState, Phase
from noesis.control.policy import POLICIES, ControlPolicy, DefaultPolicy, NullPolicy, make_policy

__all__ = [
    "POLICIES",
    "BeliefState",
    "ControlPolicy",
    "DefaultPolicy",
    "NullPolicy",
    "Phase",
    "make_policy",
]
