"""kvoffload.costs.calibration without a GPU: the cache file, its lock and atomic writes, and
interpolation; measuring is stood in for."""

import dataclasses
import errno
import json
import multiprocessing
import os
import re
import shutil
import stat
import tempfile

import pytest
import torch

import kvoffload as kv
from kvoffload.costs import cache as calibration_cache
from kvoffload.costs import calibration
from fake_device import fake_device
from hostile import as_another_user
from kvoffload.copy.methods import CANDIDATES
from kvoffload.costs.cache import CalibrationCacheError
from kvoffload.costs.calibration import Calibration


def fake(key):
    sizes, beside = calibration.SIZES, calibration.BESIDE_SIZES
    pairs = [f"{m} {d}" for m in CANDIDATES for d in ("load", "store")]
    return Calibration(key, sizes, {f"{pair} {p}": [float(i + 1) for i in range(len(sizes))]
                                    for pair in pairs for p in calibration.PATTERNS},
                       beside, {pair: [1.0, 2.0, 3.0] for pair in pairs}, {pair: [0.0, 0.01, 0.02] for pair in pairs},
                       {"load": 0.004, "store": 0.009})


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """One fake GPU per device index; measuring counts its calls."""
    return fake_device(tmp_path, monkeypatch, calibration, fake)


def test_measured_once_per_device_then_cached_and_read_back(machine, monkeypatch):
    file, measured = machine
    first = calibration.calibration(1)
    assert calibration.calibration(1) is first and measured == [1]
    calibration.calibration()  # the current device, 0
    assert measured == [1, 0]
    entries = json.loads(file.read_text())
    assert set(entries) == {"fake GPU 0", "fake GPU 1"} and entries["fake GPU 1"]["format"] == calibration.FORMAT
    monkeypatch.setattr(calibration_cache, "_cached", {})
    assert calibration.calibration(1) == first and measured == [1, 0]  # from the file
    calibration.calibration(1, recalibrate=True)
    assert measured == [1, 0, 1]


def test_an_entry_of_an_older_format_is_measured_again(machine):
    file, measured = machine
    file.write_text(json.dumps({"fake GPU 0": dataclasses.asdict(fake("fake GPU 0"))}))
    calibration.calibration(0)
    assert measured == [0]


def test_a_write_replaces_the_file_whole(machine, monkeypatch):
    file, _ = machine
    file.write_text(json.dumps({"other GPU": {"format": 1}}))
    replaced = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: replaced.append((a, b)) or real(a, b))
    calibration.calibration(0)
    assert len(replaced) == 1 and replaced[0][1] == file
    assert set(json.loads(file.read_text())) == {"other GPU", "fake GPU 0"}
    assert [p.name for p in file.parent.iterdir() if p.suffix == ".tmp"] == []


def _hold_the_lock(file, ready, release):
    with calibration_cache._file_lock(file):
        ready.set()
        release.wait(30)


def test_the_file_lock_makes_another_process_wait(tmp_path):
    file = tmp_path / "calibration.json"
    ctx = multiprocessing.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_the_lock, args=(file, ready, release))
    holder.start()
    assert ready.wait(30)
    let_go = ctx.Event()
    let_go.set()  # the waiter lets go as soon as it holds the lock
    waiter = ctx.Process(target=_hold_the_lock, args=(file, ctx.Event(), let_go))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive()  # blocked on the lock
    release.set()
    holder.join(30)
    waiter.join(30)
    assert waiter.exitcode == 0


