"""Trust tier: read the faces, trust the body.

The ring's options (OpenRLHF's --ring_attn_size / --ring_head_stride) and their checks before any model loads. The
ring itself, common.ring_attention, is imported only where --ring_attn_size > 1: common.infra.engine.setup builds
the rings, and each model loaded for a ring keeps it (common.logprobs.ModelSettings)."""

from dataclasses import dataclass, replace


@dataclass
class RingArgs:
    ring_attn_size: int = 1
    """Ranks per attention ring: each packed row is split over this many consecutive ranks (1: no ring)."""
    ring_head_stride: int = 1
    """KV heads all-gathered per step inside a ring (must divide the model's KV head count)."""


def validate_ring_args(ring: RingArgs, world_size, model=None, data=None):
    """Checks that need no model (raise ValueError naming the flag; a ring's own in
    common.ring_attention.check_ring_args); ring_model_args then makes the ring the attention implementation.
    Returns the data-parallel size, world / ring size, for the batch arithmetic."""
    if ring.ring_attn_size < 1 or world_size % ring.ring_attn_size:
        raise ValueError(f"--ring_attn_size {ring.ring_attn_size} must divide the world size {world_size}")
    if ring.ring_head_stride < 1:
        raise ValueError(f"--ring_head_stride must be >= 1, got {ring.ring_head_stride}")
    if ring.ring_attn_size > 1:
        from common.ring_attention import check_ring_args

        check_ring_args(model, data)
    return world_size // ring.ring_attn_size


def ring_model_args(model, ring: RingArgs):
    """The model's option group (common.infra.engine.ModelArgs) with the ring as its attention implementation where
    --ring_attn_size > 1 (validate_ring_args refused any other); unchanged otherwise."""
    if ring.ring_attn_size == 1:
        return model
    from common.ring_attention import NAME

    return replace(model, attn_implementation=NAME)
