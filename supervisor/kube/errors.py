"""What can go wrong between gpuvisor and the API server, as three exceptions.

`ApiError` is a call that got no good answer: the API server refused it (its `Status` object
gives the code, reason and message), answered with something that is not a `Status` (a plain-text
`404 page not found` is how a real kube-apiserver says that a path, such as a CRD's, does not
exist at all), or never answered (status 0: connection refused, TLS, a timeout). `CredentialsError`
is a kubeconfig or service account that cannot be used, found before any call. `Stopped` ends a
call that a stop of the client cut short: no caller retries after it.
"""

from __future__ import annotations

NO_ANSWER = 0  # the status of an ApiError when no HTTP answer came


class KubeError(Exception):
    """Anything of the API-server layer."""


class CredentialsError(KubeError):
    """The credentials cannot be used: the text says which file or variable, and why."""


class Stopped(KubeError):
    """The client was stopped while (or before) this call ran."""


class ApiError(KubeError):
    """A call without a good answer. `status` is the HTTP code, or NO_ANSWER.

    `plain` is true when the answer was not the API server's JSON `Status` (its mux answers a path
    it does not serve with a plain-text 404): for a 404 that means the API itself, not the object,
    is missing. `retry_after` is the seconds a 429 or 5xx answer's `Retry-After` asked for (the
    client's limiter holds every request that long already), None without one.
    """

    def __init__(
        self,
        what: str,
        status: int,
        reason: str,
        message: str,
        *,
        plain: bool = False,
        retry_after: float | None = None,
    ) -> None:
        self.what = what
        self.status = status
        self.reason = reason
        self.message = message
        self.plain = plain
        self.retry_after = retry_after
        super().__init__(self.describe())

    def describe(self) -> str:
        if self.status == NO_ANSWER:
            return f"{self.what}: no answer from the API server: {self.message}"
        text = f"{self.what}: {self.status} {self.reason}"
        text += f": {self.message}" if self.message and self.message != self.reason else ""
        return text + (f" (retry after {self.retry_after:g}s)" if self.retry_after is not None else "")

    @property
    def not_found(self) -> bool:
        """The object does not exist (the API does: a JSON Status said NotFound)."""
        return self.status == 404 and not self.plain

    @property
    def no_such_api(self) -> bool:
        """The path is not served at all: an API group or CRD that is not installed."""
        return self.status == 404 and self.plain

    @property
    def gone(self) -> bool:
        """410: a resourceVersion older than the API server still keeps (watch again from a list)."""
        return self.status == 410

    @property
    def conflict(self) -> bool:
        return self.status == 409

    @property
    def forbidden(self) -> bool:
        return self.status == 403

    @property
    def kind(self) -> str:
        """A small, stable word for metrics and for "the same failure again" checks."""
        if self.status == NO_ANSWER:
            return "unreachable"
        if self.no_such_api:
            return "no-such-api"
        kinds = {401: "unauthorized", 403: "forbidden", 404: "not-found", 409: "conflict", 410: "gone"}
        kinds[429] = "throttled"
        return kinds.get(self.status, "server-error" if self.status >= 500 else f"http-{self.status}")
