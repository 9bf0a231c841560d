"""Reading and replacing the files a user gives the suite: capped reads, atomic writes, a lock.

Every input (a recipe, a reference, a record, a loss curve) is read with `read_input`: regular
files only (a FIFO or /dev/zero would block or never end), at most INPUT_LIMIT bytes (YAML:
YAML_LIMIT), so that a small mistake cannot hold the process or its memory. Every file the suite
replaces (a recipe, a record) goes through `replace_file`: a temporary file beside the target, then
a rename, so that a reader sees the old file or the new one, never half of one; a symlink is
written through to its target and stays a link; a failure is reported as the write's own error
(not the cleanup's), in one line, and leaves the target as it was. The temporary files of an
interrupted write (`stray_temporaries`) are removed by the next write to the same file. A command's
output (a report, model facts, a plot) goes through `write_output`: `output_target` first refuses
what a command must never replace (one of its inputs, a read-only file, a device, a FIFO, a folder,
a symlink leading out of its folder), in one line, before anything is written.

`locked` serialises read-modify-write cycles on one file between processes: an advisory lock
(fcntl.flock) on a sibling file `.NAME.lock`, held for the whole cycle and removed on release.
On a local filesystem it holds between all processes of the host. On NFS, Linux clients emulate
flock with a whole-file POSIX (fcntl) lock that the server arbitrates, so it holds across hosts
where the mount has locking (NFSv4, or NFSv3 with lockd); on a mount with `nolock`, or a client
that keeps flock local, it holds only between processes of one host, and two hosts editing one
recipe at the same moment can still lose an update. It is advisory: an editor that does not take
it is not stopped.
"""

import contextlib
import errno
import os
import re
import stat
import time
import unicodedata
from collections.abc import Iterable, Iterator
from pathlib import Path

from correctness.errors import CorrectnessError

INPUT_LIMIT = 64 * 2**20  # bytes: far above any record (the largest seed record: 4.7 MB) or loss log
YAML_LIMIT = 2**20  # bytes: 90 times the largest seed recipe; PyYAML's pure-Python scanner reads about 2 µs
# a byte, and up to 100 µs a byte on flow collections nested a few hundred deep, so this bounds a read
TEMPORARY_GRACE = 60.0  # seconds: a younger temporary file may be another host's write in progress
TEMPORARY_STALE = 600.0  # seconds: an older one is stray even where its pid lives (reused by another process)


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))
    return next((name for test, name in kinds if test(mode)), "not a plain file")


def _reason(error: OSError) -> str:
    return error.strerror or str(error)


def _size(limit: int) -> str:
    return f"{limit // 2**20} MiB" if limit % 2**20 == 0 else f"{limit:,} bytes"


def read_input(path: str | Path, label: str, error: type[CorrectnessError] = CorrectnessError,
               limit: int = INPUT_LIMIT, kind: str = "an input file") -> bytes:
    """The bytes of a regular file of at most `limit` bytes; else `error` naming `label`.

    Opened without blocking (a FIFO with no writer would hold open() forever), then checked with
    fstat on the open file (no window between the check and the read), then read to the limit
    plus one byte, so a file that grows while read is still caught."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as failure:
        raise error(f"{label}: cannot be read ({_reason(failure)})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # before fdopen, which refuses a folder with an error naming the descriptor
        os.close(fd)
        raise error(f"{label}: not a regular file ({_kind(mode)}); give a file")
    with os.fdopen(fd, "rb") as source:
        too_large = f"{label}: larger than {_size(limit)}, the limit for {kind}"
        if os.fstat(fd).st_size > limit:
            raise error(too_large)
        try:
            data = source.read(limit + 1)
        except OSError as failure:
            raise error(f"{label}: cannot be read ({_reason(failure)})") from None
    if len(data) > limit:
        raise error(too_large)
    return data


def shown_path(path: str | Path) -> str:
    """A path as output shows it: relative to the working directory where it lies below it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(path)


