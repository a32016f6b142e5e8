"""Runner: turns a StepPlan into device tensors, runs the model, samples. Owns the host sync."""
