"""File helpers every layer shares: atomic writes (a reader sees the old file or the whole new one,
never half of it), atomic directories, and JSON / JSONL records.

A write that fails because its filesystem is full raises `DiskFullError` (an `OSError`, errno ENOSPC) naming
the path, the filesystem and its free space, after removing its temp: nothing half-written stays.

A temp file or directory is named after its target and its writer (`.<name>.<host>-<pid>.<random>`), so
that the next write of the same target removes what a writer killed mid-write (SIGKILL, OOM: no cleanup
ran) left behind, and never what a live writer is still writing.

Nothing here knows about tasks, models or stages; it is the bottom of `grpo_core`.
"""
from __future__ import annotations

import errno
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import yaml


class InputError(ValueError):
    """A file the user gave (or a stage wrote) is malformed; the message names the file, line and fix."""


class DiskFullError(OSError):
    """A write failed because its filesystem is full; the message names the path, the filesystem and the fix."""

    def __init__(self, message: str):
        super().__init__(message)
        self.errno = errno.ENOSPC


_NEARLY_FULL = 1 << 20      # bytes: a failed write that leaves less than this free is taken for a full disk


def _mount_point(path: Path) -> Path:
    path = path.resolve()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def _disk_full_error(exc: BaseException, target: Path) -> DiskFullError | None:
    """A DiskFullError for `exc` if a full filesystem caused it, else None. Call it before the temp is removed:
    ENOSPC in the chain or the message (safetensors says it in words), or the filesystem of `target` nearly full
    at the failure (torch.save's writer only says "unexpected pos")."""
    if not isinstance(exc, Exception):
        return None
    chain, e = [], exc
    while e is not None and all(e is not c for c in chain):
        chain.append(e)
        e = e.__cause__ or e.__context__
    try:
        usage = shutil.disk_usage(target.parent)
    except OSError:
        return None
    said = any(getattr(e, "errno", None) == errno.ENOSPC or "no space left on device" in str(e).lower() for e in chain)
    if not said and (usage.free >= _NEARLY_FULL or not isinstance(exc, (OSError, RuntimeError))):
        return None
    mib = lambda n: f"{n / (1 << 20):.1f} MiB"      # noqa: E731
    mount = _mount_point(target.parent)
    return DiskFullError(f"no space left on device writing {target}: the filesystem at {mount} is full ({mib(usage.free)} "
                         f"free of {mib(usage.total)}). Fix: free space on {mount} (or write to a larger disk)")


def _host() -> str:
    return socket.gethostname().replace(".", "_")


