"""noesis-tiny: the bundled default model pair and everything that makes it.

tools (the built-in tools), lexicon and english (entities and plain text), corpus (seeded Harmony
conversations with scoring metadata), harmony and template (rendering and parsing), tokenizer,
data (token streams), model and train (the Llama that is trained), evaluate (scoring functions).
Nothing here imports the engine; the engine may import tools, harmony, corpus and evaluate.
"""
