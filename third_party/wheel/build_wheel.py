"""Writes a binary wheel: the given files, METADATA, WHEEL and a RECORD with hashes.

The archive is reproducible: entries sorted, fixed timestamps, fixed permissions.
"""

import argparse
import base64
import hashlib
import re
import zipfile

# PEP 440 public versions without epochs: 1.2.3, 1.2.3rc1, 1.2.3.post1, 1.2.3.dev4.
_VERSION = re.compile(r"\d+(\.\d+)*((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?")
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)


def _parse_args():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--distribution", required=True)
    parser.add_argument("--version", required=True)
    parser.add_argument("--tag", required=True, help="python-abi-platform, e.g. cp312-abi3-manylinux_2_34_x86_64")
    parser.add_argument("--summary", required=True)
    parser.add_argument("--license", required=True)
    parser.add_argument("--requires-python", required=True)
    parser.add_argument("--description", required=True, help="a Markdown file")
    parser.add_argument("--requires", action="append", default=[])
    parser.add_argument("--extra", action="append", default=[], help="EXTRA:REQUIREMENT")
    parser.add_argument("--file", action="append", default=[], help="PATH_IN_WHEEL=SOURCE")
    args = parser.parse_args()
    if not _VERSION.fullmatch(args.version):
        parser.error(f"--version {args.version!r} is not a PEP 440 version like 1.2.3")
    if args.tag.count("-") != 2:
        parser.error(f"--tag {args.tag!r} is not python-abi-platform")
    return args


def _metadata(args):
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {args.distribution}",
        f"Version: {args.version}",
        f"Summary: {args.summary}",
        f"License: {args.license}",
        f"Requires-Python: {args.requires_python}",
    ]
    lines += [f"Requires-Dist: {r}" for r in args.requires]
    extras = {}
    for item in args.extra:
        name, _, requirement = item.partition(":")
        extras.setdefault(name, []).append(requirement)
    for name, requirements in extras.items():
        lines.append(f"Provides-Extra: {name}")
        lines += [f'Requires-Dist: {r}; extra == "{name}"' for r in requirements]
    lines.append("Description-Content-Type: text/markdown")
    with open(args.description, encoding="utf-8") as f:
        return "\n".join(lines) + "\n\n" + f.read()


def _wheel_file(tag):
    return "\n".join([
        "Wheel-Version: 1.0",
        "Generator: kvoffload build_wheel.py",
        "Root-Is-Purelib: false",
        f"Tag: {tag}",
        "",
    ])


def _record_line(path, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def _write(archive, path, data, executable=False):
    info = zipfile.ZipInfo(path, date_time=_ZIP_TIME)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = (0o100755 if executable else 0o100644) << 16
    archive.writestr(info, data)


def main():
    args = _parse_args()
    contents = {}
    for item in args.file:
        path, _, source = item.partition("=")
        with open(source, "rb") as f:
            contents[path] = f.read()
    dist_info = f"{args.distribution}-{args.version}.dist-info"
    contents[f"{dist_info}/METADATA"] = _metadata(args).encode()
    contents[f"{dist_info}/WHEEL"] = _wheel_file(args.tag).encode()

    record = [_record_line(path, contents[path]) for path in sorted(contents)]
    record.append(f"{dist_info}/RECORD,,")
    with zipfile.ZipFile(args.out, "w") as archive:
        for path in sorted(contents):
            _write(archive, path, contents[path], executable=path.endswith(".so"))
        _write(archive, f"{dist_info}/RECORD", ("\n".join(record) + "\n").encode())


if __name__ == "__main__":
    main()
