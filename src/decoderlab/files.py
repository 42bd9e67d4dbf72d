"""Files written so that an interrupted write loses nothing: write to a temporary place, then replace.

The one mechanism used by checkpoints, tokenizers, the token cache, reports and ``hf.save_hf_directory``: a file is
written under a temporary name in its destination directory and renamed into place (``os.replace`` is atomic
on POSIX); a directory is assembled beside its destination (:func:`temporary_directory`) and swapped in. An
operating-system error names the path the caller gave, never the temporary one (``/proc/.x.png.zc_2ge_d.tmp``
means nothing to the user who asked for ``/proc/x.png``). Ground layer: imports nothing from decoderlab.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable


def usual_mode(path, directory: bool = False) -> None:
    """Give a file made by mkstemp/mkdtemp (0600/0700) the permissions a plain open/mkdir would give."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o777 if directory else 0o666) & ~umask)


def naming(path, e: OSError, tmp=None) -> OSError:
    """``e`` (raised while making or writing ``tmp``, the temporary stand-in for ``path``) as the same kind of
    error about ``path``: ``FileNotFoundError(2, 'No such file or directory', '/proc/x.png')``. An error that
    names another file (not ``tmp``) is returned as it is."""
    if e.errno is None or (e.filename is not None and tmp is not None and str(e.filename) != str(tmp)):
        return e
    return type(e)(e.errno, e.strerror, str(path))


def temporary_directory(directory: str | os.PathLike) -> Path:
    """A new empty directory beside ``directory`` (``.NAME.XXXXXXXX.tmp`` in its parent) to assemble it in, for
    :func:`replace_directory`. Raises the ``OSError`` of ``mkdtemp`` naming ``directory``."""
    directory = Path(directory)
    try:
        return Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.", suffix=".tmp"))
    except OSError as e:
        raise naming(directory, e) from None


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same directory and ``os.replace``."""
    atomic_write_chunks(path, [data])


def atomic_write_chunks(path: str | os.PathLike, chunks: Iterable[bytes]) -> None:
    """Write the byte strings of ``chunks`` one after another to ``path`` atomically, as
    :func:`atomic_write_bytes` does, never holding the whole file in memory. An exception raised while
    iterating ``chunks`` leaves ``path`` as it was (and no temporary file)."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise naming(path, e) from None
    try:
        usual_mode(tmp)
        with os.fdopen(fd, "wb") as f:
            for data in chunks:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:  # a full disk, a quota, a directory at ``path``: said of ``path``
        _remove(tmp)
        raise naming(path, e, tmp) from None
    except BaseException:
        _remove(tmp)
        raise


def _remove(tmp: str) -> None:
    if os.path.exists(tmp):
        os.unlink(tmp)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` as UTF-8 to ``path`` atomically (see :func:`atomic_write_bytes`)."""
    atomic_write_bytes(path, text.encode("utf-8"))


def replace_directory(tmp: Path, directory: Path) -> None:
    """Swap the fully written directory ``tmp`` into place at ``directory`` (renames only; the old one, if
    any, is moved aside first and deleted last). ``tmp`` gets the usual directory permissions (mkdtemp
    makes it 0700)."""
    usual_mode(tmp, directory=True)
    old = None
    if directory.exists():
        old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
        os.replace(directory, old)
    os.replace(tmp, directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
