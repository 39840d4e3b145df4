"""The engine's KV memory: fixed-size blocks, their reference counts, and the radix prefix cache.

Layout. Each layer's keys and values live in one tensor `[K, num_blocks, block_size, H]` (kv
head major); a request holds a block table (a list of block ids) and its token at position p
sits in block `table[p // block_size]`, row `p % block_size`, of every kv head. Head-major, so
that gathering a batch's blocks (attention.py) lays each kv head's keys out as one contiguous
`[G, S, H]` run, the operand of a batched matmul as it is. Blocks let requests that share a prompt prefix
share its KV memory: the radix cache maps token prefixes, one full block at a time, to the block
that holds their KV.

Ownership. A block is either private to one request, or owned by the radix tree (a node) and
used by any number of requests. `refcount[b]` counts the requests that use block b. A block is
free when no request uses it and no node owns it; a node whose block no request uses is
evictable once it is a leaf, least recently used first. Only full blocks enter the tree, so a
block in the tree is never written again (a request writes only past its cached prefix).

Device: the blocks (and the routed-expert slots) live on the engine's device (`device`); the
block tables, reference counts and the tree are host-side Python state.

Tensor names (STYLE rule 10): L layers, K kv heads, H head dim.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence

import torch


class OutOfBlocksError(RuntimeError):
    """No free block even after evicting every unused cached block (the scheduler retracts then)."""


class KVCache:
    """Per-layer key and value blocks, and the pool that hands blocks out.

    `expert_slots_TLk` (MoE models only) keeps, for every token slot, the experts the token was
    routed to in each MoE layer, so a request can report routed experts for cached prefix tokens
    that another request computed.
    """

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV cache needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        shape = (num_kv_heads, num_blocks, block_size, head_dim)
        with torch.inference_mode():
            self.k_blocks = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
            self.v_blocks = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.expert_slots_TLk: torch.Tensor | None = None
        self.refcount = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: low ids first
        self.tree = RadixCache(self)

    def release_memory(self) -> None:
        """Give the key and value blocks' memory back (every block must be free; the prefix cache is
        flushed first); `reclaim_memory` allocates them again."""
        self.tree.flush()
        if len(self._free) != self.num_blocks:
            raise ValueError(f"{self.num_blocks - len(self._free)} KV blocks are in use: release needs an idle engine")
        if self.k_blocks and self.k_blocks[0].numel():
            self._shape = (self.k_blocks[0].shape, self.k_blocks[0].dtype)
            self.k_blocks = [t.new_empty(0) for t in self.k_blocks]
            self.v_blocks = [t.new_empty(0) for t in self.v_blocks]

    def reclaim_memory(self) -> None:
        if self.k_blocks and not self.k_blocks[0].numel():
            shape, dtype = self._shape
            with torch.inference_mode():
                self.k_blocks = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in self.k_blocks]
                self.v_blocks = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in self.v_blocks]

    @property
    def released(self) -> bool:
        return bool(self.k_blocks) and not self.k_blocks[0].numel()

    @staticmethod
    def bytes_per_block(*, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype = torch.float32) -> int:
        element_bytes = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element_bytes

    def enable_expert_capture(self, num_moe_layers: int, top_k: int) -> None:
        if self.expert_slots_TLk is None:
            with torch.inference_mode():
                self.expert_slots_TLk = torch.zeros(
                    (self.num_blocks * self.block_size, num_moe_layers, top_k), dtype=torch.int32, device=self.device)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def allocate(self, count: int) -> list[int]:
        """Take `count` blocks (each with one reference), evicting cached blocks if needed.

        Raises `OutOfBlocksError` (and takes nothing) when even a fully evicted cache falls short.
        """
        if count > len(self._free):
            self.tree.evict(count - len(self._free))
        if count > len(self._free):
            raise OutOfBlocksError(f"need {count} KV blocks, {len(self._free)} free after evicting the prefix cache")
        blocks = [self._free.pop() for _ in range(count)]
        for b in blocks:
            self.refcount[b] = 1
        return blocks

    def can_allocate(self, count: int) -> bool:
        return count <= len(self._free) + self.tree.num_evictable()

    def retain(self, blocks: Sequence[int]) -> None:
        """Add one reference to each block (cached blocks a request matched, or shared ones)."""
        for b in blocks:
            if self.refcount[b] == 0 and b in self.tree.node_of_block:
                self.tree.num_unused -= 1
            self.refcount[b] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; free those no request uses and no node owns."""
        for b in blocks:
            self.refcount[b] -= 1
            assert self.refcount[b] >= 0, f"block {b} released more often than retained"
            if self.refcount[b] == 0:
                if b in self.tree.node_of_block:
                    self.tree.num_unused += 1
                else:
                    self._free.append(b)

    def free_unowned(self, block: int) -> None:
        """Return a block that the tree has just dropped (no request uses it)."""
        assert self.refcount[block] == 0
        self._free.append(block)


