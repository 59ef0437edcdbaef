"""A local stand-in for the Hugging Face Hub API, enough for `HfApi.create_repo` + `upload_folder`.

Started inside a test on 127.0.0.1 (port 0, a `ThreadingHTTPServer` in a daemon thread) and
stopped at teardown. It implements the routes huggingface_hub 2.4.0 calls on the plain-HTTP
(non-Xet) upload path, found by reading `hf_api.py` / `_commit_api.py` / `lfs.py` and by logging
requests:

    POST /api/repos/create                              create (409 if it exists)
    GET  /api/models/{repo}                             repo info (create_repo asks it after a 401/403)
    POST /api/models/{repo}/branch/{branch}             create a branch
    POST /api/validate-yaml                             README.md metadata check (parses the YAML)
    POST /api/models/{repo}/preupload/{rev}             uploadMode per file: "lfs" if size >= lfs_threshold
    POST /{repo}.git/info/lfs/objects/batch             LFS batch: a PUT href per object not yet stored
    PUT  /lfs-upload/{oid}                              the upload URL handed out (sha256 checked)
    POST /api/models/{repo}/commit/{rev}                NDJSON: header, file (base64), lfsFile (oid)

Anything else answers 404 and is logged in `requests` (so a test sees an unexpected call).
Xet: the client uses Xet whenever `hf_xet` is installed, without asking the server, so the test
sets `huggingface_hub.constants.HF_HUB_DISABLE_XET = True` (see `hub` fixture in test_push.py);
the server never offers Xet.

What arrives is stored: `server.files[(repo_id, revision)] = {path: bytes}`; `server.fail` maps a
route name ("create", "preupload", "lfs_batch", "lfs_put", "commit", "*") to an HTTP status that
route answers instead (e.g. {"commit": 500}, {"*": 401}).

`SilentServer` is the opposite: it accepts connections on 127.0.0.1 and never answers (for the
push timeout test); it stops by itself after its lifetime.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import re
import threading
import uuid
from typing import Any

import yaml

_ROUTES = [  # (method, regex, route name)
    ("POST", re.compile(r"^/api/repos/create$"), "create"),
    ("GET", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)$"), "repo_info"),
    ("POST", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/branch/(?P<rev>[^/]+)$"), "branch"),
    ("POST", re.compile(r"^/api/validate-yaml$"), "validate_yaml"),
    ("POST", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/preupload/(?P<rev>[^/]+)$"), "preupload"),
    ("POST", re.compile(r"^/(?P<repo>[^/]+/[^/]+)\.git/info/lfs/objects/batch$"), "lfs_batch"),
    ("PUT", re.compile(r"^/lfs-upload/(?P<oid>[0-9a-f]{64})$"), "lfs_put"),
    ("POST", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/commit/(?P<rev>[^/]+)$"), "commit"),
]


class HubServer:
    """The server's state and lifetime; use as a context manager (`with HubServer() as hub:`)."""

    def __init__(self, lfs_threshold: int = 16 * 1024) -> None:
        self.lfs_threshold = lfs_threshold  # files at least this large are sent through LFS
        self.requests: list[tuple[str, str, str]] = []  # (method, path, route name or "unknown")
        self.auth_headers: list[tuple[str, str]] = []  # (route name, Authorization header) per request
        self.repos: dict[str, dict[str, Any]] = {}  # repo_id -> {"private": bool, "branches": set}
        self.files: dict[tuple[str, str], dict[str, bytes]] = {}  # (repo_id, revision) -> committed files
        self.lfs_objects: dict[str, bytes] = {}  # sha256 hex -> bytes received by PUT
        self.commits: list[dict[str, Any]] = []  # header of each commit + repo/revision/create_pr
        self.fail: dict[str, int] = {}
        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True)

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def routes_seen(self) -> list[str]:
        return [route for _, _, route in self.requests]

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=10)


