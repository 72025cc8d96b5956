"""The calibration cache file: the calibrations of kvoffload.costs.calibration and
kvoffload.costs.page_calibration, each kind under its device's key, read without a lock (the file
is replaced whole), measured and written under one. A file another user could have planted
or rewritten is refused, and so is one that does not hold calibrations; the advice is the
--recalibrate of the module whose calibration it is.
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

import numpy as np

from ..copy.batch_copy import NoCudaDeviceError

MAX_FILE_BYTES = 16 << 20  # a cache file's entries take a few KiB a device


MAX_SIZE = 1 << 62  # bytes: no calibrated size is larger


def path() -> pathlib.Path:
    """$KVOFFLOAD_CALIBRATION (``~`` expanded; empty is unset), else the user's cache."""
    given = os.environ.get("KVOFFLOAD_CALIBRATION", "")
    if given:
        return pathlib.Path(given).expanduser()
    return pathlib.Path.home() / ".cache/kvoffload/calibration.json"


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


_lock = threading.Lock()
_cached: dict[str, object] = {}  # key -> a calibration of any kind


class CalibrationCacheError(ValueError):
    """The calibration cache file cannot be read as one; names the file."""


def _untrusted(st: os.stat_result, directory: os.stat_result, where: pathlib.Path) -> str | None:
    """Why a cache or lock file with these stats, in a directory with these (at
    ``where``), may have been planted or rewritten by another user, or None: a regular
    file no user but its owner may write, owned by this user or root, or by the uid that
    the filesystem gives this user's own files there, in a directory of that uid that no
    one else may write (NFS with root_squash maps root so)."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_mode & 0o002:
        return f"has mode {stat.S_IMODE(st.st_mode):04o}: any user may write it"
    if st.st_uid in (os.geteuid(), 0):
        return None
    if directory.st_uid == st.st_uid and not directory.st_mode & 0o022 and _mapped_uid(where) == st.st_uid:
        return None
    return f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}) or root"


def _mapped_uid(directory: pathlib.Path) -> int | None:
    """The owner the filesystem gives a file this process makes in ``directory`` (None
    where it cannot make one)."""
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".kvoffload-uid-")
    except OSError:
        return None
    try:
        return os.fstat(fd).st_uid
    finally:
        os.close(fd)
        os.unlink(probe)


def _check_trusted(fd: int, path: pathlib.Path, what: str) -> None:
    why = _untrusted(os.fstat(fd), os.stat(path.parent), path.parent)
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


def _corrupt(file: pathlib.Path, why: str, module: str = "kvoffload.costs.calibration") -> CalibrationCacheError:
    return CalibrationCacheError(f"{file}: corrupt calibration cache ({why}); replace it with "
                                 f"python -m {module} --recalibrate, or remove it")


def _read(file: pathlib.Path, module: str = "kvoffload.costs.calibration") -> dict:
    """The file's entries ({} if there is no file); CalibrationCacheError (whose advice is
    ``module``'s --recalibrate) if it is not a JSON object."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO would block a plain open
    except FileNotFoundError:
        return {}
    except PermissionError as e:
        raise CalibrationCacheError(f"{file}: the calibration cache cannot be read ({e.strerror}); replace "
                                    f"it with python -m {module} --recalibrate, or remove it") from None
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
    if isinstance(v, int) and abs(v) >= 1 << 63:  # past what numpy's arithmetic takes
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int too large for a float
        return False


def increasing(value) -> bool:
    """A list of sizes: ints in (0, MAX_SIZE], each larger than the one before."""
    return (numbers(value) and all(type(v) is int and 0 < v <= MAX_SIZE for v in value)
            and all(a < b for a, b in zip(value, value[1:])))


def numbers(value, none=False) -> bool:
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
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f, indent=1)
        os.replace(tmp, file)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _require_replaceable(file: pathlib.Path) -> None:
    """CalibrationCacheError where the file is something a new cache cannot replace."""
    try:
        st = os.lstat(file)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        raise CalibrationCacheError(f"{file}: the calibration cache is a directory, not a regular file "
                                    "(remove it, or set KVOFFLOAD_CALIBRATION to a file)")


def cached(device: int | None, suffix: str, kind, measure_on, recalibrate: bool):
    """The entry of ``kind`` under ``device``'s key and ``suffix`` of the cache file, or
    ``measure_on(device)`` saved there: cached in this process, else from the file, else
    measured on that device and saved. ``recalibrate`` measures again and replaces a file
    that cannot be read."""
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
                    _require_replaceable(file)  # before minutes of measuring
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


def interpolate(sizes, values, at) -> float:
    """Log-interpolated in size; sizes outside the table take its ends."""
    x = np.log2(np.clip(at, sizes[0], sizes[-1]))
    return float(np.interp(x, np.log2(sizes), values))
