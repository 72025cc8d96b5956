"""kvoffload.jobs.methods: the handler's method argument, as names and as objects."""

import numpy as np
import pytest
import torch

import kvoffload as kv
from kvoffload.copy.methods import Batch, Kernel
from kvoffload.jobs import methods as job_methods
from kvoffload.jobs.handler import OffloadHandler
from kvoffload.pages.planner import CPUSpec, GPUSpec


@pytest.mark.parametrize("name", job_methods.NAMES)
def test_every_name_is_a_method_object_of_that_name(name):
    assert job_methods.method_object(name).name == name.split("_ctas")[0]  # the CTAs are an option


def test_objects_pass_through_and_anything_else_is_named():
    for method in (kv.Pages(kv.PagePath.KERNEL, ctas=3), kv.Auto(None), Batch(), Kernel(max_ctas=2)):
        assert job_methods.method_object(method) is method
    for bad in ("pages_fast", 3, None, "Pages"):
        with pytest.raises(ValueError, match=r"^method: expected one of \('auto', "):
            job_methods.method_object(bad)
    with pytest.raises(ValueError, match="max_slowdown: must be a number >= 0 or None"):
        kv.Auto(-0.1)


def test_a_handler_takes_a_method_object_and_its_old_knobs_are_gone():
    rng = np.random.default_rng(3)
    gpu = [[torch.from_numpy(rng.integers(0, 255, (8, 64), dtype=np.uint8)) for _ in range(2)]]
    with pytest.raises(TypeError, match="page_ctas"):
        OffloadHandler(gpu, 4, 1, page_ctas=4)
    with pytest.raises(TypeError, match="max_slowdown"):
        OffloadHandler(gpu, 4, 1, max_slowdown=0.01)
    with pytest.raises(ValueError, match="^method: expected one of"):
        OffloadHandler(gpu, 4, 1, method="pages_fast")
    expected = [t.clone() for t in gpu[0]]
    with OffloadHandler(gpu, 4, 1, method=kv.Pages(ctas=2)) as handler:
        assert handler.methods == {"store": "host", "load": "host"}  # CPU tensors: host threads
        assert handler.store("s", GPUSpec([5, 2], [2], [0]), CPUSpec([1, 3]))
        handler.wait("s")
        for t in gpu[0]:
            t.fill_(0xA5)  # poisoned before the load
        assert handler.load("l", CPUSpec([1, 3]), GPUSpec([0, 7], [2], [0]))
        handler.wait("l")
        assert all(r.success for r in handler.get_finished())
    for t, e in zip(gpu[0], expected):
        assert torch.equal(t[[0, 7]], e[[5, 2]])
        assert (t[[1, 2, 3, 4, 5, 6]] == 0xA5).all()