def _handler(hub: HubServer) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # quiet: the test reads hub.requests instead
            pass

        def do_GET(self) -> None:
            self._dispatch("GET")

        def do_POST(self) -> None:
            self._dispatch("POST")

        def do_PUT(self) -> None:
            self._dispatch("PUT")

        def _dispatch(self, method: str) -> None:
            path, _, query = self.path.partition("?")
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            for route_method, pattern, name in _ROUTES:
                match = pattern.match(path)
                if route_method == method and match:
                    break
            else:
                hub.requests.append((method, path, "unknown"))
                hub.auth_headers.append(("unknown", self.headers.get("Authorization", "")))
                return self._reply(404, {"error": f"test hub: no route for {method} {path}"})
            hub.requests.append((method, path, name))
            hub.auth_headers.append((name, self.headers.get("Authorization", "")))
            status = hub.fail.get(name) or hub.fail.get("*")
            if status:
                return self._reply(status, {"error": f"test hub: injected {status} on {name}"})
            try:
                status, payload = getattr(self, "_" + name)(body, query, **match.groupdict())
            except Exception as exc:  # a malformed request: say so, the client raises
                status, payload = 400, {"error": f"test hub: bad {name} request: {exc}"}
            self._reply(status, payload)

        def _reply(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status >= 400:
                self.send_header("X-Error-Message", payload.get("error", ""))
            self.end_headers()
            self.wfile.write(data)

        # ---- routes: each returns (status, JSON payload)

        def _create(self, body: bytes, query: str) -> tuple[int, dict]:
            request = json.loads(body)
            repo_id = f"{request['organization']}/{request['name']}"
            if repo_id in hub.repos:
                return 409, {"error": "You already created this model repo", "url": self._repo_url(repo_id)}
            hub.repos[repo_id] = {
                "private": request.get("visibility") == "private" or bool(request.get("private")),
                "branches": {"main"},
            }
            return 200, {"url": self._repo_url(repo_id)}

        def _repo_info(self, body: bytes, query: str, repo: str) -> tuple[int, dict]:
            if repo not in hub.repos:
                return 404, {"error": f"Repository {repo} not found"}
            return 200, {"id": repo, "private": hub.repos[repo]["private"], "sha": "0" * 40}

        def _branch(self, body: bytes, query: str, repo: str, rev: str) -> tuple[int, dict]:
            if repo not in hub.repos:
                return 404, {"error": f"Repository {repo} not found"}
            if rev in hub.repos[repo]["branches"]:
                return 409, {"error": f"Branch {rev} already exists"}
            hub.repos[repo]["branches"].add(rev)
            return 200, {}

        def _validate_yaml(self, body: bytes, query: str) -> tuple[int, dict]:
            content = json.loads(body)["content"]
            front = content.split("---\n")[1] if content.startswith("---\n") else ""
            try:
                yaml.safe_load(front)
            except yaml.YAMLError as exc:
                return 400, {"errors": [{"message": str(exc)}], "warnings": []}
            return 200, {"errors": [], "warnings": []}

        def _preupload(self, body: bytes, query: str, repo: str, rev: str) -> tuple[int, dict]:
            if repo not in hub.repos:
                return 404, {"error": f"Repository {repo} not found"}
            files = json.loads(body)["files"]
            return 200, {
                "files": [
                    {
                        "path": f["path"],
                        "shouldIgnore": False,
                        "uploadMode": "lfs" if f["size"] >= hub.lfs_threshold else "regular",
                    }
                    for f in files
                ]
            }

        def _lfs_batch(self, body: bytes, query: str, repo: str) -> tuple[int, dict]:
            request = json.loads(body)
            objects = []
            for obj in request["objects"]:
                entry = {"oid": obj["oid"], "size": obj["size"]}
                if obj["oid"] not in hub.lfs_objects:
                    entry["actions"] = {"upload": {"href": f"{self._base()}/lfs-upload/{obj['oid']}"}}
                objects.append(entry)
            return 200, {"transfer": "basic", "objects": objects}

        def _lfs_put(self, body: bytes, query: str, oid: str) -> tuple[int, dict]:
            if hashlib.sha256(body).hexdigest() != oid:
                return 400, {"error": f"sha256 of the body does not match {oid}"}
            hub.lfs_objects[oid] = body
            return 200, {}

        def _commit(self, body: bytes, query: str, repo: str, rev: str) -> tuple[int, dict]:
            if repo not in hub.repos:
                return 404, {"error": f"Repository {repo} not found"}
            lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
            header = next(line["value"] for line in lines if line["key"] == "header")
            create_pr = "create_pr=1" in query
            target = f"refs/pr/{len(hub.commits) + 1}" if create_pr else rev
            if not create_pr and rev not in hub.repos[repo]["branches"]:
                return 404, {"error": f"Revision {rev} not found"}
            files = dict(hub.files.get((repo, target), {}))
            for line in lines:
                value = line["value"]
                if line["key"] == "file":
                    assert value["encoding"] == "base64"
                    files[value["path"]] = base64.b64decode(value["content"])
                elif line["key"] == "lfsFile":
                    data = hub.lfs_objects.get(value["oid"])
                    if data is None or len(data) != value["size"]:
                        return 400, {"error": f"LFS object {value['oid']} of {value['path']} was not uploaded"}
                    files[value["path"]] = data
            hub.files[(repo, target)] = files
            hub.commits.append({**header, "repo": repo, "revision": target, "create_pr": create_pr})
            oid = uuid.uuid4().hex + "00000000"
            return 200, {
                "commitUrl": f"{self._repo_url(repo)}/commit/{oid}",
                "commitOid": oid,
                "pullRequestUrl": f"{self._repo_url(repo)}/discussions/{len(hub.commits)}" if create_pr else None,
            }

        def _base(self) -> str:
            return hub.url

        def _repo_url(self, repo_id: str) -> str:
            return f"{hub.url}/{repo_id}"

    return Handler


class SilentServer:
    """A server on 127.0.0.1 that accepts every connection, reads nothing and never answers.

    Bounded: it stops by itself after `lifetime` seconds (or at the `with` block's end), closing
    every connection it accepted. `connections` counts the accepted connections.
    """

    def __init__(self, lifetime: float = 60.0) -> None:
        import socket

        self.lifetime = lifetime
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)
        host, port = self._listener.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        self._accepted: list[Any] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        import time

        deadline = time.monotonic() + self.lifetime
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                connection, _ = self._listener.accept()
            except OSError:  # the 0.05 s accept timeout: check the stop flag and the deadline
                continue
            self.connections += 1
            self._accepted.append(connection)
        for connection in self._accepted:
            connection.close()
        self._listener.close()

    def __enter__(self) -> SilentServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
