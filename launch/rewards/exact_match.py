"""Reward function for the built-in synthetic tasks: 1.0 when the response equals the reference
answer (the dataset's label), else 0.0. Signature as OpenRLHF users write it."""

import torch


def reward_func(queries, prompts, labels):
    """queries: prompt + response texts; prompts: the prompt texts; labels: reference answers."""
    responses = [q[len(p):] for q, p in zip(queries, prompts)]
    return torch.tensor([float(r.strip() == str(label).strip()) for r, label in zip(responses, labels)])
