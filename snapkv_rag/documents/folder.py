"""The document store kept on disk too (``SnapKVLLM(doc_store_dir=...)``, ``snapkv-rag serve
--doc-store-dir DIR``): every document set the store compresses is written to
``DIR/<key>.safetensors`` (:mod:`.files`: all or nothing, flushed, renamed into place), and a set
the store does not hold in memory is read from its file before it is compressed again, so a
restarted server answers from the sets an earlier one made.

What can go wrong, and what happens (each logged as one line naming the file, the store serving
every other set):

- a crash or SIGKILL while a set is written: the file is the old complete one or the new complete
  one; the temporary file left beside it (``.<name>.<pid>.partial``) is removed when the folder is
  next opened;
- a file that is truncated, corrupt (its tensors do not hash to the checksum saved with them), made
  by another model, dtype, tokenizer or library version, or holding another set than its name
  says (another method, other documents): refused with the reason; the set is compressed again
  when asked for and its file rewritten;
- a full disk (or any failed write): the set is still kept in memory and answered from; the error
  names the file, and nothing half-written is left;
- more than ``max_bytes`` on disk: the least recently used files are removed until the folder fits;
  a set larger than the whole bound is not written (``--doc-store-disk-bytes`` raises it).

Several processes may share a folder (Ray Serve replicas): each writes its own temporary files,
and equal keys have equal contents.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from pathlib import Path

from . import files
from .stored import Stored, method_from_json

log = logging.getLogger("snapkv_rag.documents")
DEFAULT_DISK_BYTES = 4 << 30
SUFFIX = ".safetensors"
_PARTIAL = re.compile(r"^\..+\.(\d+)\.partial$")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _another_set(path: Path, method, documents: int) -> ValueError:
    name = getattr(method, "method", "full") if method is not None else "full"
    return ValueError(
        f"{path} holds another document set than its name says (method {name}, {documents} documents): "
        "renamed or copied there; it is not used"
    )


class DocFolder:
    """One folder of stored document sets, bounded by ``max_bytes`` on disk. ``problems`` holds the
    last error met per file (file name to message), as logged."""

    def __init__(self, path, max_bytes: int = DEFAULT_DISK_BYTES):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"doc_store_disk_bytes: must be a number of bytes >= 0, got {max_bytes!r}")
        self.path, self.max_bytes = Path(path), max_bytes
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ValueError(f"doc_store_dir: cannot use {self.path} as a folder: {error}") from None
        self.problems: dict[str, str] = {}
        self._lock = threading.Lock()

    def file(self, key: str) -> Path:
        return self.path / f"{key}{SUFFIX}"

    def _problem(self, path: Path, message: str) -> None:
        with self._lock:
            self.problems[path.name] = message
        log.error("document store: %s", message)

    def open(self, llm) -> list[str]:
        """Remove the temporary files of writes that a crash cut short (their process is gone) and
        check every file's header against ``llm``; returns the keys whose files look usable (their
        tensors are checked when they are read). Bad files are logged, left in place, and replaced
        when their set is compressed again."""
        good = []
        for path in sorted(self.path.iterdir()):
            partial = _PARTIAL.match(path.name)
            if partial:
                if not _alive(int(partial.group(1))):
                    log.warning("document store: removing %s, a write cut short by a crash", path)
                    path.unlink(missing_ok=True)
                continue
            if path.suffix != SUFFIX or not path.is_file():
                continue
            try:
                meta = files.check_header(llm, path)
                if meta.get("key") != path.stem:
                    raise _another_set(path, method_from_json(meta.get("method")), len(meta.get("documents") or []))
            except ValueError as error:
                self._problem(path, str(error).removeprefix("path: "))
                continue
            good.append(path.stem)
        self._bound()
        return good

    def load(self, llm, key: str) -> Stored | None:
        """The set of ``key`` from its file, ``None`` when there is none or it is refused (logged)."""
        path = self.file(key)
        if not path.is_file():
            return None
        try:
            entry = files.load(llm, path)
            if entry.key != key:
                raise _another_set(path, entry.method, len(entry.documents))
        except (ValueError, OSError) as error:
            self._problem(path, str(error).removeprefix("path: "))
            return None
        try:
            os.utime(path)  # most recently used
        except OSError:
            pass
        return entry

    def save(self, llm, entry: Stored) -> bool:
        """Write ``entry``'s file (whether it was written: a failure is logged, never raised)."""
        path = self.file(entry.key)
        if entry.nbytes > self.max_bytes:
            log.warning(
                "document store: %s not written: the set is %d bytes, over the folder's bound of %d bytes "
                "(--doc-store-disk-bytes raises it)",
                path,
                entry.nbytes,
                self.max_bytes,
            )
            return False
        try:
            files.save(llm, entry, path, overwrite=True)
        except OSError as error:
            self._problem(path, f"{str(error).removeprefix('path: ')}; the set is kept in memory only")
            return False
        with self._lock:
            self.problems.pop(path.name, None)
        self._bound(keep=path)
        return True

    def _bound(self, keep: Path | None = None) -> None:
        """Remove the least recently used files until the folder is within ``max_bytes``."""
        with self._lock:
            found = []
            for path in self.path.glob(f"*{SUFFIX}"):
                try:
                    stat = path.stat()
                except OSError:
                    continue
                found.append((stat.st_mtime, path, stat.st_size))
            total = sum(size for _, _, size in found)
            for _, path, size in sorted(found, key=lambda item: item[:1]):
                if total <= self.max_bytes:
                    break
                if path == keep:
                    continue
                path.unlink(missing_ok=True)
                total -= size
                log.info("document store: removed %s to stay within %d bytes on disk", path, self.max_bytes)
