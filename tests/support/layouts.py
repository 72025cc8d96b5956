"""Hypothesis strategies for random multi-group KV layouts and transfers over them."""

from hypothesis import strategies as st

from kvoffload.pages.planner import CPUSpec, GPUSpec, GroupLayout, KVLayout, TensorLayout, chunks_used


@st.composite
def transfers(draw):
    """A random multi-group layout (addresses only) and a transfer over it."""
    bpc = draw(st.integers(1, 4))
    groups, block_ids, sizes, firsts, chunk_ids = [], [], [], [], []
    gpu_at, cpu_at = 1 << 20, 1 << 30
    for _ in range(draw(st.integers(1, 3))):
        page = draw(st.sampled_from([8, 16, 40, 64]))
        gpu_stride = page + draw(st.sampled_from([0, 0, 8]))
        tensors, blocks, chunks = draw(st.integers(1, 3)), draw(st.integers(1, 12)), draw(st.integers(1, 6))
        chunk_major = draw(st.booleans())
        layout = []
        for t in range(tensors):
            if chunk_major:
                cpu_base, cpu_stride = cpu_at + t * bpc * page, tensors * bpc * page
            else:
                cpu_stride = bpc * page + draw(st.sampled_from([0, 8]))
                cpu_base = cpu_at
                cpu_at += chunks * cpu_stride + draw(st.sampled_from([0, 16]))
            layout.append(TensorLayout(gpu_at, gpu_stride, page, cpu_base, cpu_stride))
            gpu_at += blocks * gpu_stride + draw(st.sampled_from([0, 16]))
        if chunk_major:
            cpu_at += chunks * tensors * bpc * page
        groups.append(GroupLayout(tuple(layout), blocks, chunks))
        first = draw(st.integers(0, 10))
        n = draw(st.integers(0, min(blocks, chunks * bpc - first % bpc)))
        block_ids += draw(st.permutations(range(blocks)))[:n]
        chunk_ids += draw(st.permutations(range(chunks)))[: chunks_used(n, first, bpc)]
        sizes.append(n)
        firsts.append(first)
    return KVLayout(tuple(groups), bpc), GPUSpec(block_ids, sizes, firsts), CPUSpec(chunk_ids)
