"""What every benchmark shares: random ids for jobs, the record of the machine a result came
from, and the one writer of result files (bench/results/README.md indexes them)."""

import datetime
import json
import os

import numpy as np

import kvoffload as kv
from kvoffload.costs import cache


def random_ids(rng, count, limit, first=0):
    """count distinct ids drawn uniformly from [first, first + limit), as int64."""
    return first + rng.permutation(limit)[:count].astype(np.int64)


def scattered_offsets(rng, count, block, pool_bytes):
    """Offsets of count distinct blocks of ``block`` bytes, scattered over a pool."""
    return random_ids(rng, count, pool_bytes // block) * block


def machine(**extra):
    """The machine a result came from, recorded one way by every benchmark: its GPU (or
    "none (host path)") with the key its calibrations are cached under (driver, PCIe link,
    bus id), torch and CUDA runtime, the environment the copies read, and the host's cores."""
    try:
        import torch
    except ImportError:
        torch = None
    gpu = torch is not None and torch.cuda.is_available()
    return dict(device=torch.cuda.get_device_name() if gpu else "none (host path)",
                device_key=cache.device_key(torch.cuda.current_device()) if gpu else None,
                torch=torch.__version__ if torch else None,
                cuda_runtime=torch.version.cuda if torch else None,
                batch_entry_point=kv.batch_entry_point_version() if gpu else None,
                cuda_device_max_connections=os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
                pytorch_cuda_alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                cpus=os.cpu_count(), **extra)


def out_path(out):
    """--out, relative to the workspace under `bazel run`, else as given."""
    if os.path.isabs(out):
        return out
    return os.path.join(os.environ.get("BUILD_WORKSPACE_DIRECTORY", "."), out)


def write_result(out, rows, machine_record, **config):
    """Writes {date, machine, config, rows} to --out atomically (a run cut short by a second
    signal leaves the last file whole); returns the path."""
    path = out_path(out)
    with open(path + ".partial", "w") as f:
        json.dump(dict(date=datetime.datetime.now().isoformat(timespec="seconds"), machine=machine_record,
                       config=config, rows=rows), f, indent=1)
    os.replace(path + ".partial", path)
    print(f"wrote {path}")
    return path