def test_interpolation_is_logarithmic_and_clamped():
    cal = fake("x")
    assert cal.rate("batch", "load", "scattered", 8 << 10) == pytest.approx(1.5)
    assert cal.rate("batch", "load", "scattered", 1) == 1 and cal.rate("batch", "load", "scattered", 1 << 40) == 6
    assert cal.slowdown_of("batch", "load", 2 << 20) == pytest.approx(0.02)
    assert cal.rate_beside("batch", "load", 16 << 10) == pytest.approx(1.5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_without_a_gpu_it_raises_no_cuda_device():
    with pytest.raises(kv.NoCudaDeviceError):
        calibration.calibration()


def test_the_command_line_wants_recalibrate():
    with pytest.raises(SystemExit, match="usage"):
        calibration.main([])
    with pytest.raises(SystemExit, match="usage"):
        calibration.main(["--recalibrate", "--devices", "1"])


def _good_entry(key="fake GPU 0"):
    return dict(dataclasses.asdict(fake(key)), format=calibration.FORMAT)


CORRUPT = {
    "truncated": b'{"fake GPU 0": {"format": 9, "key": "fake',
    "empty": b"",
    "blank": b"  \n",
    "a list": b"[1, 2]",
    "a number": b"9",
    "not UTF-8": b'{"fake GPU 0": "\xff\xfe"}',
    "nested past the parser's recursion limit": b"[" * 100_000 + b"]" * 100_000,
    "an int past the parser's digit limit": b'{"fake GPU 0": ' + b"1" * 5_000 + b"}",
    # Entries that do not hold a calibration; another device's good entry beside them.
    "an entry that is no object": json.dumps({"fake GPU 0": 5, "other GPU": _good_entry("other GPU")}).encode(),
    "an entry with unknown fields": json.dumps({"fake GPU 0": {"format": calibration.FORMAT, "speed": 1},
                                                "other GPU": _good_entry("other GPU")}).encode(),
    "an entry with a table that is no list": json.dumps(
        {"fake GPU 0": dict(_good_entry(), rates={"batch load scattered": "fast"}),
         "other GPU": _good_entry("other GPU")}).encode(),
    "an entry with sizes out of order": json.dumps(
        {"fake GPU 0": dict(_good_entry(), sizes=calibration.SIZES[::-1]), "other GPU": _good_entry("other GPU")}).encode(),
    "an entry with a rate that is not a number": json.dumps(
        {"fake GPU 0": dict(_good_entry(), beside=dict(_good_entry()["beside"], **{"batch load": [1.0, float("nan"), 3.0]})),
         "other GPU": _good_entry("other GPU")}).encode(),
    "an entry with a negative rate": json.dumps(
        {"fake GPU 0": dict(_good_entry(), beside=dict(_good_entry()["beside"], **{"batch load": [1.0, -2.0, 3.0]})),
         "other GPU": _good_entry("other GPU")}).encode(),
    "an entry without one method's tables beside the model": json.dumps(
        {"fake GPU 0": dict(_good_entry(), beside={k: v for k, v in _good_entry()["beside"].items() if k != "batch load"},
                            slowdown={k: v for k, v in _good_entry()["slowdown"].items() if k != "batch load"}),
         "other GPU": _good_entry("other GPU")}).encode(),
    "an entry without one method's rates alone": json.dumps(
        {"fake GPU 0": dict(_good_entry(), rates={k: v for k, v in _good_entry()["rates"].items()
                                                   if not k.startswith("batch ")}),
         "other GPU": _good_entry("other GPU")}).encode(),
    "an entry with no sizes": json.dumps(
        {"fake GPU 0": dict(_good_entry(), sizes=[], rates={k: [] for k in _good_entry()["rates"]}),
         "other GPU": _good_entry("other GPU")}).encode(),
    "an entry with no sizes beside the model": json.dumps(
        {"fake GPU 0": dict(_good_entry(), beside_sizes=[], beside={k: [] for k in _good_entry()["beside"]},
                            slowdown={k: [] for k in _good_entry()["beside"]}),
         "other GPU": _good_entry("other GPU")}).encode(),
    "an entry of another device": json.dumps({"fake GPU 0": _good_entry("other GPU"),
                                              "other GPU": _good_entry("other GPU")}).encode(),
    "an entry without the bulk copies' slowdown one way": json.dumps(
        {"fake GPU 0": dict(_good_entry(), bulk_slowdown={"load": 0.004}), "other GPU": _good_entry("other GPU")}).encode(),
    "an entry whose bulk copies' slowdown is not a number": json.dumps(
        {"fake GPU 0": dict(_good_entry(), bulk_slowdown={"load": 0.004, "store": "slow"}),
         "other GPU": _good_entry("other GPU")}).encode(),
    "an entry with a size past any memory": json.dumps(
        {"fake GPU 0": dict(_good_entry(), sizes=[*calibration.SIZES[:-1], 2**64]),
         "other GPU": _good_entry("other GPU")}).encode(),
    "an entry with a table of the wrong length": json.dumps(
        {"fake GPU 0": dict(_good_entry(), beside=dict(_good_entry()["beside"], **{"batch load": [1.0]})),
         "other GPU": _good_entry("other GPU")}).encode(),
}


@pytest.mark.parametrize("kind", CORRUPT)
def test_a_corrupt_cache_names_the_file_and_recalibrate_replaces_it(machine, monkeypatch, capsys, kind):
    file, measured = machine
    file.write_bytes(CORRUPT[kind])
    with pytest.raises(CalibrationCacheError, match=rf"^{re.escape(str(file))}: corrupt calibration cache "
                       r"\(.+\); replace it with python -m kvoffload.costs.calibration --recalibrate"):
        calibration.calibration(0)
    assert measured == [] and file.read_bytes() == CORRUPT[kind]  # nothing measured, the file left alone
    calibration.main(["--recalibrate"])
    assert measured == [0] and f"fake GPU 0: written to {file}" in capsys.readouterr().out
    entries = json.loads(file.read_text())
    assert entries["fake GPU 0"]["format"] == calibration.FORMAT
    if kind.startswith("an entry"):
        assert entries["other GPU"] == _good_entry("other GPU")  # a readable file keeps the others
    monkeypatch.setattr(calibration_cache, "_cached", {})
    assert calibration.calibration(0) == fake("fake GPU 0") and measured == [0]  # read back


def test_a_planted_lock_symlink_is_refused_and_its_target_left_intact(machine, tmp_path):
    file, measured = machine
    target = tmp_path / "precious"
    target.write_text("keep me")
    os.symlink(target, f"{file}.lock")
    with pytest.raises(CalibrationCacheError, match=rf"{re.escape(str(file))}.lock: the calibration lock is "
                                                    r"a symbolic link; refusing to follow it"):
        calibration.calibration(0)
    assert target.read_text() == "keep me" and measured == []


def test_a_lock_that_is_not_a_regular_file_is_refused(machine):
    file, measured = machine
    os.mkdir(f"{file}.lock")
    with pytest.raises(CalibrationCacheError, match=r"calibration.json.lock: the calibration lock is a "
                                                    r"directory, not a regular file"):
        calibration.calibration(0)
    assert measured == []


@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
def test_a_cache_that_is_not_a_regular_file_is_refused_without_blocking(machine, kind):
    file, measured = machine
    {"fifo": os.mkfifo, "directory": os.mkdir, "device": lambda f: os.symlink("/dev/zero", f)}[kind](file)
    with pytest.raises(CalibrationCacheError, match=rf"^{re.escape(str(file))}: the calibration cache is not a "
                                                    r"regular file; refusing it \(remove it"):
        calibration.calibration(0)
    assert measured == []


def test_a_cache_past_its_size_limit_is_refused_unread(machine, monkeypatch):
    file, measured = machine
    file.write_bytes(b" " * 64)
    monkeypatch.setattr(calibration_cache, "MAX_FILE_BYTES", 63)
    with pytest.raises(CalibrationCacheError, match=r"corrupt calibration cache \(over 63 bytes\)"):
        calibration.calibration(0)
    assert measured == []


@pytest.mark.parametrize("which", ["cache", "lock"])
@pytest.mark.parametrize("how", ["another user's", "writable by any user"])
def test_a_cache_or_lock_another_user_could_have_planted_is_refused(machine, monkeypatch, which, how):
    # A planted cache would steer the choice of copy method; a lock another user can
    # open, they could hold, and every calibration here would wait for them.
    file, measured = machine
    planted = file if which == "cache" else file.parent / "calibration.json.lock"
    planted.write_text(json.dumps({"fake GPU 0": dataclasses.asdict(fake("fake GPU 0"))}) if which == "cache" else "")
    if how == "another user's":  # as its stats say (a sandbox may map no other uid to chown to)
        inode, real = planted.stat().st_ino, os.fstat
        monkeypatch.setattr(os, "fstat", lambda fd: (lambda st: os.stat_result((*st[:4], 4242, *st[5:]))
                                                     if st.st_ino == inode else st)(real(fd)))
    else:
        os.chmod(planted, 0o666)
    before = planted.read_bytes()
    why = r"is owned by uid 4242, not by this user \(uid \d+\) or root" if how == "another user's" else "has mode 0666: any user may write it"
    with pytest.raises(CalibrationCacheError, match=rf"^{re.escape(str(planted))}: the calibration {which} {why}; "
                                                    "refusing it"):
        calibration.calibration(0)
    assert measured == [] and planted.read_bytes() == before


def squash(monkeypatch, which):
    """os.stat and os.fstat report uid 4242 for the files ``which(st)`` picks."""
    real_fstat, real_stat = os.fstat, os.stat

    def as_squashed(st):
        return os.stat_result((*st[:4], 4242, *st[5:])) if which(st) else st

    monkeypatch.setattr(os, "fstat", lambda fd: as_squashed(real_fstat(fd)))
    monkeypatch.setattr(os, "stat", lambda path, **kw: as_squashed(real_stat(path, **kw)))


def test_a_cache_where_the_filesystem_maps_this_users_files_to_another_uid_serves(machine, monkeypatch):
    # NFS with root_squash: every file this user makes there, the cache's directory and
    # file among them, shows another owner.
    file, measured = machine
    file.write_text(json.dumps({"fake GPU 0": dict(dataclasses.asdict(fake("fake GPU 0")), format=calibration.FORMAT)}))
    os.chmod(file.parent, 0o755)
    device = file.stat().st_dev
    squash(monkeypatch, lambda st: st.st_dev == device)
    assert calibration.calibration(0) == fake("fake GPU 0") and measured == []
    assert sorted(p.name for p in file.parent.iterdir()) == ["calibration.json"]  # the probe is gone
    os.chmod(file.parent, 0o775)  # but one its group may write: the file could be anyone's there
    monkeypatch.setattr(calibration_cache, "_cached", {})
    with pytest.raises(CalibrationCacheError, match=r"is owned by uid 4242, not by this user"):
        calibration.calibration(0)


def test_a_cache_in_another_users_directory_of_their_own_is_refused(machine, monkeypatch):
    # Another user made the directory and the file; files this user makes there are its own.
    file, measured = machine
    file.write_text(json.dumps({"fake GPU 0": dict(dataclasses.asdict(fake("fake GPU 0")), format=calibration.FORMAT)}))
    os.chmod(file.parent, 0o755)
    theirs = {file.stat().st_ino, file.parent.stat().st_ino}
    squash(monkeypatch, lambda st: st.st_ino in theirs)
    with pytest.raises(CalibrationCacheError, match=r"is owned by uid 4242, not by this user"):
        calibration.calibration(0)
    assert measured == []


def test_the_lock_file_only_its_owner_may_open(machine):
    file, measured = machine
    calibration.calibration(0)
    lock = file.parent / "calibration.json.lock"
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600
    os.chmod(lock, 0o644)  # as an earlier version made it
    calibration.calibration(0, recalibrate=True)
    assert measured == [0, 0] and stat.S_IMODE(lock.stat().st_mode) == 0o600


def test_the_lock_file_is_not_truncated(machine):
    file, measured = machine
    lock = file.parent / "calibration.json.lock"
    lock.write_text("held by another tool")
    calibration.calibration(0)
    assert measured == [0] and lock.read_text() == "held by another tool"


@pytest.fixture
def read_only_cache(monkeypatch):
    """A cache holding fake GPU 0's entry in a directory that the test may read, not write
    (another user's, where the test runs as root)."""
    directory = tempfile.mkdtemp(dir="/dev/shm", prefix="kvoffload-test-")
    file = os.path.join(directory, "calibration.json")
    with open(file, "w") as f:
        json.dump({"fake GPU 0": _good_entry()}, f)
    os.chmod(file, 0o644)
    os.chmod(directory, 0o555)
    monkeypatch.setenv("KVOFFLOAD_CALIBRATION", file)
    yield file
    os.chmod(directory, 0o755)
    shutil.rmtree(directory)


def test_a_read_only_cache_with_this_devices_entry_serves_without_write_access(machine, read_only_cache):
    _, measured = machine
    assert as_another_user(calibration.calibration, 0) == fake("fake GPU 0")
    assert os.listdir(os.path.dirname(read_only_cache)) == ["calibration.json"]  # no lock made
    assert measured == []


def test_a_read_only_cache_without_this_devices_entry_says_why_it_cannot_be_written(machine, read_only_cache):
    with pytest.raises(PermissionError):
        as_another_user(calibration.calibration, 1)  # fake GPU 1 is measured, then not saved
    assert stat.S_IMODE(os.stat(read_only_cache).st_mode) == 0o644


def test_recalibrate_onto_a_directory_is_refused_before_measuring(machine):
    file, measured = machine
    os.mkdir(file)
    with pytest.raises(CalibrationCacheError, match=r"calibration.json: the calibration cache is a directory"):
        calibration.calibration(0, recalibrate=True)
    assert measured == [] and sorted(p.name for p in file.parent.iterdir()) == ["calibration.json",
                                                                               "calibration.json.lock"]


def test_a_cache_this_user_cannot_read_is_named_and_recalibrate_replaces_it(machine, monkeypatch):
    file, measured = machine
    file.write_text("{}")
    real_open = os.open

    def unreadable(path, flags, *args, **kwargs):  # as mode 0000 is for anyone but root
        if str(path) == str(file) and not flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", unreadable)
    with pytest.raises(CalibrationCacheError, match=r"calibration.json: the calibration cache cannot be read "
                                                    r"\(Permission denied\); replace it with python -m "
                                                    r"kvoffload.costs.calibration --recalibrate"):
        calibration.calibration(0)
    assert measured == []
    calibration.calibration(0, recalibrate=True)
    monkeypatch.setattr(os, "open", real_open)
    assert measured == [0] and "fake GPU 0" in json.loads(file.read_text())


def test_the_cache_path_takes_home_for_an_empty_variable_and_expands_a_tilde(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("KVOFFLOAD_CALIBRATION", "")
    assert calibration_cache.path() == tmp_path / ".cache/kvoffload/calibration.json"
    monkeypatch.setenv("KVOFFLOAD_CALIBRATION", "~/mine.json")
    assert calibration_cache.path() == tmp_path / "mine.json"
