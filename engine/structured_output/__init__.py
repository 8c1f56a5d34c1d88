"""Structured outputs: grammars compiled with xgrammar and the per-step token bitmask."""
