"""Kernels: the CPU varlen attention kernel (flash-attention's contract) and the chunked LM head, dependencies like
flash-attn: they import nothing of common/."""

VARLEN_SDPA = "varlen_sdpa"  # varlen_attention's name with transformers, here so naming it imports no transformers
