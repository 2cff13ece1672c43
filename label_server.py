"""The label page: a local web server (Python standard library only) where a person judges one item at a time.

epic_eval.py serves it over the frames of a dataset (FRAMES), success_eval.py over the episode videos of a rollout
folder (VIDEOS): one page, label_page.html next to this file, told by a parameter which of the two it shows. Every
label is appended to <folder>/labels.csv (frame, label, time) and fsynced before the page says saved; the last line
of an item wins. The tools import this module; it imports nothing of theirs and no training script.
"""

import csv
import datetime
import fcntl
import http.server
import io
import json
import math
import os
import tempfile
import threading
import urllib.parse
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from vlmrm_utils import UserError

LABELS_HEADER = ["frame", "label", "time"]
SKIP = "skip"  # an item the labeller could not judge: kept in labels.csv, left out of every metric
VERDICTS = ("1", "0", SKIP)  # what the page sends
MAX_LABEL_BODY = 4096  # bytes; a label request is about 50: a bigger one is refused before it is read
LABEL_PAGE_CSP = "frame-ancestors 'none'"  # with X-Frame-Options: no other site can frame the page (clickjacking)
# the page is its own file: HTML, CSS and JavaScript, no build step; the server fills in its one parameter
TEMPLATE = (Path(__file__).parent / "label_page.html").read_text(encoding="utf-8")


@dataclass(frozen=True)
class Media:
    """What the page shows: the files of <folder>/<subfolder>/ that <listing> lists, one at a time."""

    subfolder: str  # also the page's URL prefix
    mime: str
    tag: str  # the HTML element that shows one item
    noun: str
    plural: str
    verb: str
    done: str
    listing: str
    title: str


FRAMES = Media("frames", "image/png", "img", "frame", "frames", "label", "labelled", "states.csv", "label frames")
VIDEOS = Media("videos", "video/mp4", "video", "episode", "episodes", "judge", "judged", "episodes.csv", "judge episodes")


def render_page(media: Media) -> bytes:
    # "<" escaped: nothing in the parameter can end the script element early
    return TEMPLATE.replace("__MEDIA__", json.dumps(asdict(media)).replace("<", "\\u003c"), 1).encode()


def is_plain_file_name(name: object) -> bool:
    """A file directly inside a folder: no separators, not '.' or '..', no control characters (a CSV line each)."""
    ok = isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\")
    return ok and all(ord(c) >= 32 and ord(c) != 127 for c in name)


def is_number(text: str) -> bool:
    """A finite number as float() reads it ("1", "0", "0.5"); not "yes", "nan" or "inf"."""
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


# ----------------------------------------------------------------------------------------------
# labels.csv: append-only, read back line by line
# ----------------------------------------------------------------------------------------------
def read_labels(folder: str, items: set[str], media: Media, graded: bool = False, warn: bool = True) -> dict[str, str]:
    """The last label given to each item in <folder>/labels.csv (raw strings: '1', '0', 'skip'); {} if none yet.

    `graded` also accepts any finite number (epic_eval's hand-written graded labels). Excel's UTF-8 BOM and CRLF line
    ends are read as written by the page; anything else unexpected is one sentence naming the line."""
    path = os.path.join(folder, "labels.csv")
    if not os.path.isfile(path):
        return {}
    with open(path, "rb") as f:
        data = f.read()
    data = data.removeprefix(b"\xef\xbb\xbf")  # Excel and Notepad save UTF-8 with a byte-order mark
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise UserError(
            f"{path} line {line} is not UTF-8 text (byte 0x{data[e.start]:02x}); "
            "labels.csv is text written by the label page: fix or remove that line."
        ) from None
    # split on newlines only: str.splitlines() would also split a name at U+2028 or U+0085 (csv drops a CRLF's CR)
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if not lines:
        return {}
    if next(csv.reader(lines[:1]), []) != LABELS_HEADER:
        raise UserError(
            f"{path} does not start with the header {','.join(LABELS_HEADER)}; it was not written by the label page."
        )
    allowed = "a number (1 success, 0 failure) or skip" if graded else "1 (success), 0 (failure) or skip"
    labels: dict[str, str] = {}
    # one line at a time: a line cut short inside a quoted name must not swallow the next one
    for line_number, line in enumerate(lines[1:], start=2):
        try:
            row = next(csv.reader([line]), [])
        except csv.Error:
            raise UserError(f"{path} line {line_number} is not a CSV line of labels: fix or remove it.") from None
        if len(row) < 3 or not row[2]:  # a write cut short by a crash before the time: never acknowledged
            if warn:
                print(f"warning: ignoring the incomplete line {line_number} of {path}: {','.join(row)!r}")
            continue
        item, label = row[0], row[1].strip()
        if item not in items:
            raise UserError(f"{path} line {line_number} names the {media.noun} {item!r}, which is not in {media.listing}.")
        if label not in VERDICTS and not (graded and is_number(label)):
            raise UserError(
                f"label {label!r} of {media.noun} {item} on line {line_number} of {path} is not {allowed}; fix that line."
            )
        labels[item] = label
    return labels


