"""The drafter's default limits, in one place: the engine applies them and the CLI offers them
(without importing the engine, so that `treeserve drafter --help` needs no torch)."""
from __future__ import annotations

# Longest sequence a draft model keeps state for (`--max-len` with --model): its state length.
MODEL_MAX_LEN = 8192
# Longest sequence an n-gram-only drafter keeps (`--max-len` with --ngram): the history costs 8
# bytes a token and every n-gram draft scans it, so it must be bounded (a draft over 131072 tokens
# takes a few milliseconds; over ten million, a third of a second of CPU).
NGRAM_MAX_LEN = 131072
# Sequences no request touched for this long are ended (`--idle-timeout-s`; 0: never), as the
# verifier releases its idle sequences after its own default of the same length.
IDLE_TIMEOUT_S = 600.0
