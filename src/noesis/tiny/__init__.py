"""noesis-tiny: the bundled default model pair and everything that makes it.

tools (the built-in tools), lexicon and english (entities and plain text), corpus (seeded Harmony
conversations with scoring metadata), harmony and template (rendering and parsing), tokenizer,
data (token streams), model and train (the Llama that is trained), evaluate (scoring functions),
harness (`noesis eval tools`: held-out conversations through the engine, tools run for real) and
chat (the Harmony chat display and built-in tool loop of `noesis chat`). Only harness and chat use
the engine; the training side imports none of it.
"""
