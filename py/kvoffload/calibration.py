"""What each raw-pointer copy method achieves on this machine, alone and beside a model.

For every candidate (kvoffload.copy_methods.CANDIDATES: each method with its defaults, and
the copy kernel on fewer CTAs), direction and block size (4 KiB to 2 MiB) it
times the method alone, with the host side scattered and in runs; at a few sizes it
also keeps it in flight beside the loop of kvoffload.meter.CALIBRATION_WORKLOAD and records
its rate there and the loop's step slowdown, with bulk copies' slowdown in the same run.
Measured on the device it describes, cached in a JSON file ($KVOFFLOAD_CALIBRATION, else
~/.cache/kvoffload/calibration.json) under that device's name, driver, PCIe link and
bus id, written atomically under a lock, and measured again by

    python -m kvoffload.calibration --recalibrate [--device N]
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import json
import math
import os
import pathlib
import stat
import subprocess
import sys
import tempfile
import threading
import time
from typing import ClassVar

import numpy as np

from kvoffload.batch_copy import NoCudaDeviceError
from kvoffload.copy_methods import CANDIDATES
from kvoffload.registry import UNCHECKED
from kvoffload.vocabulary import Direction

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20]
BESIDE_SIZES = [4 << 10, 64 << 10, 2 << 20]
PATTERNS = ("scattered", "host_runs")
MAX_FILE_BYTES = 16 << 20  # a cache file's entries take a few KiB a device
RUN_BYTES = 256 << 10
FORMAT = 12  # entries of another format (12: with the bulk copies' slowdown) are measured again


def path() -> pathlib.Path:
    return pathlib.Path(os.environ.get("KVOFFLOAD_CALIBRATION",
                                       pathlib.Path.home() / ".cache/kvoffload/calibration.json"))


@functools.cache
def device_key(device: int) -> str:
    """The GPU's name, driver, PCIe link and bus id, as nvidia-smi reports them."""
    import torch

    fields = "driver_version,pcie.link.gen.max,pcie.link.width.max,pci.bus_id"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader",
                              "-i", str(device)], capture_output=True, text=True, check=True).stdout
        driver, gen, width, bus = (f.strip() for f in out.strip().split(","))
        where = f"driver {driver} | PCIe gen{gen} x{width} | {bus}"
    except (OSError, subprocess.CalledProcessError, ValueError):
        where = f"unknown driver and link | device {device}"
    return f"{torch.cuda.get_device_name(device)} | {where}"


