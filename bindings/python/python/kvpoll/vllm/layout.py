"""Where each token's keys and values lie inside a block of vLLM's CPU
KV cache, and how the blocks of one block size become those of another.

vLLM's CPU backend keeps each layer as ``[num_blocks, kv_heads,
block_size, 2 * head_size]``, but inside a head its attention kernels
store keys in an order of their own (transposed, and packed by the
instruction set they run: ``vec``, ``vec16``, ``amx``, ...). So a run of
tokens is not a run of bytes, and blocks of 32 tokens are not halves of
blocks of 64. kvpoll does not guess that order: it asks vLLM's own cache
writer where each element goes (``element_offsets``), once per block size,
and moves blocks in the prefill's order, then reorders them in place on
the decode (``regroup``)."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

#: Elements of one block the offsets below can tell apart (three passes
#: of 8 bits: every dtype vLLM's CPU backend keeps holds 0..255 exactly).
MAX_ELEMENTS = (1 << 24) - 1


def attention_isa(dtype: Any, block_size: int, head_size: int) -> Optional[str]:
    """The instruction set vLLM's CPU attention uses for blocks of
    ``block_size`` tokens (what decides the order inside a block), or None
    where this vLLM does not say."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return None
    try:
        return str(_get_attn_isa(dtype, block_size, head_size))
    except Exception:  # noqa: BLE001 - an instruction set it refuses
        return None


def element_offsets(dtype: Any, block_size: int, heads: int, head_size: int, isa: str) -> Any:
    """``offsets[t, h, kv, c]``: where, among the elements of one block,
    vLLM's CPU cache writer puts channel ``c`` of the key (``kv`` 0) or
    value (1) of head ``h`` of the block's token ``t``. Raises
    ``ValueError`` if the writer does not place every element of the
    block exactly once."""
    import torch
    from vllm import _custom_ops as ops

    n = block_size * heads * 2 * head_size
    if n > MAX_ELEMENTS:
        raise ValueError(f"blocks of {n} elements: more than {MAX_ELEMENTS} to place")
    ids = torch.arange(1, n + 1, dtype=torch.int64).view(block_size, heads, 2, head_size)
    found = torch.zeros(n, dtype=torch.int64)
    for shift in (0, 8, 16):
        digits = ((ids >> shift) & 0xFF).to(dtype)
        cache = torch.zeros(1, heads, block_size, 2 * head_size, dtype=dtype)
        kv = cache.view(1, heads, block_size * 2, head_size)
        key_cache, value_cache = kv.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(
            digits[:, :, 0].contiguous(),
            digits[:, :, 1].contiguous(),
            key_cache,
            value_cache,
            torch.arange(block_size, dtype=torch.int64),
            isa,
        )
        found |= cache.flatten().to(torch.int64) << shift
    offsets = torch.full((n + 1,), -1, dtype=torch.int64)
    offsets[found] = torch.arange(n, dtype=torch.int64)
    if (found == 0).any() or (offsets[1:] < 0).any():
        raise ValueError(f"vLLM's {isa} cache writer does not place each of a block's {n} elements once")
    return offsets[1:].view(block_size, heads, 2, head_size)


def group_order(src: Any, src_block: int, dst: Any, dst_block: int) -> Any:
    """For a group of ``lcm`` tokens held as source blocks (of
    ``src_block`` tokens, element order ``src``) laid end to end: which
    source element each element of the same tokens as destination blocks
    (``dst_block``, order ``dst``) laid end to end takes."""
    import torch

    group = max(src_block, dst_block)
    if group % min(src_block, dst_block):
        raise ValueError(f"blocks of {src_block} and {dst_block} tokens: one must divide the other")
    per_token = src[0].numel()
    t = torch.arange(group)
    src_at = (t // src_block).view(-1, 1) * (src_block * per_token) + src[t % src_block].view(group, -1)
    dst_at = (t // dst_block).view(-1, 1) * (dst_block * per_token) + dst[t % dst_block].view(group, -1)
    order = torch.empty(group * per_token, dtype=torch.int64)
    order[dst_at.flatten()] = src_at.flatten()
    return order


def regroup(caches: Sequence[Any], groups: List[List[int]], order: Any) -> None:
    """Reorders, in every layer of ``caches`` (``[num_blocks, ...]``), the
    elements of each group of blocks (their ids in token order, each group
    as long as ``order`` spans) by ``order``: from the source layout the
    blocks were filled in to the cache's own."""
    import torch

    if not groups:
        return
    per_group = len(groups[0])
    ids = torch.tensor([b for g in groups for b in g], dtype=torch.int64)
    for cache in caches:
        raw = cache.index_select(0, ids).view(len(groups), -1)
        cache.index_copy_(0, ids, raw[:, order].view(len(groups) * per_group, *cache.shape[1:]))


def block_plan(
    local: Sequence[int], remote: Sequence[int], local_tokens: int, remote_tokens: int, local_bytes: int, remote_bytes: int
) -> Tuple[List[Tuple[List[int], List[int], Tuple[int, int], Tuple[int, int]]], List[List[int]]]:
    """How blocks of ``remote_tokens`` tokens (``remote``, in token order)
    are read into blocks of ``local_tokens`` (``local``): one part read
    per share ``(local blocks, remote blocks, local byte range, remote
    byte range)``, each remote block's bytes landing whole and in token
    order across the local blocks of its group; and the local groups
    to reorder once the reads landed."""
    if local_tokens >= remote_tokens:
        k = local_tokens // remote_tokens
        if k * remote_tokens != local_tokens or remote_bytes * k != local_bytes:
            raise ValueError(f"{local_bytes}-byte blocks of {local_tokens} tokens from {remote_bytes} of {remote_tokens}")
        need = -(-len(remote) // k)
        if len(local) < need:
            raise ValueError(f"{len(remote)} blocks of {remote_tokens} tokens into {len(local)} of {local_tokens}")
        reads = []
        for m in range(k):
            idx = [j for j in range(need) if j * k + m < len(remote)]
            reads.append(
                (
                    [local[j] for j in idx],
                    [remote[j * k + m] for j in idx],
                    (m * remote_bytes, (m + 1) * remote_bytes),
                    (0, remote_bytes),
                )
            )
        return reads, [[b] for b in local[:need]]
    k = remote_tokens // local_tokens
    if k * local_tokens != remote_tokens or local_bytes * k != remote_bytes:
        raise ValueError(f"{local_bytes}-byte blocks of {local_tokens} tokens from {remote_bytes} of {remote_tokens}")
    if len(local) < len(remote) * k:
        raise ValueError(f"{len(remote)} blocks of {remote_tokens} tokens into {len(local)} of {local_tokens}")
    reads = [
        (
            [local[i * k + m] for i in range(len(remote))],
            list(remote),
            (0, local_bytes),
            (m * local_bytes, (m + 1) * local_bytes),
        )
        for m in range(k)
    ]
    return reads, [list(local[i * k : (i + 1) * k]) for i in range(len(remote))]
