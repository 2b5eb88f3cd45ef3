"""Errors in the OpenAI shape, with the status a client can act on (docs/ARCHITECTURE.md, decision 8)."""

from __future__ import annotations

from starlette.responses import JSONResponse


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        type_: str | None = None,
        retry_after: int | None = None,
        param: str | None = None,
        close: bool = False,
    ):
        """`close`: end the connection after the answer (a body left unread cannot be skipped)."""
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.type = type_ or _TYPES.get(status, "server_error")
        self.retry_after, self.close = retry_after, close

    def body(self) -> dict:
        """OpenAI's error shape (`retry_after` too, for an error sent inside a stream, where no header can go)."""
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}
        if self.close:
            headers["Connection"] = "close"
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "invalid_request_error",  # the body did not arrive in time: the client's side
    409: "invalid_request_error",  # a conflict with the model's state (model_busy): ask again later
    413: "invalid_request_error",
    503: "service_unavailable",
}


def bad_request(message: str, param: str | None = None, code: str = "invalid_request") -> APIError:
    return APIError(400, message, code, param=param)
