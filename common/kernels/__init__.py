"""Kernels: the CPU varlen attention kernel (flash-attention's contract), a dependency like flash-attn."""
