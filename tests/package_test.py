"""The package face: what a user constructs, passes and catches is importable from
``kvoffload`` itself, and is the same object as in its module."""

import kvoffload
from kvoffload.copy import methods as copy_methods
from kvoffload.costs import cache as calibration_cache
from kvoffload.costs import auto
from kvoffload.jobs import handler
from kvoffload.pages import paths as page_methods
from kvoffload.pages import planner
from kvoffload.pool import memory as pool_memory
from kvoffload.pool import host_pool


def test_every_exported_name_exists():
    missing = [name for name in kvoffload.__all__ if not hasattr(kvoffload, name)]
    assert not missing


def test_the_handler_its_specs_options_and_errors_are_exported_as_defined():
    for module, names in ((handler, ["OffloadHandler", "TransferResult"]), (planner, ["GPUSpec", "CPUSpec"]),
                          (host_pool, ["PoolOptions", "PoolNotReadyError"]),
                          (pool_memory, ["PinnedMemoryError"]), (calibration_cache, ["CalibrationCacheError"]),
                          (page_methods, ["Pages", "PagePath"]), (auto, ["Auto"]),
                          (copy_methods, ["PerCopy", "Batch", "Kernel", "Staged"])):
        for name in names:
            assert name in kvoffload.__all__
            assert getattr(kvoffload, name) is getattr(module, name)
