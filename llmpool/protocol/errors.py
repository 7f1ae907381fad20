"""The OpenAI error shape, and a request body read as the JSON object it must be."""

from __future__ import annotations

import json
from typing import Any


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def parse_json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except UnicodeDecodeError:
        raise bad_request("the request body is not valid UTF-8") from None
    except ValueError as error:
        raise bad_request(f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise bad_request("the request body nests arrays and objects too deeply") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body