@dataclasses.dataclass
class Calibration:
    key: str
    sizes: list[int]
    rates: dict[str, list[float]]  # "method direction pattern" -> GB/s alone, per size
    beside_sizes: list[int] = dataclasses.field(default_factory=list)
    beside: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # "method direction" -> GB/s
    # "method direction" -> step slowdown per beside-size (kvoffload.meter); None where
    # nothing was measured: the copies did not cover their windows, or their host
    # enqueueing outlasted the steps enqueued ahead of them (the loop ran dry beside them).
    slowdown: dict[str, list[float | None]] = dataclasses.field(default_factory=dict)
    # "h2d" / "d2h" -> bulk copies' step slowdown in the same run (where beside_sizes).
    bulk_slowdown: dict[str, float] = dataclasses.field(default_factory=dict)
    FORMAT: ClassVar[int] = FORMAT
    MODULE: ClassVar[str] = "kvoffload.calibration"  # whose --recalibrate measures it
    NEEDED_BY: ClassVar[str] = "method='auto'"

    # Keys spell a direction "h2d" or "d2h" (_KEY), in the cache file too.
    def rate(self, method: str, direction: Direction | str, pattern: str, copy_bytes: float) -> float:
        return _interpolate(self.sizes, self.rates[f"{method} {_short(direction)} {pattern}"], copy_bytes)

    def rate_beside(self, method: str, direction: Direction | str, copy_bytes: float) -> float:
        """Interpolated over the sizes where a slowdown was measured (all, if none)."""
        name = f"{method} {_short(direction)}"
        measured = self._measured(name) or self.beside_sizes
        rates = dict(zip(self.beside_sizes, self.beside[name]))
        return _interpolate(measured, [rates[size] for size in measured], copy_bytes)

    def slowdown_of(self, method: str, direction: Direction | str, copy_bytes: float) -> float:
        """Interpolated over the sizes where it was measured; inf where the calibrated size
        nearest to copy_bytes (in log scale; of two, either) measured none: host enqueueing
        holds up small copies, and that at 4 KiB says nothing of 32 KiB, where 64 KiB ran."""
        name = f"{method} {_short(direction)}"
        measured = self._measured(name)
        distance = [abs(math.log2(size) - math.log2(max(copy_bytes, 1))) for size in self.beside_sizes]
        nearest = min(distance) if distance else 0.0
        if not measured or any(d == nearest and size not in measured
                               for size, d in zip(self.beside_sizes, distance)):
            return math.inf
        slowdowns = dict(zip(self.beside_sizes, self.slowdown[name]))
        return _interpolate(measured, [slowdowns[size] for size in measured], copy_bytes)

    def over_bulk(self, method: str, direction: Direction | str, copy_bytes: float) -> float:
        """slowdown_of less the bulk copies' slowdown in that direction."""
        return self.slowdown_of(method, direction, copy_bytes) - self.bulk_slowdown[_short(direction)]

    def valid(self) -> bool:
        """Whether the fields read from a file make a calibration that choose() can read:
        every candidate's tables, each a rate >= 0 or slowdown per size."""
        pairs = {f"{m} {d}" for m in CANDIDATES for d in _KEY.values()}
        tables = (self.rates, self.beside, self.slowdown, self.bulk_slowdown)
        return (isinstance(self.key, str) and _increasing(self.sizes) and _increasing(self.beside_sizes)
                and len(self.sizes) > 0 and len(self.beside_sizes) > 0
                and all(isinstance(t, dict) for t in tables)
                and set(self.rates) == {f"{pair} {p}" for pair in pairs for p in PATTERNS}
                and set(self.beside) == set(self.slowdown) == pairs
                and set(self.bulk_slowdown) == set(_KEY.values())
                and all(_numbers(t) and len(t) == len(self.sizes) and min(t) >= 0 for t in self.rates.values())
                and all(_numbers(t) and len(t) == len(self.beside_sizes) and min(t) >= 0
                        for t in self.beside.values())
                and all(_numbers(t, none=True) and len(t) == len(self.beside_sizes)
                        for t in self.slowdown.values())
                and _numbers(list(self.bulk_slowdown.values())))

    def _measured(self, name: str) -> list[int]:
        """The beside-sizes where the copies of ``name`` ran inside the loop."""
        return [size for size, s in zip(self.beside_sizes, self.slowdown[name]) if s is not None]


_KEY = {Direction.LOAD: "h2d", Direction.STORE: "d2h"}


def _short(direction: Direction | str) -> str:
    return _KEY[Direction.parse(direction, "direction")]


def _interpolate(sizes, values, at) -> float:
    """Log-interpolated in size; sizes outside the table take its ends."""
    x = np.log2(np.clip(at, sizes[0], sizes[-1]))
    return float(np.interp(x, np.log2(sizes), values))


