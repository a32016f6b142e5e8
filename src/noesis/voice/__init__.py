"""Offline voice assistant: audio in, routed experts, speech out."""
