"""The evaluation tools' own file handling (epic_eval.py, success_eval.py, reward_shape.py, sweep.py, label_server.py):
files read with one sentence per problem, outputs written whole or not at all, and a checkpoint's own script loaded
(import_script). The training scripts never use it."""

import contextlib
import csv
import io
import json
import linecache
import os
import re
import shutil
import sys
import time
import types
from pathlib import Path
from typing import Callable, Optional

import filelock

from vlmrm_utils import UserError, check_writable, checkpoint_script, script_changes, script_record

PARTIAL = re.compile(r"^(\..+\.partial-\d+-\d+)(\.lock)?$")  # .<out>.partial-<pid>-<ns>: a folder being written, its lock
PARTIAL_LOCKS: dict[str, filelock.UnixFileLock] = {}  # the partial folders this process writes -> its lock on each


def read_text(path: str, what: str = "") -> str:
    """A small text file (UTF-8, a BOM allowed), or one sentence naming it (and the line of a bad byte)."""
    name = f"{what} {path}" if what else path
    if not os.path.exists(path):
        raise UserError(f"{name}: no such file.")
    if not os.path.isfile(path):  # a folder, or a named pipe that would block the read forever
        raise UserError(f"{name} is not a regular file.")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise UserError(f"{name} cannot be read ({e.strerror}).") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise UserError(
            f"{name} line {line} is not UTF-8 text (byte {data[e.start]:#04x}), so not a file this tool reads."
        ) from None