def _offsets(rng, pool, block, n, pattern):
    """n distinct block offsets in a pool: at random, or in runs of RUN_BYTES at random."""
    if pattern == "scattered":
        return rng.permutation(pool // block)[:n].astype(np.int64) * block
    per_run = max(1, RUN_BYTES // block)
    runs = rng.permutation(pool // (per_run * block))[: -(-n // per_run)]
    i = np.arange(n, dtype=np.int64)
    return runs[i // per_run].astype(np.int64) * per_run * block + (i % per_run) * block


def measure(device: int, moved: int = 256 << 20, pool: int = 1 << 30, **windows) -> Calibration:
    """Times every candidate on ``device``: some seconds alone, a few minutes beside.
    windows: kvoffload.meter.measure's steps, rounds and margin (default: its own)."""
    import torch

    from kvoffload import compute_loop, meter
    from kvoffload.steady_copies import CALL_SECONDS, BulkCopies, RawCopies, in_calls

    with torch.cuda.device(device):
        rng = np.random.default_rng(0)
        host = torch.empty(pool, dtype=torch.uint8, pin_memory=True)
        gpu = torch.empty(pool, dtype=torch.uint8, device=device)
        stream = torch.cuda.Stream(device)

        def run(method, direction):
            # Addresses made below inside its own buffers.
            return functools.partial(CANDIDATES[method], stream=stream, direction=direction, registry=UNCHECKED)

        def batch(direction, block, pattern):
            """(src, dst, sizes) of ``moved`` bytes of block copies."""
            n = moved // block
            g = _offsets(rng, pool, block, n, "scattered") + gpu.data_ptr()
            h = _offsets(rng, pool, block, n, pattern) + host.data_ptr()
            return (*direction.ends(h, g), np.full(n, block, dtype=np.int64))

        def copy(method, direction, block, pattern):
            return functools.partial(run(method, direction), *batch(direction, block, pattern))

        def seconds(copy):
            torch.cuda.synchronize()
            start = time.perf_counter()
            copy()
            stream.synchronize()
            return time.perf_counter() - start

        cal = Calibration(device_key(device), SIZES, {}, BESIDE_SIZES)
        for pattern in PATTERNS:
            for direction in Direction:
                for method in CANDIDATES:
                    cal.rates[f"{method} {_KEY[direction]} {pattern}"] = [
                        moved / min(seconds(copy(method, direction, b, pattern)) for _ in range(2)) / 1e9
                        for b in SIZES]
        loop = compute_loop.ComputeLoop(torch, meter.CALIBRATION_WORKLOAD, f"cuda:{device}")

        def source(method, direction, block):
            pattern = "host_runs" if CANDIDATES[method].name == "staged" else "scattered"
            rate = cal.rates[f"{method} {_KEY[direction]} {pattern}"][SIZES.index(block)]
            call_bytes = max(block, int(rate * 1e9 * CALL_SECONDS) // block * block)
            calls = in_calls(run(method, direction), *batch(direction, block, pattern), call_bytes)
            return lambda: RawCopies(torch, calls, stream)

        points = [(m, d, b) for d in Direction for m in CANDIDATES for b in BESIDE_SIZES]
        sources = {point: source(*point) for point in points}
        for direction in Direction:  # made once: its pinned buffers are not allocated inside a window
            bulk = BulkCopies(torch, direction.value, moved, device=f"cuda:{device}")
            sources["bulk", direction, 0] = lambda bulk=bulk: bulk
        got = meter.measure(loop, sources, **windows)
        cal.bulk_slowdown = {_KEY[d]: got["bulk", d, 0].step_slowdown for d in Direction}
        for direction in Direction:
            for method in CANDIDATES:
                results = [got[method, direction, b] for b in BESIDE_SIZES]
                cal.beside[f"{method} {_KEY[direction]}"] = [r.gb_per_s for r in results]
                # A loop that ran dry waited for the host: its slowdown says nothing.
                cal.slowdown[f"{method} {_KEY[direction]}"] = [
                    None if r.dry_steps or not all(w["covered"] for w in r.windows) else r.step_slowdown
                    for r in results]
        return cal


_lock = threading.Lock()
_cached: dict[str, object] = {}  # key -> a calibration of any kind


class CalibrationCacheError(ValueError):
    """The calibration cache file cannot be read as one; names the file."""


def _untrusted(st: os.stat_result, directory: os.stat_result) -> str | None:
    """Why a cache or lock file with these stats, in a directory with these, may have been
    planted or rewritten by another user, or None: a regular file no user but its owner
    may write, owned by this user or root, or by the owner of a directory no one else may
    write (this user's own, where a filesystem maps uids: NFS with root_squash)."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_mode & 0o002:
        return f"has mode {stat.S_IMODE(st.st_mode):04o}: any user may write it"
    if st.st_uid in (os.geteuid(), 0) or (directory.st_uid == st.st_uid and not directory.st_mode & 0o022):
        return None
    return f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}) or root"


def _check_trusted(fd: int, path: pathlib.Path, what: str) -> None:
    why = _untrusted(os.fstat(fd), os.stat(path.parent))
    if why is not None:
        raise CalibrationCacheError(f"{path}: the calibration {what} {why}; refusing it (remove it, "
                                    "or set KVOFFLOAD_CALIBRATION to a file in a directory of your own)")


def _open_lock(lock_path: pathlib.Path) -> int:
    """The lock file, made here (0600: no other user may open it, so none can hold the
    lock) or found, then trusted; never through a symbolic link, never truncated."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        return os.open(lock_path, flags | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    try:
        fd = os.open(lock_path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CalibrationCacheError(f"{lock_path}: the calibration lock is a symbolic link; "
                                        "refusing to follow it (remove it)") from None
        if os.path.isdir(lock_path):
            raise CalibrationCacheError(f"{lock_path}: the calibration lock is a directory, not a "
                                        "regular file (remove it)") from None
        raise
    try:
        _check_trusted(fd, lock_path, "lock")
        st = os.fstat(fd)
        if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, 0o600)  # made readable by an earlier version
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def _file_lock(file: pathlib.Path):
    """Other processes calibrating into the same file wait for this one (see _open_lock):
    a planted link would otherwise have its target truncated, and a lock another user
    can open, they could hold."""
    file.parent.mkdir(parents=True, exist_ok=True)
    fd = _open_lock(file.with_suffix(file.suffix + ".lock"))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _corrupt(file: pathlib.Path, why: str, module: str = "kvoffload.calibration") -> CalibrationCacheError:
    return CalibrationCacheError(f"{file}: corrupt calibration cache ({why}); replace it with "
                                 f"python -m {module} --recalibrate, or remove it")


def _read(file: pathlib.Path, module: str = "kvoffload.calibration") -> dict:
    """The file's entries ({} if there is no file); CalibrationCacheError (whose advice is
    ``module``'s --recalibrate) if it is not a JSON object."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO would block a plain open
    except FileNotFoundError:
        return {}
    try:
        _check_trusted(fd, file, "cache")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        raise _corrupt(file, f"over {MAX_FILE_BYTES} bytes", module)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _corrupt(file, f"not UTF-8: {e}", module) from None
    try:
        entries = json.loads(text)
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deep; ValueError: an int too long
        raise _corrupt(file, "empty" if not text.strip() else f"not JSON: {e}", module) from None
    if not isinstance(entries, dict):
        raise _corrupt(file, f"expected a JSON object, got {type(entries).__name__}", module)
    return entries


def _finite(v) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:  # an int too large for a float
        return False


def _increasing(value) -> bool:
    """A list of sizes: ints > 0, each larger than the one before."""
    return (_numbers(value) and all(type(v) is int and v > 0 for v in value)
            and all(a < b for a, b in zip(value, value[1:])))


def _numbers(value, none=False) -> bool:
    """A list of finite numbers (and of Nones, with ``none``)."""
    return isinstance(value, list) and all(
        (v is None and none) or (isinstance(v, (int, float)) and not isinstance(v, bool) and _finite(v))
        for v in value)


def _entry(file: pathlib.Path, key: str, entry, kind):
    """The ``kind`` (a dataclass with FORMAT, MODULE and valid()) an entry holds; None
    where there is none or it is of another format (measured again);
    CalibrationCacheError where it is not one."""
    if entry is None:
        return None
    if not isinstance(entry, dict):
        raise _corrupt(file, f"the entry of {key!r} is a {type(entry).__name__}, not an object", kind.MODULE)
    if entry.get("format") != kind.FORMAT:
        return None
    fields = dict(entry)
    fields.pop("format")
    try:
        cal = kind(**fields)
    except TypeError as e:
        raise _corrupt(file, f"the entry of {key!r}: {e}", kind.MODULE) from None
    if not cal.valid():
        raise _corrupt(file, f"the entry of {key!r} does not hold a calibration", kind.MODULE)
    if cal.key != key:
        raise _corrupt(file, f"the entry of {key!r} holds the calibration of {cal.key!r}", kind.MODULE)
    return cal


def _write(file: pathlib.Path, entries: dict) -> None:
    """Readers see the old file or the new one, never a part."""
    fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=file.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(entries, f, indent=1)
    os.replace(tmp, file)


def calibration(device: int | None = None, recalibrate: bool = False) -> Calibration:
    """``device``'s calibration (default: the current device): cached in this process,
    else from the file, else measured on that device and saved. Reading takes no lock
    (the file is replaced whole), so a read-only cache serves; measuring takes it.
    ``recalibrate`` measures again and replaces a file that cannot be read."""
    return cached(device, "", Calibration, lambda d: measure(d), recalibrate)


def cached(device: int | None, suffix: str, kind, measure_on, recalibrate: bool):
    """The entry of ``kind`` under ``device``'s key and ``suffix`` of the cache file, or
    ``measure_on(device)`` saved there (see calibration())."""
    import torch

    if not torch.cuda.is_available():
        raise NoCudaDeviceError(f"{kind.NEEDED_BY}: no CUDA device to calibrate on")
    device = torch.cuda.current_device() if device is None else int(device)
    key = device_key(device) + suffix
    with _lock:
        if key in _cached and not recalibrate:
            return _cached[key]
        file = path()
        cal = None if recalibrate else _entry(file, key, _read(file, kind.MODULE).get(key), kind)
        if cal is None:
            with _file_lock(file):
                if not recalibrate:  # another process may have measured it meanwhile
                    cal = _entry(file, key, _read(file, kind.MODULE).get(key), kind)
                if cal is None:
                    cal = measure_on(device)
                    if cal.key != key:
                        raise AssertionError(f"{kind.MODULE}: measured {cal.key!r} for {key!r}")
                    if not cal.valid():  # a later read would refuse the whole file
                        raise AssertionError(f"{kind.MODULE}: measured a calibration of {key!r} that is not valid")
                    try:
                        entries = _read(file, kind.MODULE)
                    except CalibrationCacheError:
                        if not recalibrate:
                            raise
                        entries = {}  # --recalibrate replaces what cannot be read
                    entries[key] = dict(dataclasses.asdict(cal), format=kind.FORMAT)
                    _write(file, entries)
        _cached[key] = cal
        return cal


def recalibrate_device(argv: list[str], module: str) -> int | None:
    """The device of ``--recalibrate [--device N]`` (None: the current one); exits with
    the usage of ``python -m module`` on anything else."""
    if not argv or argv[0] != "--recalibrate" or len(argv) not in (1, 3) or (
            len(argv) == 3 and (argv[1] != "--device" or not argv[2].isascii() or not argv[2].isdigit())):
        sys.exit(f"usage: python -m {module} --recalibrate [--device N]")
    return int(argv[2]) if len(argv) == 3 else None


def main(argv: list[str]) -> None:
    cal = calibration(recalibrate_device(argv, "kvoffload.calibration"), recalibrate=True)
    print(f"{cal.key}: written to {path()}")
    for name, table in cal.rates.items():
        print(f"{name:<31}" + " ".join(f"{r:6.1f}" for r in table))
    if cal.bulk_slowdown:
        print("bulk copies' slowdown: " + ", ".join(f"{d} {v:+.2%}" for d, v in cal.bulk_slowdown.items()))
    for name, table in cal.beside.items():
        print(f"{name + ' beside model':<31}" + " ".join(
            f"{r:6.1f} ({'unmeasured' if s is None else f'{s:+.1%}'})" for r, s in zip(table, cal.slowdown[name])))


if __name__ == "__main__":
    main(sys.argv[1:])