def folder_parts(name: object, several: bool = True) -> list[str] | None:
    """`name` (a/b/c where `several`, else one part) as path parts that stay inside the folder they
    are joined to, or None: no empty part, no `.` or `..`, not absolute, no NUL or backslash."""
    parts = name.split("/") if isinstance(name, str) else []
    unsafe = any(part in ("", ".", "..") or "\0" in part or "\\" in part for part in parts)
    return None if not parts or unsafe or (len(parts) > 1 and not several) else parts


def visible_name(name: str, label: str, error: type[CorrectnessError] = CorrectnessError) -> str:
    """`name` (a model's, a GPU's) where every character shows as itself, else `error` naming
    `label` and the first that does not: a control or format character (a bidirectional override
    such as U+202E prints the rest backwards, a zero-width space makes two names look alike), a
    line or paragraph separator, a space other than U+0020, an unassigned one."""
    for place, character in enumerate(name, 1):
        if not character.isprintable():
            what = unicodedata.name(character, "a control character")
            raise error(f"{label}: {name!r} holds U+{ord(character):04X} ({what}) at character {place}, which does not"
                        " show as itself; write the name in visible characters")
    return name


def temporary_path(target: Path) -> Path:
    """Where a write to `target` puts its bytes first: `.NAME.PID.tmp` beside it."""
    return target.with_name(f".{target.name}.{os.getpid()}.tmp")


def pid_alive(pid: int) -> bool:
    """Whether a process of this pid runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0  # PermissionError: another user's live process
    return True


def stray_temporaries(target: Path, now: float | None = None) -> list[Path]:
    """Temporary files an interrupted write to `target` left behind: `.NAME.PID.tmp` older than
    TEMPORARY_GRACE seconds whose process is gone from this host, or older than TEMPORARY_STALE
    whatever their pid. A live writer's file is younger than either (a write takes milliseconds),
    and the grace keeps a writer on another host of a shared filesystem, whose pid means nothing
    here, out of reach."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(\d+)\.tmp")
    now = time.time() if now is None else now
    stray = []
    try:
        names = os.listdir(target.parent)
    except OSError:
        return []
    for name in names:
        match = pattern.fullmatch(name)
        if match is None or int(match.group(1)) == os.getpid():
            continue
        path = target.parent / name
        try:
            age = now - path.lstat().st_mtime
        except OSError:
            continue
        if age > TEMPORARY_STALE or (age > TEMPORARY_GRACE and not pid_alive(int(match.group(1)))):
            stray.append(path)
    return stray


def remove_stray_temporaries(target: Path) -> None:
    for path in stray_temporaries(target):
        with contextlib.suppress(OSError):
            path.unlink()


def write_target(path: str | Path) -> Path:
    """The file a write to `path` replaces: a symlink's target (the link stays a link)."""
    return Path(path).resolve()


def replace_file(path: str | Path, data: bytes, label: str,
                 error: type[CorrectnessError] = CorrectnessError) -> Path:
    """Replace `path` (through a symlink, its target) with `data` atomically, keeping the mode of a
    file it replaces; return the file written. Strays of earlier interrupted writes go first. On
    failure (a read-only folder or filesystem, a full disk) `error` reports the write's own error
    and the target is as it was."""
    target = write_target(path)
    remove_stray_temporaries(target)
    temporary = temporary_path(target)
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # the user's umask, as a new file
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        with contextlib.suppress(FileNotFoundError):
            os.chmod(temporary, stat.S_IMODE(os.stat(target).st_mode))
        os.replace(temporary, target)
    except OSError as failure:
        with contextlib.suppress(OSError):  # on a read-only filesystem the cleanup fails too
            os.unlink(temporary)
        raise error(f"{label}: cannot be written ({_reason(failure)})") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    return target