def read_json(path: str, what: str = ""):
    """A JSON file, or one sentence naming it and the line where it stops being JSON."""
    text = read_text(path, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{f'{what} {path}' if what else path} line {e.lineno} is not valid JSON ({e.msg}).") from None


def read_csv(path: str, needed: list[str], what: str = "") -> list[tuple[int, dict]]:
    """(line number, row) of a CSV file with a header; one sentence naming the file and line when it is empty, lacks
    a needed column, or a row has more or fewer fields than the header (a hand edit gone wrong: never guessed)."""
    name = f"{what} {path}" if what else path
    reader = csv.reader(io.StringIO(read_text(path, what), newline=""))
    try:
        header = next(reader, None)
        if header is None:
            raise UserError(f"{name} is empty: it has no header line.")
        missing = [c for c in needed if c not in header]
        if missing:
            raise UserError(f"{name} lacks the column{'s' * (len(missing) > 1)} {', '.join(missing)} in its header (line 1).")
        rows = []
        for row in reader:
            if not row:  # a blank line
                continue
            if len(row) != len(header):
                raise UserError(
                    f"{name} line {reader.line_num} has {len(row)} fields but the header has {len(header)}; "
                    "fix or remove that line."
                )
            rows.append((reader.line_num, dict(zip(header, row))))
    except csv.Error as e:
        raise UserError(f"{name} line {reader.line_num} is not CSV ({e}).") from None
    return rows


def check_new_folder(path: str, flag: str, why: str) -> None:
    """An output folder written whole or not at all: absent, an empty folder or an empty file, in a writable folder."""
    if os.path.islink(path):  # the finished folder is renamed onto it, which a link (even to an empty folder) refuses
        raise UserError(
            f"{flag} {path} is a symbolic link (to {os.readlink(path)}); pass a new path or the folder it points to."
        )
    empty = os.path.isdir(path) and not os.listdir(path) or os.path.isfile(path) and os.path.getsize(path) == 0
    if os.path.lexists(path) and not empty:
        raise UserError(f"{flag} {path} already exists and is not empty; pass a new {flag} ({why}).")
    check_writable(os.path.dirname(os.path.abspath(path)), flag, "choose another path")


def check_output_file(path: str, flag: str) -> None:
    """A file to (over)write: nothing but a regular file in the way, in a writable folder."""
    if os.path.lexists(path) and not os.path.isfile(path):
        raise UserError(f"{flag}: {path} exists and is not a regular file; choose another {flag}.")
    check_writable(os.path.dirname(os.path.abspath(path)), flag, "choose another path")


def new_partial_folder(out: str) -> str:
    """A hidden folder beside `out` to write into, renamed into place once complete (see publish_folder). Its writer
    holds `<folder>.lock` (an flock the kernel drops when the writer ends, even by SIGKILL; on a shared disk, seen
    from every node and container, which its pid is not): those of a writer that ended unfinished are removed first,
    so that they never pile up."""
    parent, base = os.path.split(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    for name in sorted({match.group(1) for match in map(PARTIAL.match, os.listdir(parent)) if match}):
        stale = filelock.UnixFileLock(os.path.join(parent, name + ".lock"), timeout=0)
        try:
            stale.acquire()
        except filelock.Timeout:  # its writer is still writing
            continue
        if os.path.isdir(os.path.join(parent, name)):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
            print(f"removed {os.path.join(parent, name)}, left unfinished by a run that was killed")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(stale.lock_file)
        stale.release()
    partial = os.path.join(parent, f".{base}.partial-{os.getpid()}-{time.time_ns()}")
    PARTIAL_LOCKS[partial] = filelock.UnixFileLock(partial + ".lock")
    PARTIAL_LOCKS[partial].acquire()  # before the folder exists: no other writer ever finds it without its lock
    os.makedirs(partial)
    return partial


def drop_partial_folder(partial: str) -> None:
    """The `partial` folder (unless renamed into place) and its lock: gone."""
    shutil.rmtree(partial, ignore_errors=True)
    lock = PARTIAL_LOCKS.pop(partial, None)
    if lock is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock.lock_file)
        lock.release()


def publish_folder(partial: str, out: str, flag: str) -> None:
    """Rename the complete `partial` folder to `out` (atomic; replaces an empty folder or empty file, nothing else)."""
    try:
        if os.path.isfile(out) and os.path.getsize(out) == 0:
            os.remove(out)
        os.rename(partial, out)
    except OSError:
        raise UserError(f"{flag} {out} was filled by something else meanwhile; nothing was written.") from None
    finally:
        drop_partial_folder(partial)


def write_folder(out: str, files: dict[str, bytes], flag: str) -> None:
    """A folder of small files ({relative path: bytes}) written whole or not at all: into a hidden partial folder, then
    renamed to `out`. A full disk is one sentence naming the file (exit 1: the machine's failure, not the input's)."""
    partial, name = None, ""
    try:
        partial = new_partial_folder(out)
        for name, data in files.items():
            os.makedirs(os.path.dirname(os.path.join(partial, name)), exist_ok=True)
            with open(os.path.join(partial, name), "wb") as f:
                f.write(data)
    except OSError as e:
        if partial is not None:
            drop_partial_folder(partial)
        why = e.strerror or str(e)
        raise OSError(f"could not write {os.path.join(out, name)} ({why}); nothing was written to {out}.") from None
    publish_folder(partial, out, flag)


def write_atomic(path: str, write: Callable) -> None:
    """`write(file)` into a temporary file beside `path`, on disk, then renamed onto it: never half a file at `path`."""
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.{os.urandom(6).hex()}")
    try:
        with open(tmp, "xb") as f:  # the mode any new file gets (mkstemp's 0600 would stay on the renamed file)
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the rename makes it the file
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise UserError(f"could not write {path} ({e.strerror}); nothing was written there.") from None
        raise


def import_script(checkpoint: dict, name: str, path: Optional[str] = None):
    """The module of the script that wrote `checkpoint` (the tools roll a copy's checkpoint out with the copy's reward,
    env and networks): the file, unchanged, where it ran, beside the run folder holding `path` (an experiment folder
    renamed) or beside this file; else the script as it was, kept in the checkpoint, or (an older checkpoint keeps none)
    the file as edited since, either said in a note; or one sentence naming the script."""
    record = checkpoint_script(checkpoint, name)
    for module in list(sys.modules.values()):  # already imported (the training scripts, or a script loaded before)
        file, loaded = getattr(module, "__file__", None) or "", getattr(module, "__script_sha256__", None)
        if loaded == record["sha256"] or (  # one loaded here is its record's code, whatever its file holds now
            loaded is None
            and os.path.basename(file) == record["file"]
            and os.path.isfile(file)
            and script_record(file)["sha256"] == record["sha256"]
        ):
            return module
    runs = next((p for p in Path(os.path.abspath(path)).parents if p.name == "runs"), None) if path else None
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), record["file"])
    places = [record["path"], *([str(runs.parent / record["file"])] if runs else []), here]
    found = {p: script_record(p) for p in dict.fromkeys(places) if os.path.isfile(p)}
    file = next((p for p, r in found.items() if r["sha256"] == record["sha256"]), None)
    edited = next(iter(found), None)  # else the file of that name, changed since
    changed = f"changed since {name} was written ({script_changes(record, found[edited])})" if edited else ""
    if file:
        source, code_name = found[file]["source"], file
    elif "source" in record:  # the code that wrote it, not the edited file; tracebacks show its own lines
        changed = changed or f"is no longer at {record['path']}"
        print(f"note: {record['file']} {changed}; using the script as it was, kept in the checkpoint")
        file, source = edited or record["path"], record["source"]
        code_name = f"{record['path']} (as kept in {name})"
        linecache.cache[code_name] = (len(source), None, source.decode(errors="replace").splitlines(True), code_name)
    elif edited:
        print(f"note: {record['file']} {changed}; using it as it is now (the checkpoint, by older tools, keeps no copy)")
        file, source, code_name = edited, found[edited]["source"], edited
    else:
        raise UserError(
            f"{name} was written by {record['file']} (sha256 {record['sha256'][:12]}), which is no longer at "
            f"{record['path']}{' or beside the run' if runs else ''}, and the checkpoint (written by older tools) keeps "
            "no copy of it; put the script back there to use this checkpoint."
        )
    module_name = Path(file).stem
    if module_name in sys.modules:  # another file of that name is loaded: this one under a name of its own
        module_name += "_" + record["sha256"][:12]
    module = types.ModuleType(module_name)
    module.__file__, module.__script_sha256__ = file, record["sha256"]  # checkpoints of that sha256 use this module
    sys.modules[module_name] = module  # its dataclasses look their module up while it is executed
    exec(compile(source, code_name, "exec"), module.__dict__)
    return module
