"""Repack a wheel without the files that only its build needs (C++ and Cython sources), so that it travels
to the GPU machine in `.gpu/wheels` under the 64 MiB carry limit. Compiled modules and Python files stay.
Usage: python benchmarks/slim_wheel.py WHEEL [WHEEL ...]   (rewrites each in place)"""
from __future__ import annotations

import base64
import hashlib
import os
import sys
import zipfile

BUILD_ONLY = (".cpp", ".pyx", ".pxd", ".pxi", ".h")


def slim(path: str) -> tuple[int, int]:
    """Rewrites ``path`` without build-only files; returns (bytes before, bytes after)."""
    before, tmp, kept = os.path.getsize(path), path + ".tmp", []
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
        record = next(i.filename for i in src.infolist() if i.filename.endswith(".dist-info/RECORD"))
        for info in src.infolist():
            if info.filename == record or info.filename.endswith(BUILD_ONLY):
                continue
            data = src.read(info)
            out.writestr(info, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            kept.append(f"{info.filename},sha256={digest},{len(data)}")
        out.writestr(record, "\n".join([*kept, f"{record},,"]) + "\n")
    os.replace(tmp, path)
    return before, os.path.getsize(path)


if __name__ == "__main__":
    for wheel in sys.argv[1:]:
        old, new = slim(wheel)
        print(f"{os.path.basename(wheel)}: {old / 2**20:.1f} -> {new / 2**20:.1f} MiB")
