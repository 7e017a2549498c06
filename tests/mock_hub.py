"""A local stand-in for the Hugging Face Hub's file endpoints, on 127.0.0.1 (HF_ENDPOINT points at it): what
huggingface_hub asks for when ds4py pulls.

  GET  /api/models/{repo}[/revision/{rev}]?blobs=true   model info: the commit, siblings with sizes, git blob ids
                                                        and, for LFS files, the sha256 (`lfs.sha256`)
  HEAD /{repo}/resolve/{rev}/{file}                     ETag, X-Repo-Commit, Content-Length; LFS files also
                                                        X-Linked-Etag / X-Linked-Size (the sha256 and real size)
  GET  /{repo}/resolve/{rev}/{file}                     the bytes, honouring `Range: bytes=N-` (206)

Faults, set per test: `cut_once` (the next GET of that file sends that many bytes and drops the connection),
`stall` (a GET sends `stall` bytes and then waits until the test ends: for Ctrl-C), `corrupt` (the bytes served
differ from the published sha256 in one byte). `requests` records (method, path, Range header), `auth` each
request's Authorization header.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


@dataclass
class MockHub:
    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)      # repo -> {file: bytes}
    cut_once: dict = field(default_factory=dict)                           # file -> bytes sent before a cut
    stall: dict = field(default_factory=dict)                              # file -> bytes sent before stalling
    corrupt: set = field(default_factory=set)                              # files served with one byte flipped
    requests: list = field(default_factory=list)
    auth: list = field(default_factory=list)                               # each request's Authorization

    def __post_init__(self):
        self.release = threading.Event()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):          # quiet
                pass

            def do_GET(self):
                hub._handle(self, body=True)

            def do_HEAD(self):
                hub._handle(self, body=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    @staticmethod
    def is_lfs(file: str) -> bool:
        return file.endswith((".gguf", ".safetensors"))

    def _reply(self, h, code: int, headers: dict, body: bytes = b"", send_body: bool = True) -> None:
        h.send_response(code)
        for k, v in headers.items():
            h.send_header(k, str(v))
        h.end_headers()
        if send_body and body:
            h.wfile.write(body)

    def _handle(self, h, body: bool) -> None:
        path = h.path.split("?", 1)[0]
        self.requests.append((h.command, path, h.headers.get("Range")))
        self.auth.append(h.headers.get("Authorization"))
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?", path)
        if m:
            return self._info(h, m.group(1))
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m and m.group(1) in self.repos and m.group(3) in self.repos[m.group(1)]:
            return self._file(h, m.group(1), m.group(3), body)
        self._reply(h, 404, {"X-Error-Code": "RepoNotFound" if not m or m.group(1) not in self.repos
                             else "EntryNotFound", "Content-Length": 0})

    def _info(self, h, repo: str) -> None:
        if repo not in self.repos:
            return self._reply(h, 404, {"X-Error-Code": "RepoNotFound", "Content-Length": 0})
        siblings = []
        for name, data in self.repos[repo].items():
            s = {"rfilename": name, "size": len(data), "blobId": git_sha1(data)}
            if self.is_lfs(name):
                s["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
            siblings.append(s)
        body = json.dumps({"id": repo, "sha": COMMIT, "siblings": siblings}).encode()
        self._reply(h, 200, {"Content-Type": "application/json", "Content-Length": len(body)}, body)

    def _file(self, h, repo: str, file: str, body: bool) -> None:
        data = self.repos[repo][file]
        lfs = self.is_lfs(file)
        etag = hashlib.sha256(data).hexdigest() if lfs else git_sha1(data)
        if file in self.corrupt:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        headers = {"ETag": f'"{etag}"', "X-Repo-Commit": COMMIT, "Accept-Ranges": "bytes"}
        if lfs:
            headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": len(data)})
        start = 0
        rng = h.headers.get("Range")
        if body and rng:
            start = int(re.fullmatch(r"bytes=(\d+)-", rng).group(1))
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        part = data[start:]
        headers["Content-Length"] = len(part) if body else len(data)
        if not body:
            return self._reply(h, 200, headers, send_body=False)
        h.send_response(206 if rng else 200)
        for k, v in headers.items():
            h.send_header(k, str(v))
        h.end_headers()
        if file in self.stall:
            h.wfile.write(part[: self.stall.pop(file)])
            h.wfile.flush()
            self.release.wait(60)
            h.close_connection = True
            return
        if file in self.cut_once:
            h.wfile.write(part[: self.cut_once.pop(file)])
            h.wfile.flush()
            h.close_connection = True
            return
        h.wfile.write(part)
