"""Errors a replica raises for bad input; each names what was wrong.

The HTTP edge maps them to OpenAI-format errors: ``status_code`` is the HTTP status
and ``error_type`` the OpenAI ``error.type``.
"""

from __future__ import annotations


class ServingError(Exception):
    """Base class of errors caused by a request or an adapter, not by the server.

    ``param``: the request field the error concerns, where one does (OpenAI's ``error.param``).
    """

    status_code: int = 400
    error_type: str = "invalid_request_error"
    code: str | None = None  # OpenAI's error.code, where one tells clients what to do

    def __init__(self, message: str = "", *, param: str | None = None):
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # keeps param across Ray's pickling of errors raised in actors
        return _rebuild, (type(self), str(self), self.param)


def _rebuild(cls: type, message: str, param: str | None) -> ServingError:
    return cls(message, param=param)


class InvalidRequestError(ServingError):
    """A request's parameters are invalid (e.g. a prompt longer than the maximum)."""


class CheckpointError(ServingError):
    """A base-model checkpoint is missing a file, has a wrong tensor, or is unsupported."""


class AdapterNotFoundError(ServingError):
    """A request or admin call names an adapter that is not registered."""

    status_code = 404
    error_type = "not_found_error"


class InvalidAdapterError(ServingError):
    """An adapter's files or config do not fit the base model or the server's limits."""


class AdapterSourceError(ServingError):
    """An adapter's source URL is not allowed, not reachable, or too large."""


class AdapterUnavailableError(ServingError):
    """A registered adapter cannot be loaded now (its storage unreachable or too slow, its files
    gone or changed since registration): the server's trouble, not the request's; retry."""

    status_code = 503
    error_type = "server_error"
    code = "adapter_unavailable"


class HostLostError(ServingError):
    """A multi-host replica lost one of its hosts (its process failed or went away): the
    replica cannot compute any more and is being replaced; retry."""

    status_code = 503
    error_type = "server_error"
    code = "host_lost"


class CapacityError(ServingError):
    """The server cannot take the request now (e.g. every adapter slot is pinned)."""

    status_code = 503
    error_type = "server_error"
