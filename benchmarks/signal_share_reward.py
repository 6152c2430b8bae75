"""A reward file for benchmarks/bench_grpo.py --signal_share S: a share S of the prompts (chosen by a hash of the
prompt text) get rewards that differ between their samples (a hash of each response, 0 or 1), the rest reward
every sample 0, as early real runs reward most groups. The share comes from $MINRLHF_SIGNAL_SHARE."""

import hashlib
import os


def _unit(text):
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64


def reward_func(queries, prompts, labels):
    share = float(os.environ.get("MINRLHF_SIGNAL_SHARE", "1"))
    return [float(_unit(p) < share and _unit(q) < 0.5) for q, p in zip(queries, prompts)]
