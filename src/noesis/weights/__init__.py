"""Weights: checkpoint resolution (local dir or Hub cache), safetensors reading, strict loading."""
