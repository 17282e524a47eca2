"""AttndError: a failed call, carrying the gRPC status code and the server's message."""
import grpc

_CODES_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


class AttndError(Exception):
    """A call attnd (or the client, before sending) refused.

    `code` is a grpc.StatusCode (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, ...),
    `message` the server's text (it names the field, what was expected and what came) and
    `method` the RPC ("Plan", "ForwardStream/Forward", ...).
    """

    def __init__(self, code, message, method=""):
        if isinstance(code, int):
            code = _CODES_BY_VALUE.get(code, grpc.StatusCode.UNKNOWN)
        self.code = code
        self.message = message
        self.method = method
        prefix = f"{method}: " if method else ""
        super().__init__(f"{prefix}{code.name}: {message}")

    @classmethod
    def from_rpc_error(cls, error, method=""):
        """Converts a grpc.RpcError (a failed call) into an AttndError."""
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else str(error)
        return cls(code or grpc.StatusCode.UNKNOWN, details or "", method)


class StepAborted(AttndError):
    """A channel step's flags were set by an abort (TTL, EndStep abort, channel closed), so the
    slot's outputs are not meaningful."""

    def __init__(self, message, method=""):
        super().__init__(grpc.StatusCode.ABORTED, message, method)