def write_all(fd: int, data: bytes) -> None:
    """os.write until every byte is out (a write may take only part)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def append_label(path: str, item: str, label: str) -> None:
    """Append one label and fsync before answering: a label the page shows as saved survives a kill.

    A write that fails (a full disk) is cut back off, so no half line stays to be read as a label nobody saw saved."""
    line = io.StringIO()  # the csv module quotes a name with a comma or a quote in it
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)  # append: earlier labels are never rewritten
    try:
        # a kernel lock from the size check to the fsync: two servers on one folder (two processes, each with its own
        # threading lock) would both find the file empty and write a header each
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.lseek(fd, 0, os.SEEK_END)
        new = size == 0
        lead = b"" if new or os.pread(fd, 1, size - 1) == b"\n" else b"\n"  # an earlier write cut short: own line
        csv.writer(line, lineterminator="\n").writerows(([LABELS_HEADER] if new else []) + [[item, label, now]])
        try:
            write_all(fd, lead + line.getvalue().encode())
            os.fsync(fd)
        except OSError:
            try:
                os.ftruncate(fd, size)
            except OSError:
                pass  # the reader ignores a line without its time; the page says this label was not saved
            raise
    finally:
        os.close(fd)
    if new:  # make the new file's directory entry durable too
        dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


# ----------------------------------------------------------------------------------------------
# The server: 127.0.0.1 only; checks what it is given before it serves anything
# ----------------------------------------------------------------------------------------------
def check_items(folder: str, items: list[str], media: Media) -> None:
    """Refuse, before serving, a listing the page could not judge safely: one sentence each."""
    listing = os.path.join(folder, media.listing)
    where = os.path.join(folder, media.subfolder)
    if not items:
        raise UserError(f"{listing} lists no {media.plural}: no {media.plural} to {media.verb}.")
    bad = next((n for n in items if not is_plain_file_name(n)), None)
    if bad is not None:  # a crafted listing must not reach files outside the media folder, nor into labels.csv
        raise UserError(
            f"{listing} names the {media.noun} {bad!r}, which is not a plain file name in {where}; "
            "names must have no folder separators, no '..' and no control characters."
        )
    twice = next((n for n, count in Counter(items).items() if count > 1), None)
    if twice is not None:
        raise UserError(f"{listing} lists {twice} more than once, so one verdict would count twice; list each once.")
    missing = [n for n in items if not os.path.isfile(os.path.join(where, n))]
    if missing:
        raise UserError(
            f"{len(missing)} of the {len(items)} {media.plural} in {listing} have no file in {where} (first: {missing[0]})."
        )


def check_labels_writable(folder: str) -> None:
    """labels.csv can be appended to: found at start-up, not at the first key press."""
    path = os.path.join(folder, "labels.csv")
    if os.path.lexists(path) and not os.path.isfile(path):
        raise UserError(f"{path} is not a regular file, so no label could be saved there; move it away.")
    try:
        if os.path.exists(path):
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND))
        else:  # a probe of our own: labels.csv itself appears with the first label
            fd, probe = tempfile.mkstemp(dir=folder, prefix=".labels-probe-")
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        raise UserError(f"cannot write {path} ({e.strerror}), so no label could be saved; make {folder} writable.") from None


class LabelHTTPServer(http.server.ThreadingHTTPServer):
    request_queue_size = 128  # many posts at once wait in the kernel's queue instead of being turned away (default 5)


def make_label_server(folder: str, port: int, task: str, items: list[str], media: Media) -> LabelHTTPServer:
    """A server for the label page over `items` (files in <folder>/<media.subfolder>/), bound to 127.0.0.1; `port` 0
    picks a free one (see server.server_port). Bad names, a missing file, an empty listing or an unwritable
    labels.csv are refused here, before anything is served."""
    if not 0 <= port <= 65535:  # the socket would raise an OverflowError
        raise UserError(f"--port {port} is not a port number (0 to 65535; 0 = any free port).")
    check_items(folder, items, media)
    item_set = set(items)
    labels_path = os.path.join(folder, "labels.csv")
    read_labels(folder, item_set, media, graded=media is FRAMES)  # refuse to append to a labels.csv we cannot read
    check_labels_writable(folder)
    page = render_page(media)
    lock = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        timeout = 10  # seconds per socket read or write: a stalled client never holds a handler thread

        def log_message(self, *args) -> None:  # keep the terminal for our own messages
            pass

        def end_headers(self) -> None:  # every response, the standard library's error pages included
            # a browser enforces every Content-Security-Policy header it gets: ours holds beside any other
            self.send_header("X-Frame-Options", "DENY")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Content-Security-Policy", LABEL_PAGE_CSP)
            super().end_headers()

        def _send(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def _local(self) -> bool:
            # only pages served from here may talk to us: a foreign Host (DNS rebinding) is refused
            port_ = self.server.server_port
            return self.headers.get("Host") in (f"127.0.0.1:{port_}", f"localhost:{port_}")

        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            prefix = f"/{media.subfolder}/"
            # the page asks for <subfolder>/<encodeURIComponent(name)>; no file but a listed item is ever served
            name = urllib.parse.unquote(path[len(prefix) :]) if path.startswith(prefix) else None
            if not self._local():
                self._send(403, b"forbidden host\n")
            elif path == "/":
                self._send(200, page, "text/html; charset=utf-8")
            elif path == "/api/state":
                try:
                    with lock:
                        state = {"items": items, "labels": read_labels(folder, item_set, media, media is FRAMES), "task": task}
                except UserError as e:  # labels.csv edited by hand while serving
                    self._send(500, f"{e}\n".encode())
                    return
                self._send(200, json.dumps(state).encode(), "application/json")
            elif is_plain_file_name(name) and name in item_set:
                try:
                    with open(os.path.join(folder, media.subfolder, name), "rb") as f:
                        body = f.read()
                except OSError:  # removed since start-up
                    self._send(404, f"{name} is no longer in {media.subfolder}/\n".encode())
                    return
                self._send(200, body, media.mime)
            else:
                self._send(404, b"not found\n")

        def do_POST(self) -> None:
            self.close_connection = True  # the body of a refused request is never read: the connection is not reused
            code, answer = self._save_label() if self._local() else (403, b"forbidden host\n")
            if code is not None:  # None: the client left mid-request, nobody to answer
                try:
                    self._send(code, answer, "application/json" if code == 200 else "text/plain; charset=utf-8")
                except OSError:  # a stalled client that has gone meanwhile
                    pass

        def _save_label(self) -> tuple[Optional[int], bytes]:
            """(status, answer) of a label request; the label is on disk before the 200 answer."""
            if self.path != "/api/label":
                return 404, b"not found\n"
            # JSON only: a cross-site form cannot send it without a CORS preflight, which we never answer
            if self.headers.get("Content-Type", "").split(";")[0].strip() != "application/json":
                return 415, b"send application/json\n"
            length = self.headers.get("Content-Length", "")
            if not (length.isascii() and length.isdigit()):  # missing, negative or not a number: nothing to read safely
                return 400, b"send a Content-Length\n"
            if int(length) > MAX_LABEL_BODY:
                return 413, f"a label request is at most {MAX_LABEL_BODY} bytes\n".encode()
            try:
                data = self.rfile.read(int(length))
            except (TimeoutError, ConnectionError):  # a stalled or vanished client: nothing acknowledged, nothing saved
                return 408, b"the request body did not arrive in time; nothing was saved\n"
            if len(data) != int(length):  # the client closed before sending the whole body: it never sees an answer
                return None, b""
            try:
                body = json.loads(data)
                item, label = body["frame"], body["label"]
            except (ValueError, KeyError, TypeError, RecursionError):
                return 400, b'expected {"frame": ..., "label": ...}\n'
            if not isinstance(item, str) or item not in item_set or label not in VERDICTS:
                return 400, f"unknown {media.noun} or label (labels: 1, 0, {SKIP})\n".encode()
            try:
                with lock:
                    # a line edited in by hand meanwhile would make the next start refuse the file: not saved after it
                    read_labels(folder, item_set, media, media is FRAMES, warn=False)
                    append_label(labels_path, item, label)
            except UserError as e:
                return 409, f"{e} This label was not saved.\n".encode()
            except OSError as e:  # a full disk: say so on the page, keep serving
                why = e.strerror or type(e).__name__
                return 507, (
                    f"could not write {labels_path} ({why}): this label was not saved; every label saved before is on disk\n"
                ).encode()
            return 200, b'{"saved": true}'

    try:
        return LabelHTTPServer(("127.0.0.1", port), Handler)
    except OSError as e:
        raise UserError(
            f"cannot listen on 127.0.0.1:{port} ({e.strerror}); pass another --port, or --port 0 for any free one."
        ) from None


def serve(server: LabelHTTPServer, folder: str, message: str) -> None:
    """Print how to open the page, then serve until Ctrl-C."""
    print(
        f"{message}; open http://127.0.0.1:{server.server_port}/ - keys: 1 success, 0 failure, s skip, Backspace back. "
        "Every label is on disk when the page says saved; stop with Ctrl-C at any time."
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print(f"\nstopped; labels are in {os.path.join(folder, 'labels.csv')}")
    finally:
        server.server_close()
