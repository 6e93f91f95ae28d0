"""Errors as the OpenAI API reports them: ``{"error": {"message", "type", "param", "code"}}``
with the HTTP status that says who is at fault (OpenAI's API reference, "Error codes").

Handlers raise :class:`APIError`; :mod:`exitlm.serve.app` turns it (and Starlette's own 404 /
405, and any unexpected exception) into that body. Bad input is a 400 naming the field in
``param``; the server never answers bad input with a 500.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An answer other than 200: status, message and the OpenAI error fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """The OpenAI error object."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400: the request cannot be served as it is."""
    return APIError(400, message, param=param, code=code)