def _temp_prefix(target: Path) -> str:
    return f".{target.name}.{_host()}-{os.getpid()}."


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this machine (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(target: Path) -> None:
    """Remove the temp files and directories of `target` whose writer, on this host, is dead."""
    host = _host()
    for p in target.parent.glob(f".{glob.escape(target.name)}.{glob.escape(host)}-*"):
        pid = p.name[len(target.name) + len(host) + 3:].split(".", 1)[0]
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _fsync_path(path: str | os.PathLike, directory: bool = False) -> None:
    """fsync a file, or a directory (its entries: a rename); a filesystem that cannot sync a directory is let be."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        if not directory:
            raise


def _fsync_tree(root: Path) -> None:
    """Flush every file under `root`, then its directories, to disk: what a rename publishes must be on disk
    before anything that points at it (the stage record), or a power cut can leave the record and empty files."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            if not os.path.islink(os.path.join(dirpath, name)):
                _fsync_path(os.path.join(dirpath, name))
        _fsync_path(dirpath, directory=True)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write a file so that readers see either the old content or the whole new content."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_temp_prefix(path), suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_path(path.parent, directory=True)   # the rename itself, before a record written next can point at it
    except BaseException as e:
        full = _disk_full_error(e, path)
        Path(tmp).unlink(missing_ok=True)
        if full is not None:
            raise full from e
        raise
    return path


def atomic_dir(final: str | os.PathLike, build: Callable[[Path], None], replace: bool = False) -> Path:
    """Build a directory in a temp sibling, then rename it into place (never half-written). An existing
    `final` is replaced when `replace`, else kept (another process won, or it has the same content)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(final)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=_temp_prefix(final)))
    try:
        build(tmp)
        _fsync_tree(tmp)
        if final.exists() and replace:
            shutil.rmtree(final)
        if final.exists():
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, final)
            _fsync_path(final.parent, directory=True)
    except BaseException as e:
        full = _disk_full_error(e, final)
        shutil.rmtree(tmp, ignore_errors=True)
        if full is not None:
            raise full from e
        raise
    return final


def check_writable(path: str | os.PathLike, field: str) -> None:
    """InputError naming `field` when `path` (or, where it does not exist yet, the nearest folder above it) is not a
    directory this process can write in: a read-only filesystem, no permission, a file in the way."""
    path = Path(path).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        why = "is not a directory" if not existing.is_dir() else "is not writable (a read-only filesystem, or no permission)"
        raise InputError(f"{field}: cannot write {path}: {existing} {why}. Fix: give {field} a directory you can "
                         f"write to")


def read_json(path: str | os.PathLike) -> Any:
    return json.loads(Path(path).read_text())


def read_json_object(path: str | os.PathLike) -> dict[str, Any]:
    """A JSON file that holds an object (a record, a state file); InputError naming the file where it does not
    (cut short, or edited by hand into something else)."""
    try:
        value = read_json(path)
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not a JSON object ({e})") from None
    if not isinstance(value, dict):
        raise InputError(f"{path}: not a JSON object (it holds {_JSON_KINDS[type(value)]})")
    return value


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str))


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict[str, Any]]) -> Path:
    return atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


_JSON_KINDS = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number",
               type(None): "null"}


def read_jsonl(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """The JSON objects of a JSONL file, one a line (blank lines skipped); an InputError names the line."""
    return (row for _, row in numbered_jsonl(path))


def numbered_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, JSON object) for each row of a JSONL file, as `read_jsonl` reads them."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")    # a BOM some editors write
            except UnicodeDecodeError as e:
                raise InputError(f"{path}:{lineno}: not UTF-8 text ({raw[e.start]:#04x} at byte {e.start + 1} "
                                 f"of the line); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{lineno}: not valid JSON ({e.msg}); fix or remove the line") from e
            if not isinstance(row, dict):
                raise InputError(f"{path}:{lineno}: a row must be a JSON object ({{\"field\": value, ...}}), "
                                 f"got {_JSON_KINDS[type(row)]}; fix or remove the line")
            yield lineno, row


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A YAML mapping gives one key twice; the message names the key and both lines."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping key given twice (plain YAML keeps the last value silently). The keys
    are checked on the document as written, before any `<<: *anchor` merge is flattened into a mapping (a key
    written beside a merge may override what it merges)."""

    def construct_document(self, node):
        self._check_unique_keys(node)
        return super().construct_document(node)

    def _check_unique_keys(self, root: yaml.Node) -> None:
        todo, seen = [root], set()
        while todo:
            node = todo.pop()
            if id(node) in seen:                      # an alias is the node of its anchor: checked once
                continue
            seen.add(id(node))
            if isinstance(node, yaml.MappingNode):
                first_line: dict[Any, int] = {}
                for key_node, value_node in node.value:
                    todo += [key_node, value_node]
                    if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                        continue
                    key = self.construct_object(key_node)
                    if key in first_line:
                        raise DuplicateKeyError(
                            None, None, f"duplicate key {key!r} (first given at line {first_line[key]}); keep one of "
                                        f"the two", key_node.start_mark)
                    first_line[key] = key_node.start_mark.line + 1
            elif isinstance(node, yaml.SequenceNode):
                todo += node.value


def load_yaml(text: str) -> Any:
    """`yaml.safe_load`, except that a key given twice in one mapping is a yaml.YAMLError naming the key and
    both lines (`grpo_core.config.yaml_problem` turns it into 'line N, column M: duplicate key ...')."""
    return yaml.load(text, Loader=_UniqueKeyLoader)


def stop_process_group(proc: subprocess.Popen, grace: float = 20.0, kill_wait: float = 10.0) -> None:
    """SIGTERM the process group led by `proc` (started with start_new_session), SIGKILL what is left after
    `grace` seconds; a group that is already gone is fine."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, kill_wait)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def grpo_home() -> Path:
    """$GRPO_HOME (models, data caches); unset or empty: ~/.cache/grpo-pipeline (never the working directory)."""
    return Path(os.environ.get("GRPO_HOME") or Path.home() / ".cache" / "grpo-pipeline").expanduser()
