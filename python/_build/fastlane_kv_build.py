"""A minimal PEP 517 / PEP 660 build backend for the pure-Python ``fastlane_kv`` package.

Standard library only, so that ``pip install ./python`` (and ``pip install -e ./python``)
need nothing from a package index. It writes a ``py3-none-any`` wheel holding the package's
``.py`` files and the ``.dist-info`` metadata (``METADATA``, ``WHEEL``, ``RECORD`` with
SHA-256 digests), and an sdist of the sources. Name and version come from
``pyproject.toml``'s ``[project]`` table.
"""

from __future__ import annotations

import base64
import hashlib
import io
import re
import tarfile
import zipfile
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "fastlane_kv"
_EPOCH = (1980, 1, 1, 0, 0, 0)


def _project() -> dict[str, str]:
    """``name``, ``version``, ``description`` and ``requires-python`` of ``[project]``."""
    text = (ROOT / "pyproject.toml").read_text()
    table = text.split("[project]", 1)[1].split("\n[", 1)[0]
    out = {}
    for key in ("name", "version", "description", "requires-python"):
        m = re.search(rf'^{re.escape(key)}\s*=\s*"([^"]*)"', table, re.M)
        if m is None:
            raise ValueError(f"pyproject.toml [project] has no {key}")
        out[key] = m.group(1)
    return out


def _dist_name() -> str:
    p = _project()
    return f"{p['name'].replace('-', '_')}-{p['version']}"


def _metadata() -> bytes:
    p = _project()
    return (
        "Metadata-Version: 2.1\n"
        f"Name: {p['name']}\n"
        f"Version: {p['version']}\n"
        f"Summary: {p['description']}\n"
        f"Requires-Python: {p['requires-python']}\n"
        "License: Apache-2.0 OR MIT\n"
    ).encode()


_WHEEL = (
    b"Wheel-Version: 1.0\nGenerator: fastlane_kv_build\nRoot-Is-Purelib: true\n"
    b"Tag: py3-none-any\n"
)


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _write_wheel(wheel_directory: str, files: list[tuple[str, bytes]]) -> str:
    dist = _dist_name()
    info = f"{dist}.dist-info"
    files = files + [(f"{info}/METADATA", _metadata()), (f"{info}/WHEEL", _WHEEL)]
    record = "\n".join([_record_line(n, d) for n, d in files] + [f"{info}/RECORD,,", ""])
    files.append((f"{info}/RECORD", record.encode()))
    name = f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(Path(wheel_directory) / name, "w", zipfile.ZIP_DEFLATED) as z:
        for n, d in files:
            z.writestr(zipfile.ZipInfo(n, _EPOCH), d, zipfile.ZIP_DEFLATED)
    return name


def _sources() -> list[tuple[str, bytes]]:
    src = sorted((ROOT / PACKAGE).glob("*.py"))
    return [(f"{PACKAGE}/{p.name}", p.read_bytes()) for p in src]


def get_requires_for_build_wheel(config_settings: Optional[dict[str, Any]] = None) -> list[str]:
    """Nothing to install before building."""
    return []


get_requires_for_build_sdist = get_requires_for_build_wheel
get_requires_for_build_editable = get_requires_for_build_wheel


def build_wheel(
    wheel_directory: str,
    config_settings: Optional[dict[str, Any]] = None,
    metadata_directory: Optional[str] = None,
) -> str:
    """Writes the wheel into ``wheel_directory`` and returns its file name."""
    return _write_wheel(wheel_directory, _sources())


def build_editable(
    wheel_directory: str,
    config_settings: Optional[dict[str, Any]] = None,
    metadata_directory: Optional[str] = None,
) -> str:
    """An editable wheel: a ``.pth`` file that puts this source tree on ``sys.path``."""
    return _write_wheel(wheel_directory, [(f"{PACKAGE}.pth", f"{ROOT}\n".encode())])


def build_sdist(sdist_directory: str, config_settings: Optional[dict[str, Any]] = None) -> str:
    """Writes ``<name>-<version>.tar.gz`` (sources, build backend, tests, PKG-INFO)."""
    dist = _dist_name()
    paths = [ROOT / "pyproject.toml", Path(__file__).resolve()]
    paths += sorted((ROOT / PACKAGE).glob("*.py")) + sorted((ROOT / "tests").glob("*.py"))
    name = f"{dist}.tar.gz"
    with tarfile.open(Path(sdist_directory) / name, "w:gz") as t:
        for p in paths:
            t.add(p, f"{dist}/{p.relative_to(ROOT)}")
        info = tarfile.TarInfo(f"{dist}/PKG-INFO")
        meta = _metadata()
        info.size = len(meta)
        t.addfile(info, io.BytesIO(meta))
    return name
