"""Planner: sequences and the scheduler that turns them into a StepPlan. Host-only, no torch."""
