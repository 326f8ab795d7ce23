"""A small, real HTTP server that speaks the part of the Kubernetes API the scaler uses.

The official ``kubernetes`` client talks to it over TCP exactly as it would to an API server, so
the tests see the requests the client really sends (path, verb, ``Content-Type``, JSON body)
rather than a mock's idea of them. Endpoints:

- ``GET   /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale`` — an ``autoscaling/v1`` Scale;
- ``PATCH`` on the same path — a merge patch of the Scale (only ``spec.replicas`` matters);
- ``PATCH /api/v1/namespaces/{ns}/pods/{name}`` — a merge patch of the Pod (annotations…);
- ``DELETE /api/v1/namespaces/{ns}/pods/{name}`` — removes the pod and answers it, with its
  ``deletionTimestamp`` set, as the API does for a graceful delete.

Unknown objects and routes get a ``404`` ``Status`` body like the real one. Both dict-body patch
types the client may send (``application/merge-patch+json`` and
``application/strategic-merge-patch+json``) are applied as an RFC 7386 merge, which is what a
strategic merge amounts to for these objects (no lists are patched); a JSON Patch (a list of
operations) is answered ``415``. :meth:`FakeKubernetesApi.fail` injects an error status for the
next matching request(s). Every request is recorded, thread-safely, in arrival order.

There is no controller behind the API: patching a scale changes the number, it creates or removes
no pod. Tests add the pods they need with :meth:`FakeKubernetesApi.add_pod`.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

SCALE_PATH = re.compile(
    r"^/apis/apps/v1/namespaces/(?P<ns>[^/]+)/deployments/(?P<name>[^/]+)/scale$"
)
POD_PATH = re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/pods/(?P<name>[^/]+)$")
MERGE_PATCH_TYPES = frozenset(
    {"application/merge-patch+json", "application/strategic-merge-patch+json"}
)

Json = dict[str, Any]


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    """One request as the server received it."""

    method: str
    path: str
    body: Any  # the parsed JSON body, None when there was none
    content_type: str | None
    query: str = ""
    authorization: str | None = None

    @property
    def shape(self) -> tuple[str, str, Any]:
        """``(method, path, body)``: what the tests compare."""
        return (self.method, self.path, self.body)


@dataclass(slots=True)
class _Failure:
    method: str
    path: str
    status: int
    message: str
    times: int


@dataclass(slots=True)
class _State:
    deployments: dict[tuple[str, str], Json] = field(default_factory=dict)
    pods: dict[tuple[str, str], Json] = field(default_factory=dict)
    requests: list[RecordedRequest] = field(default_factory=list)
    failures: list[_Failure] = field(default_factory=list)
    resource_version: int = 1000


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: objects merge key by key, ``null`` deletes, the rest replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def status_body(code: int, reason: str, message: str, details: Json | None = None) -> Json:
    """A ``v1`` ``Status`` object, the body of every API error."""
    body: Json = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details is not None:
        body["details"] = details
    return body


STATUS_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    409: "Conflict",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
}


class _ApiError(Exception):
    def __init__(self, code: int, message: str, details: Json | None = None) -> None:
        super().__init__(message)
        self.body = status_body(code, STATUS_REASONS.get(code, "Unknown"), message, details)
        self.code = code


class FakeKubernetesApi:
    """In-memory deployments and pods behind a real HTTP server on ``127.0.0.1``."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._state = _State()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> FakeKubernetesApi:
        fake = self

        class Handler(_Handler):
            api = fake

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="fake-k8s-api",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = self._thread = None

    @property
    def url(self) -> str:
        assert self._server is not None, "the fake API is not started"
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    # -- state ------------------------------------------------------------------------------
    def add_deployment(self, name: str, replicas: int = 1, *, namespace: str = "default") -> None:
        with self._lock:
            self._state.deployments[(namespace, name)] = {
                "uid": str(uuid.uuid4()),
                "created": _now(),
                "replicas": replicas,
                "resourceVersion": self._next_version(),
            }

    def add_pod(
        self,
        name: str,
        *,
        deployment: str | None = None,
        namespace: str = "default",
        annotations: dict[str, str] | None = None,
    ) -> None:
        labels = {"app": deployment} if deployment else {}
        with self._lock:
            self._state.pods[(namespace, name)] = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": name,
                    "namespace": namespace,
                    "uid": str(uuid.uuid4()),
                    "resourceVersion": self._next_version(),
                    "creationTimestamp": _now(),
                    "labels": labels,
                    "annotations": dict(annotations or {}),
                },
                "spec": {"containers": [{"name": "agent", "image": "agent:test"}]},
                "status": {"phase": "Running"},
            }

    def replicas(self, deployment: str, *, namespace: str = "default") -> int:
        with self._lock:
            return int(self._state.deployments[(namespace, deployment)]["replicas"])

    def pod_annotations(self, pod: str, *, namespace: str = "default") -> dict[str, str]:
        with self._lock:
            return dict(self._state.pods[(namespace, pod)]["metadata"].get("annotations") or {})

    def has_pod(self, pod: str, *, namespace: str = "default") -> bool:
        with self._lock:
            return (namespace, pod) in self._state.pods

    def fail(
        self, method: str, path: str, status: int, message: str = "", *, times: int = 1
    ) -> None:
        """Answer the next ``times`` requests ``method path`` with ``status`` and a Status body."""
        text = message or f"injected {status} by the fake API"
        with self._lock:
            self._state.failures.append(_Failure(method.upper(), path, status, text, times))

    # -- recorded requests ------------------------------------------------------------------
    @property
    def requests(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._state.requests)

    def requests_matching(
        self, method: str | None = None, path: str | re.Pattern[str] | None = None
    ) -> list[RecordedRequest]:
        def matches(r: RecordedRequest) -> bool:
            if method is not None and r.method != method:
                return False
            if isinstance(path, re.Pattern):
                return path.search(r.path) is not None
            return path is None or r.path == path

        return [r for r in self.requests if matches(r)]

    def clear_requests(self) -> None:
        with self._lock:
            self._state.requests.clear()

    def wait_for(
        self, predicate: Callable[[list[RecordedRequest]], bool], timeout_s: float = 10.0
    ) -> list[RecordedRequest]:
        """Block until ``predicate(requests)`` holds; fail after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while not predicate(list(self._state.requests)):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"fake Kubernetes API: condition not met after {timeout_s} s; "
                        f"requests: {[r.shape for r in self._state.requests]}"
                    )
                self._lock.wait(left)
            return list(self._state.requests)

    # -- request handling (called from the server's threads) --------------------------------
    def handle(self, request: RecordedRequest) -> tuple[int, Json]:
        with self._lock:
            self._state.requests.append(request)
            self._lock.notify_all()
            try:
                self._raise_injected(request)
                return self._route(request)
            except _ApiError as exc:
                return exc.code, exc.body

    def _raise_injected(self, request: RecordedRequest) -> None:
        for failure in self._state.failures:
            if failure.times > 0 and (failure.method, failure.path) == (
                request.method,
                request.path,
            ):
                failure.times -= 1
                raise _ApiError(failure.status, failure.message)

    def _route(self, request: RecordedRequest) -> tuple[int, Json]:
        if match := SCALE_PATH.match(request.path):
            key = (match["ns"], match["name"])
            if request.method == "GET":
                return 200, self._scale(key)
            if request.method == "PATCH":
                return 200, self._patch_scale(key, request)
            raise _ApiError(405, f"the fake API does not implement {request.method} on scale")
        if match := POD_PATH.match(request.path):
            key = (match["ns"], match["name"])
            if request.method == "PATCH":
                return 200, self._patch_pod(key, request)
            if request.method == "DELETE":
                return 200, self._delete_pod(key)
            raise _ApiError(405, f"the fake API does not implement {request.method} on pods")
        raise _ApiError(404, "the server could not find the requested resource")

    def _scale(self, key: tuple[str, str]) -> Json:
        deployment = self._deployment(key)
        namespace, name = key
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": deployment["uid"],
                "resourceVersion": deployment["resourceVersion"],
                "creationTimestamp": deployment["created"],
            },
            "spec": {"replicas": deployment["replicas"]},
            "status": {"replicas": deployment["replicas"], "selector": f"app={name}"},
        }

    def _patch_scale(self, key: tuple[str, str], request: RecordedRequest) -> Json:
        deployment = self._deployment(key)
        patched = merge_patch(self._scale(key), self._merge_body(request))
        replicas = (patched.get("spec") or {}).get("replicas", 0)
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise _ApiError(
                422,
                f'Scale.autoscaling "{key[1]}" is invalid: spec.replicas: '
                f"Invalid value: {replicas!r}: must be greater than or equal to 0",
            )
        deployment["replicas"] = replicas
        deployment["resourceVersion"] = self._next_version()
        return self._scale(key)

    def _patch_pod(self, key: tuple[str, str], request: RecordedRequest) -> Json:
        pod = self._pod(key)
        patched = merge_patch(pod, self._merge_body(request))
        patched["metadata"]["resourceVersion"] = self._next_version()
        self._state.pods[key] = patched
        return copy.deepcopy(patched)

    def _delete_pod(self, key: tuple[str, str]) -> Json:
        pod = self._pod(key)
        del self._state.pods[key]
        pod["metadata"]["deletionTimestamp"] = _now()
        pod["metadata"]["deletionGracePeriodSeconds"] = 30
        return pod

    def _merge_body(self, request: RecordedRequest) -> Any:
        content_type = (request.content_type or "").split(";")[0].strip()
        if content_type not in MERGE_PATCH_TYPES:
            raise _ApiError(
                415,
                f"the fake API applies only merge patches, not {content_type or 'no type'}",
            )
        if not isinstance(request.body, dict):
            raise _ApiError(400, "a merge patch must be a JSON object")
        return request.body

    def _deployment(self, key: tuple[str, str]) -> Json:
        found = self._state.deployments.get(key)
        if found is None:
            raise _ApiError(
                404,
                f'deployments.apps "{key[1]}" not found',
                {"name": key[1], "group": "apps", "kind": "deployments"},
            )
        return found

    def _pod(self, key: tuple[str, str]) -> Json:
        found = self._state.pods.get(key)
        if found is None:
            raise _ApiError(404, f'pods "{key[1]}" not found', {"name": key[1], "kind": "pods"})
        return found

    def _next_version(self) -> str:
        self._state.resource_version += 1
        return str(self._state.resource_version)


class _Handler(BaseHTTPRequestHandler):
    api: FakeKubernetesApi
    protocol_version = "HTTP/1.1"  # keep-alive, as urllib3 expects of an API server

    def do_GET(self) -> None:
        self._serve()

    def do_PATCH(self) -> None:
        self._serve()

    def do_DELETE(self) -> None:
        self._serve()

    def do_POST(self) -> None:
        self._serve()

    def do_PUT(self) -> None:
        self._serve()

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        url = urlsplit(self.path)
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            self._answer(400, status_body(400, "BadRequest", "the request body is not JSON"))
            return
        request = RecordedRequest(
            method=self.command,
            path=url.path,
            body=body,
            content_type=self.headers.get("Content-Type"),
            query=url.query,
            authorization=self.headers.get("Authorization"),
        )
        code, payload = self.api.handle(request)
        self._answer(code, payload)

    def _answer(self, code: int, payload: Json) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # the tests assert, not read logs
        pass
