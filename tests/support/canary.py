"""Host buffers between guard pages and canary bytes: a write outside the buffer either
kills the process (a guard page) or shows in the canaries."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np

PAGE = mmap.PAGESIZE
CANARY = 0x5C
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


class GuardedBuffer:
    """``nbytes`` usable bytes (``.array``), canary bytes up to the page boundaries on both
    sides, and an inaccessible page beyond each."""

    def __init__(self, nbytes: int, slack: int = 64):
        self.slack = slack
        inner = -(-(nbytes + 2 * slack) // PAGE) * PAGE
        self._map = mmap.mmap(-1, inner + 2 * PAGE)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        for guard in (base, base + PAGE + inner):
            if _libc.mprotect(guard, PAGE, 0) != 0:
                raise OSError(ctypes.get_errno(), "mprotect")
        self._whole = np.frombuffer(self._map, dtype=np.uint8, count=inner, offset=PAGE)
        self._whole[:] = CANARY
        start = (inner - nbytes) // 2
        self.array = self._whole[start : start + nbytes]
        self._before, self._after = self._whole[:start], self._whole[start + nbytes :]

    def canaries_intact(self) -> bool:
        return bool((self._before == CANARY).all() and (self._after == CANARY).all())


class TorchGuardedBuffer:
    """``nbytes`` usable bytes (``.tensor``) in CUDA or pinned host memory, between
    ``slack`` canary bytes on each side."""

    def __init__(self, torch, nbytes: int, where: str, slack: int = 4096):
        whole = torch.full((nbytes + 2 * slack,), CANARY, dtype=torch.uint8)
        self._whole = whole.cuda() if where == "device" else whole.pin_memory()
        self.tensor = self._whole[slack : slack + nbytes]
        self._slack = slack

    def canaries_intact(self) -> bool:
        return bool((self._whole[: self._slack] == CANARY).all()
                    and (self._whole[self._slack + self.tensor.numel() :] == CANARY).all())
