"""First-fit-decreasing bin packing: the bounded rows of common.packing.collate and the equal blocks of
common.kernels.varlen_attention's SampleBlocks."""


def pack_sequences(lengths, max_tokens):
    """First-fit-decreasing bin packing: lists of sample indices whose lengths sum to <= max_tokens."""
    rows, room = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if lengths[i] > max_tokens:
            raise ValueError(f"sample {i} has {lengths[i]} tokens, more than the row limit {max_tokens}")
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(max_tokens - lengths[i])
    return rows
