"""The Kubernetes client shared by the agent and the extender: credentials, REST calls,
the one mapping from HTTP failures to our `KubeError` family, and list + watch.

The official client is used thinly (ApiClient for auth, TLS and pooling; raw REST
paths for our few requests), so no generated model is built per request and library
errors become our own types right here. A kubeconfig and a pod's service account
(`kube/incluster.py`, the official in-cluster loader with its token re-read) give the
same ApiClient. This module and `kube/incluster.py` are the only importers of
`kubernetes`, and only once credentials are found.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from loguru import logger

from gpudaemon.errors import (
    ConfigError,
    KubeError,
    KubeForbiddenError,
    KubeInvalidError,
    KubeNotFoundError,
    KubeUnavailableError,
)
from gpudaemon.kube.failures import describe_failure, error_for
from gpudaemon.kube.jsondepth import loads

FIELD_MANAGER = "gpudaemon"
APPLY_PATCH = "application/apply-patch+yaml"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
# Connect fails fast (a dead server refuses at once; a black-holed one should not hold
# a job for long); the read timeout comes from the config.
CONNECT_TIMEOUT_S = 3.0
# force: keys under our prefix are ours; take them back from a hand edit.
APPLY_QUERY = {"fieldManager": FIELD_MANAGER, "force": "true"}
MANAGER_QUERY = {"fieldManager": FIELD_MANAGER}
LIST_PAGE = 500  # client-go's pager default
# kube-apiserver refuses a request body over 3 MiB (its MaxRequestBodyBytes) with a 413,
# often before reading it, so the client sees a broken pipe: refuse it here, one line.
MAX_BODY_BYTES = 3 << 20

# On every agent's node Lease: `gpudaemon status` finds them by it in whatever namespace
# the chart was installed, with one list call the API server filters.
NODE_LEASE_LABELS = {
    "app.kubernetes.io/name": "gpudaemon",
    "app.kubernetes.io/component": "node-lease",
}
NODE_LEASE_SELECTOR = ",".join(f"{k}={v}" for k, v in NODE_LEASE_LABELS.items())


@dataclass(frozen=True)
class Credentials:
    in_cluster: bool
    kubeconfig: str = ""


def find_credentials(kubeconfig: str = "", in_cluster: bool = False) -> Credentials | None:
    """A kubeconfig file when one is named, else the in-cluster service account when
    running in a cluster, else None. config.py resolves both from the environment
    (`kubernetes.kubeconfig`, `kubernetes.in_cluster`): a kubeconfig found there
    exists, so one that does not was named by the user (the file, GPUDAEMON_*, a
    `--kubeconfig` flag), who asked for it: a ConfigError (exit 2), never a fallback."""
    if kubeconfig:
        if not os.path.exists(kubeconfig):
            raise ConfigError(
                f"kubernetes.kubeconfig {kubeconfig}: no such file (named by --kubeconfig, "
                "the config file or GPUDAEMON_KUBERNETES__KUBECONFIG)"
            )
        return Credentials(in_cluster=False, kubeconfig=kubeconfig)
    if in_cluster:
        return Credentials(in_cluster=True)
    return None


class KubeClient:
    """REST calls over the official client's ApiClient (auth, TLS, pooling).

    Retries are off in urllib3: our own backoff decides when to try again, so a dead
    server costs one connect timeout per attempt, not four.
    """

    def __init__(
        self,
        api_client: Any,
        timeout_s: float,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        ca_source: str = "the kubeconfig's CA",
    ) -> None:
        self.api = api_client
        self.connect_timeout_s = connect_timeout_s
        self.timeout = (connect_timeout_s, timeout_s)
        self.ca_source = ca_source
        conf = getattr(api_client, "configuration", None)
        self.server = str(getattr(api_client, "server", "") or getattr(conf, "host", "") or "")

    @classmethod
    def from_credentials(
        cls,
        creds: Credentials,
        timeout_s: float = 10.0,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
    ) -> KubeClient:
        from gpudaemon import lazyimport

        lazyimport.install()  # kubernetes/__init__ would load watch, stream, dynamic...
        from kubernetes import client, config

        if creds.in_cluster:
            from gpudaemon.kube.incluster import in_cluster_configuration

            conf = in_cluster_configuration()
            ca = "the service account's CA"
            return cls(client.ApiClient(conf), timeout_s, connect_timeout_s, ca)
        conf = client.Configuration()
        try:
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=creds.kubeconfig,
                client_configuration=conf,
                persist_config=False,
            )
        except Exception as e:  # ConfigException, YAML, OS, key errors: all one line
            where = f"kubeconfig {creds.kubeconfig}"
            raise ConfigError(f"{where}: {' '.join(str(e).split())}") from None
        conf.retries = False
        if not conf.verify_ssl:
            _insecure_once(creds.kubeconfig, conf.host)
        return cls(client.ApiClient(conf), timeout_s, connect_timeout_s)

    # -- plain requests ------------------------------------------------------------

    def _open(
        self,
        method: str,
        path: str,
        body: Any,
        content_type: str | None,
        query: Mapping[str, str] | None,
        timeout: tuple[float, float],
    ) -> Any:
        """Send one request; the response body is not read yet (watch streams it)."""
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        _check_size(method, path, body)
        try:
            _m, url, hdrs, body_, _p = self.api.param_serialize(
                method,
                path,
                query_params=list((query or {}).items()),
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
            )
            return self.api.call_api(method, url, hdrs, body_, _request_timeout=timeout)
        except KubeError:
            raise
        except Exception as e:  # the client library's and the socket's: one line, ours
            raise self.failure(method, path, e) from None

    def failure(self, method: str, path: str, e: BaseException) -> KubeError:
        """A failure below HTTP as a KubeUnavailableError (worth retrying: a CA
        rotated, a server back) naming the server, the request and what failed."""
        where = f"{method} {self.server}{path}"
        return KubeUnavailableError(f"{where}: {describe_failure(e, self.ca_source)}")

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str | None = None,
        query: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """One call; the JSON answer, or a KubeError naming method, path and reason.
        `timeout_s` overrides the read timeout (a call on a request path)."""
        import urllib3

        timeout = self.timeout if timeout_s is None else (self.timeout[0], timeout_s)
        resp = self._open(method, path, body, content_type, query, timeout)
        try:
            data = resp.read()
        except (urllib3.exceptions.HTTPError, OSError, http.client.HTTPException) as e:
            raise self.failure(method, path, e) from None
        if not 200 <= resp.status < 300:
            raise error_for(resp.status, method, path, data)
        try:
            out = loads(data, f"{method} {path}") if data else {}
        except ValueError:
            raise KubeUnavailableError(f"{method} {path}: response is not JSON") from None
        return out if isinstance(out, dict) else {}

    def apply(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply as our field manager."""
        return self.request("PATCH", path, dict(body), APPLY_PATCH, APPLY_QUERY)

    def get_node(self, name: str, cached: bool = False) -> dict[str, Any]:
        """The Node; `cached` reads the API server's watch cache (resourceVersion=0, no
        etcd read: what kubelet does every 10 s), for cheap checks such as its UID."""
        query = {"resourceVersion": "0"} if cached else None
        return self.request("GET", f"/api/v1/nodes/{name}", query=query)

    def apply_node(self, name: str, labels: Mapping[str, str], ann: Mapping[str, str]) -> Any:
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": dict(labels), "annotations": dict(ann)},
        }
        try:
            return self.apply(f"/api/v1/nodes/{name}", body)
        except KubeForbiddenError as e:
            # Server-side apply to a missing Node is a create, which this identity may
            # not do: the API server answers 403, but the cause is the missing Node.
            if 'cannot create resource "nodes"' not in str(e):
                raise
            raise KubeNotFoundError(
                f'PATCH /api/v1/nodes/{name}: nodes "{name}" not found (server-side apply '
                "would create it, which this identity may not)",
                404,
            ) from None

    def patch_node(self, name: str, patch: Mapping[str, Any], status: bool = False) -> Any:
        """A strategic-merge patch of the Node (or its status subresource): for the
        lists server-side apply would take over whole (taints merge by key, conditions
        by type), so only our own entry is touched."""
        path = f"/api/v1/nodes/{name}" + ("/status" if status else "")
        return self.request("PATCH", path, dict(patch), STRATEGIC_MERGE_PATCH, MANAGER_QUERY)

    def json_patch_node(self, name: str, ops: list[dict[str, Any]]) -> Any:
        """A JSON patch of the Node: with a `test` of the resourceVersion first, a list
        (taints) is replaced only if nobody changed the Node since we read it."""
        return self.request("PATCH", f"/api/v1/nodes/{name}", ops, JSON_PATCH, MANAGER_QUERY)

    def apply_lease(
        self,
        namespace: str,
        name: str,
        spec: Mapping[str, Any],
        owner: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "name": name,
            "namespace": namespace,
            "labels": dict(NODE_LEASE_LABELS),
        }
        if owner:
            meta["ownerReferences"] = [dict(owner)]
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": meta,
            "spec": dict(spec),
        }
        return self.apply(
            f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}", body
        )

    # -- list + watch ---------------------------------------------------------------

    def list_items(
        self,
        path: str,
        query: Mapping[str, str] | None = None,
        page_size: int = LIST_PAGE,
        transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> tuple[list[dict[str, Any]], str]:
        """A collection's items and its resourceVersion, the point to watch from. Listed
        in pages of `page_size`, as client-go's pager does: one request for 5,000 Nodes
        would hold the API server's memory and a long response at once. The pages form
        one consistent snapshot; an expired continue token is a 410 (KubeGoneError),
        which the reflector answers by listing again.

        `transform` (client-go's TransformFunc) turns each item into what the caller
        keeps as its page arrives, so only one raw page is held at a time: memory is
        bounded by what we keep and the page size, not by what tenants wrote."""
        items: list[dict[str, Any]] = []
        version = ""
        for page, page_version in self.pages(path, query, page_size):
            items += page if transform is None else map(transform, page)
            version = page_version
            del page  # the raw page goes before the next one is read
        return items, version

    def pages(
        self, path: str, query: Mapping[str, str] | None = None, page_size: int = LIST_PAGE
    ) -> Iterator[tuple[list[dict[str, Any]], str]]:
        """(items, resourceVersion) page by page, for a reader that need not hold the
        whole collection (a cluster's pods) at once."""
        base = dict(query or {})
        if page_size > 0:
            base["limit"] = str(page_size)
        cont = ""
        while True:
            q = {**base, "continue": cont} if cont else base
            out = self.request("GET", path, query=q)
            meta = out.get("metadata") or {}
            items = [i for i in out.get("items") or [] if isinstance(i, dict)]
            version, cont = str(meta.get("resourceVersion") or ""), str(meta.get("continue") or "")
            del out, meta  # not held while the caller reads the page and asks the next
            yield items, version
            del items
            if not cont:
                return

    def watch(
        self,
        path: str,
        resource_version: str,
        timeout_s: float = 300.0,
        query: Mapping[str, str] | None = None,
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Stream (type, object) events (ADDED, MODIFIED, DELETED, BOOKMARK) after
        `resource_version` until the server ends the watch (after about `timeout_s`).

        Raises KubeGoneError when the version is too old (410, as a status or as an
        ERROR event): the caller lists again and watches from the new version. Other
        failures raise the usual KubeError types.
        """
        import urllib3

        q = {
            **(query or {}),
            "watch": "true",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(max(1, int(timeout_s))),
        }
        # The server closes the stream after timeoutSeconds; the read timeout only
        # catches a server that went silent.
        read_timeout = max(1.0, timeout_s) + self.timeout[1]
        resp = self._open("GET", path, None, None, q, (self.connect_timeout_s, read_timeout))
        try:
            if not 200 <= resp.status < 300:
                raise error_for(resp.status, "WATCH", path, resp.read())
            for line in _lines(resp.response.stream(65536)):
                try:
                    event = loads(line, f"WATCH {path}")
                except ValueError:
                    raise KubeUnavailableError(f"WATCH {path}: event is not JSON") from None
                kind, obj = str(event.get("type", "")), event.get("object") or {}
                if kind == "ERROR":
                    code = obj.get("code") if isinstance(obj, dict) else None
                    status = code if isinstance(code, int) else None
                    raise error_for(status, "WATCH", path, json.dumps(obj))
                if isinstance(obj, dict):
                    yield kind, obj
        except (urllib3.exceptions.HTTPError, OSError, http.client.HTTPException) as e:
            raise self.failure("WATCH", path, e) from None
        finally:
            resp.response.release_conn()

    def close(self) -> None:
        self.api.close()


def _check_size(method: str, path: str, body: Any) -> None:
    """A request body the API server would refuse for its size, refused here instead."""
    if body is None:
        return
    size = len(body) if isinstance(body, bytes | str) else len(json.dumps(body))
    if size > MAX_BODY_BYTES:
        raise KubeInvalidError(
            f"{method} {path}: request body of {size} bytes is over the API server's "
            f"{MAX_BODY_BYTES} byte limit",
            413,
        )


_insecure_lock = threading.Lock()
_insecure_warned = False


def _insecure_once(kubeconfig: str, host: str) -> None:
    """`insecure-skip-tls-verify`: one WARNING for the process, not urllib3's warning
    block on every request (only that warning is silenced, and only in this case)."""
    global _insecure_warned
    import warnings

    import urllib3

    with _insecure_lock:
        warnings.filterwarnings("ignore", category=urllib3.exceptions.InsecureRequestWarning)
        if _insecure_warned:
            return
        _insecure_warned = True
    logger.warning(
        "kubeconfig {}: insecure-skip-tls-verify is set: the certificate of {} is not "
        "checked, so anyone on the path can read and change this traffic",
        kubeconfig,
        host,
    )


def _lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """Newline-delimited JSON from a chunked stream; an event may span chunks."""
    buf = b""
    for chunk in chunks:
        buf += chunk
        *complete, buf = buf.split(b"\n")
        yield from (line for line in complete if line.strip())
    if buf.strip():
        yield buf
