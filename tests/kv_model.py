"""A sequential model of KV-cache transfers, one block at a time, and views of what a
handler's GPU tensors and CPU pool actually hold."""

from __future__ import annotations

import numpy as np

from kvoffload.planner import chunks_used

POISON = 0xA5


class KVModel:
    """gpu[g][t]: [blocks, page] bytes; cpu[g][t]: [chunks, blocks_per_chunk, page] bytes."""

    def __init__(self, gpu, num_chunks, bpc):
        self.bpc = bpc
        self.gpu = [[np.array(t, copy=True) for t in group] for group in gpu]
        self.cpu = [[np.full((num_chunks[g], bpc, t.shape[1]), POISON, dtype=np.uint8) for t in group]
                    for g, group in enumerate(gpu)]

    def _blocks(self, block_ids, group_sizes, block_indices, chunk_ids):
        """(group, block, chunk, sub-block) of every block of a transfer."""
        b_at = c_at = 0
        for g, (n, first) in enumerate(zip(group_sizes, block_indices)):
            skip = first % self.bpc
            for i in range(n):
                pos = skip + i
                yield g, int(block_ids[b_at + i]), int(chunk_ids[c_at + pos // self.bpc]), pos % self.bpc
            b_at += n
            c_at += chunks_used(n, first, self.bpc)

    def store(self, *spec):
        for g, b, c, s in self._blocks(*spec):
            for t in range(len(self.gpu[g])):
                self.cpu[g][t][c, s] = self.gpu[g][t][b]

    def load(self, *spec):
        for g, b, c, s in self._blocks(*spec):
            for t in range(len(self.gpu[g])):
                self.gpu[g][t][b] = self.cpu[g][t][c, s]


def pool_views(handler, pool_bytes_array):
    """The handler's CPU pool as [group][tensor] arrays of [chunks, blocks_per_chunk, page]."""
    bpc = handler.layout.blocks_per_chunk
    views = []
    for group in handler.layout.groups:
        views.append([np.lib.stride_tricks.as_strided(
            pool_bytes_array[t.cpu_base - handler.pool.base:],
            shape=(group.num_cpu_chunks, bpc, t.page_bytes),
            strides=(t.cpu_stride, t.page_bytes, 1), writeable=False)
            for t in group.tensors])
    return views


def gpu_pages(tensor, page):
    """A GPU tensor as [blocks, page] bytes on the host."""
    flat = tensor.reshape(tensor.shape[0], -1).view(__import__("torch").uint8).cpu().numpy()
    return flat[:, :page]
