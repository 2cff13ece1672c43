"""Tests of label_server.py, the label page both tools serve: over HTTP with an in-process server on a free port
(frames of an epic_eval dataset, episode videos of a success_eval rollout folder), its start-up refusals, a full disk,
labels.csv as other programs save it, many posts at once, and the page in a real headless chromium."""

import ast
import csv
import dataclasses
import errno
import importlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.client import HTTPConnection

import numpy as np
import pytest
from conftest import ROOT, assert_clean_error
from PIL import Image

import epic_eval
import label_server
import success_eval
import vlmrm_dqn_classic
from label_server import FRAMES, VIDEOS, UserError, read_labels

CHROMIUM = "/usr/bin/chromium"
FRAME_SIZE = 48


# ---------------------------------------------------------------------------------------------- folders to serve
def make_dataset(path, frames: int = 12, names=None) -> str:
    """An epic_eval dataset as `collect` writes it (small PNGs), without running an env."""
    names = names or [f"{i:06d}.png" for i in range(frames)]
    os.makedirs(os.path.join(path, "frames"))
    rng = np.random.default_rng(0)
    for name in names:
        pixels = rng.integers(0, 256, (FRAME_SIZE, FRAME_SIZE, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(os.path.join(path, "frames", name))
    with open(os.path.join(path, "states.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["frame", "env_id", "episode", "step", "x", "x_dot", "theta", "theta_dot", "gt"])
        writer.writerows([name, "CartPole-v1", 0, i, 0, 0, 0, 0, i % 2] for i, name in enumerate(names))
    return str(path)


def make_rollouts(path, videos=("episode-000.mp4", "episode-001.mp4", "episode-002.mp4"), files=None) -> str:
    """A success_eval rollout folder as `rollout` writes it (policy.json, episodes.csv, videos/), without a policy."""
    os.makedirs(os.path.join(path, "videos"))
    for name in videos if files is None else files:
        with open(os.path.join(path, "videos", name), "wb") as f:
            f.write(b"\x00\x00\x00\x18ftypisom" + bytes(64))
    with open(os.path.join(path, "episodes.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=success_eval.EPISODE_COLUMNS)
        writer.writeheader()
        for i, video in enumerate(videos):
            row = dict(episode=i, video=video, seed=i, steps=25, clip_return="1.5", gt_return="25.0", gt_success="")
            writer.writerow(row)
    run_args = {**dataclasses.asdict(vlmrm_dqn_classic.Args()), "goal": ["pole vertically upright on top of the cart"]}
    policy = dict(checkpoint="/runs/x/checkpoint.pt", script="vlmrm_dqn_classic.py", mode="stochastic", seed=1)
    with open(os.path.join(path, "policy.json"), "w") as f:
        json.dump({**policy, "episodes": len(videos), "args": run_args}, f)
    return str(path)


class Server:
    """A label server in this process on a free port, serving from a thread."""

    def __init__(self, server):
        self.server = server
        self.url = f"http://127.0.0.1:{server.server_port}"
        self.thread = threading.Thread(target=server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def frame_server(dataset: str) -> Server:
    return Server(epic_eval.make_frame_server(dataset, 0, "pole upright?"))  # what `epic_eval.py label` serves


def http(url: str, body=None, headers=None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def raw_request(url: str, request: bytes, timeout: float = 5.0) -> bytes:
    """Send bytes as they are on a fresh connection; the server's whole answer (b"" when it closed without one)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def post_head(url: str, length: str) -> bytes:
    host = url.removeprefix("http://")
    return (
        f"POST /api/label HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def labels_rows(folder: str) -> list[list[str]]:
    with open(os.path.join(folder, "labels.csv"), newline="") as f:
        return [row[:2] for row in csv.reader(f)][1:]


# ---------------------------------------------------------------------------------------------- one module, one page
def test_both_tools_serve_one_template_from_a_module_no_training_code_imports():
    def imports(module) -> set[str]:
        tree = ast.parse(open(module.__file__).read())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        return names | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}

    assert imports(label_server) & {"epic_eval", "success_eval", "vlmrm_dqn_classic", "vlmrm_sac_humanoid"} == set()
    for name in ("vlmrm_dqn_classic", "vlmrm_sac_humanoid", "vlmrm_utils"):
        assert "label_server" not in imports(importlib.import_module(name)), name
    assert {"label_server"} <= imports(epic_eval) and {"label_server"} <= imports(success_eval)
    assert not os.path.exists(os.path.join(ROOT, "epic_eval_label.html"))
    # one template: the two pages differ only in the parameter line, nothing else was rewritten
    frames, videos = (label_server.render_page(m).decode().splitlines() for m in (FRAMES, VIDEOS))
    assert len(frames) == len(videos) and [i for i, (a, b) in enumerate(zip(frames, videos)) if a != b] == [
        next(i for i, line in enumerate(frames) if line.startswith("const MEDIA = "))
    ]
    assert '"tag": "video"' in "\n".join(videos) and "__MEDIA__" not in "\n".join(videos)


# ---------------------------------------------------------------------------------------------- frames over HTTP
def test_label_page_round_trip_over_http(tmp_path):
    ds = make_dataset(tmp_path / "ds")
    labels_csv = os.path.join(ds, "labels.csv")
    server = frame_server(ds)
    try:
        assert server.server.server_address[0] == "127.0.0.1"
        status, page = http(server.url + "/")
        assert status == 200 and b"api/label" in page and b'"tag": "img"' in page
        status, body = http(server.url + "/api/state")
        state = json.loads(body)
        assert status == 200 and len(state["items"]) == 12 and state["labels"] == {} and state["task"] == "pole upright?"
        status, png = http(server.url + "/frames/000000.png")
        assert status == 200 and png[:8] == b"\x89PNG\r\n\x1a\n"
        for frame, value in [("000000.png", "1"), ("000001.png", "0"), ("000002.png", "skip"), ("000000.png", "0")]:
            assert http(server.url + "/api/label", {"frame": frame, "label": value})[0] == 200
        # the label is on disk when the server answers
        with open(labels_csv) as f:
            lines = f.read().splitlines()
        assert lines[0] == "frame,label,time" and [line.split(",")[:2] for line in lines[1:]] == [
            ["000000.png", "1"],
            ["000001.png", "0"],
            ["000002.png", "skip"],
            ["000000.png", "0"],
        ]
        # refused: unknown frame or label, other files, a foreign Host (DNS rebinding), a non-JSON (form) post
        assert http(server.url + "/api/label", {"frame": "../states.csv", "label": "1"})[0] == 400
        assert http(server.url + "/api/label", {"frame": "000003.png", "label": "maybe"})[0] == 400
        assert http(server.url + "/frames/../states.csv")[0] == 404
        assert http(server.url + "/api/state", headers={"Host": "evil.example:80"})[0] == 403
        assert http(server.url + "/api/label", {"frame": "000003.png", "label": "1"}, {"Content-Type": "text/plain"})[0] == 415
    finally:
        server.close()
    # resumable: a new server sees every label given before (the last one per frame)
    before = open(labels_csv).read()
    server = frame_server(ds)
    try:
        state = json.loads(http(server.url + "/api/state")[1])
        assert state["labels"] == {"000000.png": "0", "000001.png": "0", "000002.png": "skip"}
        assert http(server.url + "/api/label", {"frame": "000003.png", "label": "1"})[0] == 200
        after = open(labels_csv).read()
        # a hand edit gone wrong while serving: the page is told why it cannot load, the connection is not dropped
        with open(labels_csv, "a") as f:
            f.write("000004.png,yes,t\n")
        status, answer = http(server.url + "/api/state")
        assert status == 500 and b"label 'yes' of frame 000004.png on line 7" in answer, answer
    finally:
        server.close()
    assert after.startswith(before) and after.count("\n") == before.count("\n") + 1  # appended, nothing rewritten


def test_label_page_refuses_frames_outside_the_dataset(tmp_path):
    """A crafted states.csv naming ../file or /abs/file as a frame is refused before anything is served."""
    secret = tmp_path / "secret.txt"
    secret.write_text("not a frame")
    for i, bad in enumerate(["../secret.txt", str(secret), "..", "a\\b.png", "new\nline.png"]):
        ds = make_dataset(tmp_path / f"ds{i}", frames=3)
        shutil.copyfile(secret, os.path.join(ds, "secret.txt"))  # what ../secret.txt reaches from frames/
        with open(os.path.join(ds, "states.csv"), newline="") as f:
            rows = list(csv.reader(f))
        rows[1][0] = bad
        with open(os.path.join(ds, "states.csv"), "w", newline="") as f:
            csv.writer(f).writerows(rows)
        with pytest.raises(UserError, match="which is not a plain file name"):
            epic_eval.make_frame_server(ds, 0, "pole upright?")
        with pytest.raises(UserError, match="which is not a plain file name"):
            epic_eval.label_values(ds, "gt")  # score reads frames through the same check


def test_label_page_bad_requests_get_an_answer_and_save_nothing(tmp_path):
    ds = make_dataset(tmp_path / "ds")
    labels_csv = os.path.join(ds, "labels.csv")
    server = frame_server(ds)
    server.server.RequestHandlerClass.timeout = 0.5  # the handler's socket timeout, short for the test
    try:
        # a frame or a label that is not a string, a body that is not an object: 400, not a dropped connection
        for body in [
            {"frame": ["000000.png"], "label": "1"},
            {"frame": {"a": 1}, "label": "1"},
            {"frame": 3, "label": "1"},
            {"frame": "000000.png", "label": ["1"]},
            ["000000.png", "1"],
            "000000.png",
            None,
        ]:
            data = json.dumps(body).encode()
            answer = raw_request(server.url, post_head(server.url, str(len(data))) + data)
            assert answer.startswith(b"HTTP/1.0 400"), (body, answer)
        deep = b"[" * 3000  # within the size bound, deeper than the JSON parser recurses
        assert raw_request(server.url, post_head(server.url, str(len(deep))) + deep).startswith(b"HTTP/1.0 400")
        # bad lengths are refused before a byte of the body is read
        for length, code in [
            ("-1", b"400"),
            ("abc", b"400"),
            ("", b"400"),
            ("1e3", b"400"),
            ("10000000000", b"413"),
            (str(label_server.MAX_LABEL_BODY + 1), b"413"),
        ]:
            start = time.monotonic()
            answer = raw_request(server.url, post_head(server.url, length))
            assert answer.startswith(b"HTTP/1.0 " + code), (length, answer)
            assert time.monotonic() - start < 0.4, length  # answered at once, not after the socket timeout
        # a body shorter than its Content-Length: after the handler's timeout the connection is answered and closed
        data = json.dumps({"frame": "000000.png", "label": "1"}).encode()
        start = time.monotonic()
        answer = raw_request(server.url, post_head(server.url, str(len(data) + 10)) + data, timeout=5)
        assert answer.startswith(b"HTTP/1.0 408") and time.monotonic() - start < 3, answer
        # the same, with the client leaving before the server gave up: never acknowledged, so never saved
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(post_head(server.url, str(len(data) + 10)) + data)
            sock.shutdown(socket.SHUT_WR)
            assert sock.recv(100) == b""
        time.sleep(0.2)
        assert not os.path.exists(labels_csv)
        # the server is still serving
        assert http(server.url + "/api/label", {"frame": "000000.png", "label": "1"})[0] == 200
    finally:
        server.close()
    assert labels_rows(ds) == [["000000.png", "1"]]


def test_label_page_frame_names_with_commas_and_quotes(tmp_path):
    names = ["000000.png", "a,b.png", 'say "hi".png', "50%,x y.png", "line\u2028sep.png"]
    ds = make_dataset(tmp_path / "ds", names=names)
    server = frame_server(ds)
    try:
        for name in names[1:]:
            status, png = http(server.url + "/frames/" + urllib.parse.quote(name, safe=""))  # as encodeURIComponent
            assert status == 200 and png[:8] == b"\x89PNG\r\n\x1a\n", name
            assert http(server.url + "/api/label", {"frame": name, "label": "1"})[0] == 200
        assert http(server.url + "/api/label", {"frame": names[1], "label": "0"})[0] == 200
        state = json.loads(http(server.url + "/api/state")[1])
        assert state["labels"] == {names[1]: "0", names[2]: "1", names[3]: "1", names[4]: "1"}
    finally:
        server.close()
    assert labels_rows(ds) == [[names[1], "1"], [names[2], "1"], [names[3], "1"], [names[4], "1"], [names[1], "0"]]
    frames, labels = epic_eval.label_values(ds, "human")
    assert dict(zip(frames, labels.tolist())) == {names[1]: 0.0, names[2]: 1.0, names[3]: 1.0, names[4]: 1.0}


def test_label_page_cannot_be_framed_or_sniffed(tmp_path):
    server = frame_server(make_dataset(tmp_path / "ds", frames=2))
    try:
        port = server.server.server_port
        for method, path, host in [
            ("GET", "/", None),
            ("GET", "/api/state", None),
            ("GET", "/frames/000000.png", None),
            ("GET", "/nothing", None),
            ("GET", "/", "evil.example"),
            ("PUT", "/", None),
        ]:
            connection = HTTPConnection("127.0.0.1", port, timeout=5)
            try:
                connection.request(method, path, headers={"Host": host or f"127.0.0.1:{port}"})
                response = connection.getresponse()
                response.read()
            finally:
                connection.close()
            assert response.getheader("X-Frame-Options") == "DENY", (method, path, host)
            assert response.getheader("X-Content-Type-Options") == "nosniff", (method, path, host)
            assert "frame-ancestors 'none'" in response.getheader("Content-Security-Policy", ""), (method, path, host)
    finally:
        server.close()


# ---------------------------------------------------------------------------------------------- episode videos
def test_episode_page_serves_videos_with_the_label_pages_protections(tmp_path):
    folder = make_rollouts(tmp_path / "r")
    server = Server(success_eval.make_episode_server(folder, 0))  # what `success_eval.py label` serves
    try:
        with urllib.request.urlopen(server.url + "/videos/episode-001.mp4", timeout=10) as response:
            assert response.headers["Content-Type"] == "video/mp4" and response.headers["X-Frame-Options"] == "DENY"
            assert response.read()[4:8] == b"ftyp"
        for path in ["/videos/..%2Fepisodes.csv", "/frames/episode-001.mp4", "/videos/policy.json"]:
            assert http(server.url + path)[0] == 404, path
        status, page = http(server.url + "/")
        assert status == 200 and b'"tag": "video"' in page and b'"plural": "episodes"' in page
        state = json.loads(http(server.url + "/api/state")[1])
        assert state["items"] == ["episode-000.mp4", "episode-001.mp4", "episode-002.mp4"]
        assert state["task"] == "pole vertically upright on top of the cart"  # the run's goal
        # a video removed while serving: a 404 answer, not a dropped connection
        os.remove(os.path.join(folder, "videos", "episode-002.mp4"))
        assert http(server.url + "/videos/episode-002.mp4")[0] == 404
    finally:
        server.close()


@pytest.mark.parametrize(
    "videos, files, words",
    [
        (["episode-000.mp4", "episode-001.mp4"], ["episode-000.mp4"], ["1 of the 2 episodes", "first: episode-001.mp4"]),
        (["episode-000.mp4", "../policy.json"], None, ["'../policy.json'", "not a plain file name"]),
        (["episode-000.mp4", "/etc/hostname"], None, ["'/etc/hostname'", "not a plain file name"]),
        (["episode-000.mp4", "episode-000.mp4"], None, ["episode-000.mp4 more than once", "count twice"]),
        ([], None, ["no episodes to judge"]),
    ],
)
def test_episode_folders_the_page_cannot_judge_safely_are_refused_before_serving(tmp_path, videos, files, words):
    files = files if files is not None else [v for v in videos if "/" not in v]
    folder = make_rollouts(tmp_path / "r", videos=videos, files=files)
    for serve in (
        lambda: success_eval.make_episode_server(folder, 0),  # its episodes.csv reader may refuse first
        lambda: label_server.make_label_server(folder, 0, "task", list(videos), VIDEOS),  # the server's own check
    ):
        with pytest.raises(UserError) as error:
            serve()
        message = str(error.value)
        assert "\n" not in message and all(word in message for word in words), message
    assert not os.path.exists(os.path.join(folder, "labels.csv"))


def test_an_empty_episode_folder_exits_2_in_one_sentence_instead_of_serving_nothing(tmp_path):
    folder = make_rollouts(tmp_path / "r", videos=())
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "success_eval.py"), "label", "--rollouts", folder, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,  # today's fault was serving "judging 0 episodes" forever
    )
    assert result.returncode == 2
    assert_clean_error(result, "no episodes to judge")


def test_a_killed_label_server_keeps_every_verdict_it_acknowledged(tmp_path):
    folder = make_rollouts(tmp_path / "r")
    command = [sys.executable, os.path.join(ROOT, "success_eval.py"), "label", "--rollouts", folder, "--port", "0"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()  # "judging 3 episodes of ... open http://127.0.0.1:<port>/ - keys: ..."
        url = line.split("open ")[1].split("/ ")[0]
        for video, verdict in [("episode-000.mp4", "1"), ("episode-001.mp4", "skip"), ("episode-002.mp4", "0")]:
            assert http(url + "/api/label", {"frame": video, "label": verdict})[0] == 200
    finally:
        proc.kill()  # SIGKILL: no handler runs, nothing is flushed on the way out
        proc.wait(10)
        proc.stdout.close()
    assert labels_rows(folder) == [["episode-000.mp4", "1"], ["episode-001.mp4", "skip"], ["episode-002.mp4", "0"]]


def test_labels_csv_that_cannot_be_written_is_refused_at_start_up(tmp_path, monkeypatch):
    folder = make_rollouts(tmp_path / "r")
    os.makedirs(os.path.join(folder, "labels.csv"))
    with pytest.raises(UserError, match=r"labels.csv is not a regular file, so no label could be saved there"):
        success_eval.make_episode_server(folder, 0)
    os.rmdir(os.path.join(folder, "labels.csv"))

    def read_only(*args, **kwargs):  # a read-only folder (chmod does not stop root, who runs CI)
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(label_server.tempfile, "mkstemp", read_only)
    with pytest.raises(UserError, match=r"cannot write .*labels.csv \(Permission denied\), so no label could be saved"):
        success_eval.make_episode_server(folder, 0)


def test_an_unknown_video_in_labels_csv_is_named_as_an_episode(tmp_path):
    folder = make_rollouts(tmp_path / "r")
    label_server.append_label(os.path.join(folder, "labels.csv"), "episode-009.mp4", "1")
    with pytest.raises(UserError) as error:
        success_eval.make_episode_server(folder, 0)
    message = str(error.value)
    assert "line 2 names the episode 'episode-009.mp4', which is not in episodes.csv" in message
    assert "frame" not in message and "states.csv" not in message


# ---------------------------------------------------------------------------------------------- a full disk
def test_a_full_disk_is_a_507_with_one_sentence_and_nothing_half_written(tmp_path, monkeypatch):
    folder = make_rollouts(tmp_path / "r")
    labels_csv = os.path.join(folder, "labels.csv")
    server = Server(success_eval.make_episode_server(folder, 0))
    write_all = label_server.write_all

    def disk_full(fd: int, data: bytes) -> None:  # the disk fills up half way through the line
        write_all(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    try:
        assert http(server.url + "/api/label", {"frame": "episode-000.mp4", "label": "1"})[0] == 200
        before = open(labels_csv, "rb").read()
        monkeypatch.setattr(label_server, "write_all", disk_full)
        status, answer = http(server.url + "/api/label", {"frame": "episode-001.mp4", "label": "0"})
        assert status == 507, answer  # answered: the connection was not dropped
        sentence = answer.decode().strip()
        assert sentence == (
            f"could not write {labels_csv} (No space left on device): this label was not saved; every label saved "
            "before is on disk"
        )
        assert open(labels_csv, "rb").read() == before  # the half line was cut back off
        monkeypatch.setattr(label_server, "write_all", write_all)  # space again: the same server goes on
        assert http(server.url + "/api/label", {"frame": "episode-001.mp4", "label": "0"})[0] == 200
    finally:
        server.close()
    assert labels_rows(folder) == [["episode-000.mp4", "1"], ["episode-001.mp4", "0"]]


def test_no_label_is_saved_after_a_line_the_next_start_would_refuse(tmp_path):
    """labels.csv edited by hand while the page serves: the page answered saved: true, then the next start refused the
    file. Now the label is not saved, the page says why (the same sentence the start gives), and it saves again once
    the line is fixed."""
    folder = make_rollouts(tmp_path / "r")
    labels_csv = os.path.join(folder, "labels.csv")
    server = Server(success_eval.make_episode_server(folder, 0))
    try:
        assert http(server.url + "/api/label", {"frame": "episode-000.mp4", "label": "1"})[0] == 200
        with open(labels_csv, "a") as f:
            f.write("episode-001.mp4,maybe,2024-01-01T00:00:00+00:00\n")
        before = open(labels_csv, "rb").read()
        status, answer = http(server.url + "/api/label", {"frame": "episode-002.mp4", "label": "0"})
        assert status == 409, answer
        with pytest.raises(UserError) as start:
            success_eval.make_episode_server(folder, 0)
        assert answer.decode().strip() == f"{start.value} This label was not saved."
        assert "'maybe'" in str(start.value) and "line 3" in str(start.value)
        assert open(labels_csv, "rb").read() == before
        with open(labels_csv, "wb") as f:  # fixed by hand: the same server saves again
            f.write(before.replace(b",maybe,", b",skip,"))
        assert http(server.url + "/api/label", {"frame": "episode-002.mp4", "label": "0"})[0] == 200
    finally:
        server.close()
    assert labels_rows(folder) == [["episode-000.mp4", "1"], ["episode-001.mp4", "skip"], ["episode-002.mp4", "0"]]


# ---------------------------------------------------------------------------------------------- labels.csv as saved elsewhere
def test_two_servers_saving_their_first_label_at_once_write_one_header(tmp_path, monkeypatch):
    """Two label servers on one dataset (two processes: each its own threading lock) both found labels.csv empty and
    wrote a header each (1 in 14 tries): a kernel lock on the file orders them. Widened here: each write waits 0.2 s."""
    path, write_all = str(tmp_path / "labels.csv"), label_server.write_all
    monkeypatch.setattr(label_server, "write_all", lambda fd, data: time.sleep(0.2) or write_all(fd, data))
    start = threading.Barrier(2)
    savers = [
        threading.Thread(target=lambda item=item: (start.wait(), label_server.append_label(path, item, "1")))
        for item in ("a.png", "b.png")
    ]
    for saver in savers:
        saver.start()
    for saver in savers:
        saver.join(timeout=10)
    lines = open(path).read().splitlines()
    assert len(lines) == 3 and lines[0] == ",".join(label_server.LABELS_HEADER), lines
    assert read_labels(str(tmp_path), {"a.png", "b.png"}, FRAMES) == {"a.png": "1", "b.png": "1"}


def test_labels_csv_saved_by_excel_or_notepad_is_read_and_appended_to(tmp_path):
    folder = make_rollouts(tmp_path / "r")
    labels_csv = os.path.join(folder, "labels.csv")
    with open(labels_csv, "wb") as f:  # a UTF-8 byte-order mark and CRLF line ends
        f.write(b"\xef\xbb\xbfframe,label,time\r\nepisode-000.mp4,1,t\r\nepisode-001.mp4,skip,t\r\n")
    items = {"episode-000.mp4", "episode-001.mp4", "episode-002.mp4"}
    assert read_labels(folder, items, VIDEOS) == {"episode-000.mp4": "1", "episode-001.mp4": "skip"}
    server = Server(success_eval.make_episode_server(folder, 0))
    try:
        assert http(server.url + "/api/label", {"frame": "episode-002.mp4", "label": "0"})[0] == 200
    finally:
        server.close()
    assert read_labels(folder, items, VIDEOS) == {"episode-000.mp4": "1", "episode-001.mp4": "skip", "episode-002.mp4": "0"}


@pytest.mark.parametrize(
    "content, words",
    [
        (b"frame,label,time\nepisode-000.mp4,1,t\nepisode-\xff\xfe01.mp4,0,t\n", ["line 3 is not UTF-8 text"]),
        (b"frame,label,time\nepisode-000.mp4,banana,t\n", ["label 'banana' of episode episode-000.mp4 on line 2 of"]),
        (b"frame,label,time\r\nepisode-000.mp4,1,t\r\nepisode-001.mp4,2,t\r\n", ["label '2'", "on line 3 of"]),
        (b"frame,label,time\nepisode-000.mp4,0.5,t\n", ["label '0.5'", "is not 1 (success), 0 (failure) or skip"]),
    ],
)
def test_labels_csv_with_binary_bytes_or_other_labels_is_one_sentence_naming_the_line(tmp_path, content, words):
    folder = make_rollouts(tmp_path / "r")
    with open(os.path.join(folder, "labels.csv"), "wb") as f:
        f.write(content)
    with pytest.raises(UserError) as error:
        read_labels(folder, {"episode-000.mp4", "episode-001.mp4"}, VIDEOS)
    message = str(error.value)
    assert "\n" not in message and os.path.join(folder, "labels.csv") in message, message
    assert all(word in message for word in words), message


def test_frame_labels_may_be_graded_numbers_but_not_words(tmp_path):
    ds = make_dataset(tmp_path / "ds", frames=3)
    with open(os.path.join(ds, "labels.csv"), "w") as f:
        f.write("frame,label,time\n000000.png,0.5,t\n000001.png,1,t\n")
    assert epic_eval.label_values(ds, "human")[1].tolist() == [0.5, 1.0]  # documented: EPIC works on graded labels
    with open(os.path.join(ds, "labels.csv"), "a") as f:
        f.write("000002.png,yes,t\n")
    with pytest.raises(UserError, match=r"label 'yes' of frame 000002.png on line 4 of .*labels.csv is not a number"):
        epic_eval.label_values(ds, "human")


# ---------------------------------------------------------------------------------------------- many posts at once
def test_many_posts_at_once_wait_in_the_listen_queue_and_are_all_saved(tmp_path):
    ds = make_dataset(tmp_path / "ds", frames=100)
    server = epic_eval.make_frame_server(ds, 0, "pole upright?")
    url = f"http://127.0.0.1:{server.server_port}"
    sockets, thread = [], threading.Thread(target=server.serve_forever, daemon=True)
    try:
        # not serving yet: every connection waits in the kernel's listen queue (a queue of 5 turns the 7th away: its
        # connect times out)
        for i in range(100):
            sock = socket.create_connection(("127.0.0.1", server.server_port), timeout=1)
            data = json.dumps({"frame": f"{i:06d}.png", "label": "1"}).encode()
            sock.sendall(post_head(url, str(len(data))) + data)
            sockets.append(sock)
        thread.start()
        for sock in sockets:
            sock.settimeout(10)
            assert sock.recv(100).startswith(b"HTTP/1.0 200")
    finally:
        for sock in sockets:
            sock.close()
        if thread.is_alive():  # shutdown() waits for a serve_forever that never started
            server.shutdown()
        server.server_close()
    assert sorted(frame for frame, _ in labels_rows(ds)) == [f"{i:06d}.png" for i in range(100)]


# ---------------------------------------------------------------------------------------------- the page in chromium
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def webdriver(method: str, url: str, payload=None):
    data = json.dumps(payload).encode() if payload is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["value"]


def wait_for(condition, timeout: float = 20.0, what: str = "condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _ready(base: str) -> bool:
    try:
        return bool(webdriver("GET", f"{base}/status")["ready"])
    except OSError:
        return False


@pytest.mark.skipif(
    not os.path.exists(CHROMIUM),
    reason="needs Debian's chromium at /usr/bin/chromium (apt-get install -y chromium chromium-driver)",
)
def test_label_page_in_headless_chromium(tmp_path, monkeypatch):
    chromedriver = shutil.which("chromedriver") or "/usr/bin/chromedriver"
    assert os.path.exists(chromedriver), "chromium is installed but chromedriver is not: apt-get install -y chromium-driver"
    ds = make_dataset(tmp_path / "ds", frames=8)
    with open(os.path.join(ds, "labels.csv"), "w") as f:  # an earlier session: the page resumes after it
        f.write("frame,label,time\n000000.png,1,2024-01-01T00:00:00+00:00\n")
    server = frame_server(ds)
    driver_port = free_port()
    driver = subprocess.Popen([chromedriver, f"--port={driver_port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{driver_port}"
    session = None
    try:
        wait_for(lambda: _ready(base), what="chromedriver")
        flags = "--headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking"
        flags = [*flags.split(), "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
        flags.append(f"--user-data-dir={tmp_path / 'profile'}")
        options = {"binary": CHROMIUM, "args": flags}
        session = webdriver(
            "POST",
            f"{base}/session",
            {"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": options}}},
        )["sessionId"]
        webdriver("POST", f"{base}/session/{session}/url", {"url": server.url + "/"})

        def script(js: str):
            return webdriver("POST", f"{base}/session/{session}/execute/sync", {"script": js, "args": []})

        def press(*keys: str) -> None:
            actions = [a for key in keys for a in ({"type": "keyDown", "value": key}, {"type": "keyUp", "value": key})]
            webdriver(
                "POST",
                f"{base}/session/{session}/actions",
                {"actions": [{"type": "key", "id": "keyboard", "actions": actions}]},
            )

        wait_for(lambda: script("return document.body.dataset.ready === '1'"), what="the page to load the dataset")
        assert script("return document.title") == "label frames"
        assert script("return document.getElementById('name').textContent").startswith("000001.png")  # resumed
        wait_for(lambda: script("return document.getElementById('frame').naturalWidth") == FRAME_SIZE, what="the frame")

        # real key presses: 1 (success), 0 (failure), s (skip), Backspace (back to 000003), 1 (relabel it)
        press("1", "0", "s", "\ue003", "1")
        wait_for(lambda: len(labels_rows(ds)) == 5, what="4 new labels in labels.csv")
        rows = labels_rows(ds)
        assert rows == [
            ["000000.png", "1"],
            ["000001.png", "1"],
            ["000002.png", "0"],
            ["000003.png", "skip"],
            ["000003.png", "1"],
        ]
        wait_for(
            lambda: script("return document.getElementById('name').textContent").startswith("000004.png"),
            what="the page to move on",
        )
        progress = script("return document.getElementById('progress').textContent")
        assert progress.startswith("4 of 8 frames labelled (3 success, 1 failure, 0 skipped)"), progress

        # the disk fills up: the page shows the server's sentence, stays on the frame, and nothing is written
        def disk_full(fd: int, data: bytes) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(label_server, "write_all", disk_full)
        press("0")
        wait_for(lambda: "NOT" in script("return document.getElementById('status').textContent"), what="NOT saved")
        status = script("return document.getElementById('status').textContent")
        assert status.startswith("NOT saved: could not write") and "(No space left on device)" in status, status
        assert "every label saved before is on disk" in status and "running" not in status, status
        assert script("return document.getElementById('name').textContent").startswith("000004.png")
        assert labels_rows(ds) == rows
    finally:
        if session:
            try:
                webdriver("DELETE", f"{base}/session/{session}")
            except OSError:
                pass
        driver.terminate()
        driver.wait(10)
        server.close()