class _Node:
    __slots__ = ("block", "children", "key", "last_use", "parent")

    def __init__(self, key: tuple[int, ...], block: int, parent: _Node | None, last_use: int) -> None:
        self.key = key
        self.block = block
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.last_use = last_use


class RadixCache:
    """Token prefixes → KV blocks, one full block per node; LRU eviction of unused leaves."""

    def __init__(self, cache: KVCache) -> None:
        self._cache = cache
        self._root = _Node((), -1, None, 0)
        self.node_of_block: dict[int, _Node] = {}
        self._clock = itertools.count(1)
        # Nodes whose block no request uses. Eviction takes leaves only, so this is an upper bound
        # on what it can free (a used node may hang below an unused one, rarely).
        self.num_unused = 0

    def __len__(self) -> int:
        return len(self.node_of_block)

    def num_evictable(self) -> int:
        """At most how many blocks eviction can free now."""
        return self.num_unused

    def match(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Blocks holding the longest cached prefix of token_ids, at most max_tokens long (full blocks)."""
        size = self._cache.block_size
        node, blocks, now = self._root, [], next(self._clock)
        for start in range(0, max_tokens - size + 1, size):
            child = node.children.get(tuple(token_ids[start:start + size]))
            if child is None:
                break
            child.last_use = now
            blocks.append(child.block)
            node = child
        return blocks

    def insert(self, token_ids: Sequence[int], blocks: Sequence[int], num_tokens: int) -> None:
        """Cache the full blocks of token_ids[:num_tokens], whose KV lives in `blocks`.

        Where the tree already holds a block for a prefix (computed by another request), it keeps
        its own and the caller's stays private, to be freed when the caller releases it.
        """
        size = self._cache.block_size
        node, now = self._root, next(self._clock)
        for i in range(num_tokens // size):
            key = tuple(token_ids[i * size:(i + 1) * size])
            child = node.children.get(key)
            if child is None:
                block = blocks[i]
                if block in self.node_of_block:  # already cached under another prefix: cannot happen
                    raise AssertionError(f"block {block} is cached twice")
                child = _Node(key, block, node, now)
                node.children[key] = child
                self.node_of_block[block] = child
                if self._cache.refcount[block] == 0:
                    self.num_unused += 1
            child.last_use = now
            node = child

    def evict(self, count: int) -> int:
        """Free up to `count` unused blocks, least recently used leaves first; return how many."""
        leaves = [(n.last_use, id(n), n) for n in self.node_of_block.values()
                  if not n.children and self._cache.refcount[n.block] == 0]
        heapq.heapify(leaves)
        freed = 0
        while leaves and freed < count:
            _, _, node = heapq.heappop(leaves)
            self._drop(node)
            freed += 1
            parent = node.parent
            if parent is not self._root and not parent.children and self._cache.refcount[parent.block] == 0:
                heapq.heappush(leaves, (parent.last_use, id(parent), parent))
        return freed

    def _drop(self, node: _Node) -> None:
        del node.parent.children[node.key]
        del self.node_of_block[node.block]
        self.num_unused -= 1
        self._cache.free_unowned(node.block)

    def flush(self) -> int:
        """Forget every cached prefix: free unused blocks, leave used ones to their requests.

        A block that a running request still uses stays allocated and becomes private to it, so
        the request runs on; it is freed when the request releases it. Returns the blocks freed.
        """
        freed = 0
        for block in list(self.node_of_block):
            del self.node_of_block[block]
            if self._cache.refcount[block] == 0:
                self._cache.free_unowned(block)
                freed += 1
        self._root.children.clear()
        self.num_unused = 0
        return freed
