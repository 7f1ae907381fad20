"""A minimal JSON client for the apiserver, authenticated by the kubelet's kubeconfig."""

from __future__ import annotations

import json
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

Json = dict[str, Any]


class ApiError(RuntimeError):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"{status}: {body[:500]}")
        self.status = status


class Api:
    """get/create/patch/delete/watch on raw API paths; objects are plain dicts."""

    def __init__(self, kubeconfig: Path) -> None:
        cfg = yaml.safe_load(kubeconfig.read_text())
        cluster = cfg["clusters"][0]["cluster"]
        user = cfg["users"][0]["user"]
        self.server: str = cluster["server"]
        self.ca_file: str = cluster["certificate-authority"]
        tls = ssl.create_default_context(cafile=self.ca_file)
        tls.load_cert_chain(user["client-certificate"], user["client-key"])
        self._client = httpx.Client(base_url=self.server, verify=tls, timeout=httpx.Timeout(30.0))

    def _request(self, method: str, path: str, **kwargs: Any) -> Json:
        resp = self._client.request(method, path, **kwargs)
        if resp.status_code >= 400:
            raise ApiError(resp.status_code, resp.text)
        return resp.json() if resp.content else {}

    def get(self, path: str, **params: str) -> Json:
        return self._request("GET", path, params=params)

    def create(self, path: str, body: Json) -> Json:
        return self._request("POST", path, json=body)

    def update(self, path: str, body: Json) -> Json:
        return self._request("PUT", path, json=body)

    def patch(self, path: str, body: Json, kind: str = "strategic-merge-patch") -> Json:
        headers = {"Content-Type": f"application/{kind}+json"}
        return self._request("PATCH", path, content=json.dumps(body), headers=headers)

    def delete(self, path: str, body: Json | None = None) -> Json:
        return self._request("DELETE", path, json=body)

    def watch(self, path: str, resource_version: str, **params: str) -> Iterator[Json]:
        """Yield watch events until the server ends the stream."""
        query = {
            "watch": "1",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            **params,
        }
        with self._client.stream(
            "GET", path, params=query, timeout=httpx.Timeout(30.0, read=None)
        ) as resp:
            if resp.status_code >= 400:
                raise ApiError(resp.status_code, resp.read().decode(errors="replace"))
            for line in resp.iter_lines():
                if line:
                    yield json.loads(line)

    def close(self) -> None:
        self._client.close()
