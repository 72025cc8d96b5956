"""The wheel (//:wheel) as a pip user gets it.

Its platform tag is the one auditwheel finds for what it links, RECORD hashes every file,
METADATA names the version and dependencies, and the CPU suite passes against the
package pip installed into a fresh virtual environment, run outside the source tree.
Run through `bazel test //tests:wheel_test`, which names the files below in the environment.
"""

import base64
import csv
import hashlib
import io
import json
import os
import pathlib
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile

import pytest


def _env_paths(name):
    value = os.environ.get(name)
    if not value:
        pytest.fail(f"${name} is unset: run this test with `bazel test //tests:wheel_test`")
    return [pathlib.Path(p).resolve() for p in value.split()]


WHEEL = _env_paths("KVOFFLOAD_WHEEL")[0]
DISTRIBUTION, VERSION, PYTHON_TAG, ABI_TAG, PLATFORM_TAG = WHEEL.stem.split("-")
DIST_INFO = f"{DISTRIBUTION}-{VERSION}.dist-info"


def _wheel_files():
    with zipfile.ZipFile(WHEEL) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def _metadata():
    header = _wheel_files()[f"{DIST_INFO}/METADATA"].decode().split("\n\n", 1)[0]
    fields = {}
    for line in header.splitlines():
        key, _, value = line.partition(": ")
        fields.setdefault(key, []).append(value)
    return fields


def _pinned(package):
    requirements = _env_paths("KVOFFLOAD_REQUIREMENTS")[0].read_text().splitlines()
    pins = [line for line in requirements if line.startswith(package + "==")]
    assert len(pins) == 1, f"requirements.txt pins {package} {len(pins)} times"
    return pins[0]


def test_platform_tag_is_the_one_auditwheel_finds():
    show = subprocess.run([sys.executable, "-m", "auditwheel", "show", str(WHEEL)],
                          capture_output=True, text=True)
    assert show.returncode == 0, show.stderr
    text = " ".join(show.stdout.split())
    found = re.search(r'consistent with the following platform tag: "([^"]+)"', text)
    assert found, f"auditwheel show printed no platform tag:\n{show.stdout}"
    assert PLATFORM_TAG == found.group(1), show.stdout


def test_extension_suffix_matches_the_python_tag():
    extensions = [name for name in _wheel_files() if name.endswith(".so")]
    suffix = ".abi3.so" if ABI_TAG == "abi3" else sysconfig.get_config_var("EXT_SUFFIX")
    assert f"cpython-{PYTHON_TAG[2:]}-" in suffix or ABI_TAG == "abi3", (PYTHON_TAG, suffix)
    assert extensions == ["kvoffload/_C" + suffix]


def test_record_hashes_every_file():
    files = _wheel_files()
    rows = list(csv.reader(io.StringIO(files.pop(f"{DIST_INFO}/RECORD").decode())))
    assert [f"{DIST_INFO}/RECORD", "", ""] in rows
    recorded = {path: (digest, size) for path, digest, size in rows if digest}
    assert recorded.keys() == files.keys()
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert recorded[path] == (f"sha256={digest}", str(len(data))), path


def test_metadata_names_version_and_dependencies():
    fields = _metadata()
    assert fields["Name"] == [DISTRIBUTION] and fields["Version"] == [VERSION]
    assert fields["Requires-Python"] == [">=3.11"]
    assert fields["Provides-Extra"] == ["torch", "vllm"]
    requires = fields["Requires-Dist"]
    assert any(r.startswith("numpy") and ";" not in r for r in requires), requires
    assert any(r.startswith("torch") and r.endswith('extra == "torch"') for r in requires), requires
    assert any(r.startswith("vllm") and r.endswith('extra == "vllm"') for r in requires), requires
    assert fields["License"] and fields["Summary"]


def _package_root(source):
    """py/ above kvoffload/ in a source's path, so each module counts by its place in the package."""
    return next(p for p in source.parents if p.name == "py" and (p / "kvoffload").is_dir())


def test_every_source_module_is_in_the_wheel():
    sources = {p.relative_to(_package_root(p)).as_posix() for p in _env_paths("KVOFFLOAD_SOURCES")
               if p.suffix == ".py"}
    packaged = {n for n in _wheel_files() if n.startswith("kvoffload/")}
    assert sources and sources <= packaged, sources - packaged


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A fresh virtual environment with the wheel and the pinned numpy installed by pip.

    pytest, hypothesis and torch, which the tests need but the package does not, come
    from this interpreter's site-packages, listed after the environment's own.
    """
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
    python = root / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    "--no-deps", str(WHEEL), _pinned("numpy")], check=True)
    own = subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"],
                         check=True, capture_output=True, text=True).stdout.strip()
    pathlib.Path(own, "test_tools.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python, pathlib.Path(own)


def _clean_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "RUNFILES"))}
    env.update(PYTHONSAFEPATH="1", PYTHONNOUSERSITE="1")
    return env


def test_installed_package_is_the_wheel(venv, tmp_path):
    python, site_packages = venv
    probe = ("import json, kvoffload, kvoffload._C, numpy; print(json.dumps([kvoffload.__version__,"
             " kvoffload.__file__, kvoffload._C.__file__, numpy.__file__, numpy.__version__]))")
    out = subprocess.run([python, "-c", probe], cwd=tmp_path, env=_clean_env(),
                         check=True, capture_output=True, text=True).stdout
    version, package, extension, numpy_file, numpy_version = json.loads(out)
    assert version == VERSION
    for path in (package, extension, numpy_file):
        assert pathlib.Path(path).is_relative_to(site_packages), path
    assert _pinned("numpy") == f"numpy=={numpy_version}"


def test_cpu_suite_passes_against_the_installed_wheel(venv, tmp_path):
    python, site_packages = venv
    suite = tmp_path / "tests"
    suite.mkdir()
    for source in _env_paths("KVOFFLOAD_CPU_SUITE"):
        shutil.copy(source, suite)
    assert not (suite / "kvoffload").exists()
    files = sorted(p.name for p in suite.glob("*_test.py"))
    assert files, "no CPU tests were given"
    run = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files],
                         cwd=suite, env=_clean_env(), capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-4000:]