def refuse_read_only(path: str | Path, label: str, error: type[CorrectnessError] = CorrectnessError) -> None:
    """Refuse, before anything is read or locked, to rewrite a file its owner made read-only (no
    write bit, e.g. mode 0444: root would write it regardless, so the mode bits decide), one on a
    read-only filesystem, or one this process may not write (a rename would replace it anyway)."""
    target = write_target(path)
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
        read_only_filesystem = bool(os.statvfs(target.parent).f_flag & os.ST_RDONLY)
    except OSError as failure:
        raise error(f"{label}: cannot be read ({_reason(failure)})") from None
    if not mode & 0o222:
        raise error(f"{label}: read-only (mode {mode:04o}); make it writable to change it")
    if read_only_filesystem:
        raise error(f"{label}: cannot be written ({os.strerror(errno.EROFS)})")
    if not os.access(target, os.W_OK):
        raise error(f"{label}: cannot be written ({os.strerror(errno.EACCES)})")


def output_target(path: str | Path, label: str, inputs: Iterable[str | Path] = (),
                  error: type[CorrectnessError] = CorrectnessError) -> Path:
    """The file a command's output `path` may replace (replace_file's target), or `error` in one line
    naming `label`, before anything is written. A command writes a new file, or a regular file its
    owner may replace; never a folder, FIFO, socket or device (the rename would put a file in its
    place: /dev/null replaced by a report), a read-only file (refuse_read_only), one of its own
    `inputs` (the same file by device and inode, however the path is spelled: a hard link, a
    symlink, `./`), nor through a symlink to a file outside the link's folder."""
    given = Path(path)
    try:
        link = stat.S_ISLNK(os.lstat(given).st_mode)
    except FileNotFoundError:
        link = False
    except OSError as failure:
        raise error(f"{label}: cannot be written ({_reason(failure)})") from None
    target = write_target(given)
    if link and not target.is_relative_to(given.absolute().parent.resolve()):
        raise error(f"{label}: a symlink to {target}, outside its folder; give the file itself or a new path")
    try:
        status = os.stat(target)
    except FileNotFoundError:
        return target  # a new file (or a link to one in its folder)
    except OSError as failure:
        raise error(f"{label}: cannot be written ({_reason(failure)})") from None
    if not stat.S_ISREG(status.st_mode):
        raise error(f"{label}: {_kind(status.st_mode)}, not a file it may replace; give a new path or a regular file")
    for given_input in inputs:
        try:
            same = os.path.samestat(status, os.stat(given_input))
        except OSError:
            continue  # an input that is gone is not this file
        if same:
            raise error(f"{label}: is its input {given_input}; write the output to another path")
    refuse_read_only(target, label, error)
    return target


def write_output(path: str | Path, data: bytes, label: str, inputs: Iterable[str | Path] = (),
                 error: type[CorrectnessError] = CorrectnessError) -> Path:
    """A command's output written atomically (replace_file) where output_target allows it."""
    output_target(path, label, inputs, error)
    return replace_file(path, data, label, error)


def lock_path(target: Path) -> Path:
    return target.with_name(f".{target.name}.lock")


@contextlib.contextmanager
def locked(path: str | Path, label: str, error: type[CorrectnessError] = CorrectnessError) -> Iterator[Path]:
    """Hold an exclusive advisory lock for `path` (its symlink target) for the body; yield the target.

    The lock file is removed on release. A waiter may then hold a lock on the removed file, so
    after locking each checks that its file is still the one at the lock's path, and starts again
    if not: two processes never both believe they hold the lock. See the module's note on NFS."""
    import fcntl

    target = write_target(path)
    where = lock_path(target)
    while True:
        try:
            fd = os.open(where, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as failure:
            raise error(f"{label}: cannot lock it for writing ({_reason(failure)}: {where.parent})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            held, current = os.fstat(fd), os.stat(where)
        except FileNotFoundError:
            os.close(fd)  # released and removed while this process waited: lock the new file
            continue
        except OSError as failure:  # ENOLCK: an NFS mount without a lock manager
            os.close(fd)
            raise error(f"{label}: cannot lock it for writing ({_reason(failure)})") from None
        except BaseException:
            os.close(fd)
            raise
        if (held.st_dev, held.st_ino) == (current.st_dev, current.st_ino):
            break
        os.close(fd)
    try:
        yield target
    finally:
        with contextlib.suppress(OSError):
            os.unlink(where)
        os.close(fd)
