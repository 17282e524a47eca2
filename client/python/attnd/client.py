"""Client: one gRPC channel to attnd and a typed call per RPC.

Mirrors the C++ client (client/include/attnd/client/client.h). Every call raises AttndError
(gRPC code + the server's message) on failure. Thread-safe: one Client may serve many threads,
steps and streams at once.
"""
import dataclasses
import os

import grpc

from attnd import config as cfg
from attnd.errors import AttndError
from attnd.step import Step
from attnd.v1 import attnd_pb2 as pb
from attnd.v1 import attnd_pb2_grpc as pb_grpc

READINESS_SERVICE = "attnd.v1.AttentionService"


@dataclasses.dataclass
class Tls:
    """TLS settings. PEM contents (bytes/str) or paths to PEM files; None root_certs = the
    system roots. cert_chain + private_key: mutual TLS. server_name_override: the name the
    server's certificate carries when the target's host is not it."""
    root_certs: object = None
    cert_chain: object = None
    private_key: object = None
    server_name_override: str = ""


def _pem(value):
    if value is None:
        return None
    if isinstance(value, bytes):
        return value
    if isinstance(value, str) and "-----BEGIN" in value:
        return value.encode()
    with open(os.fspath(value), "rb") as f:
        return f.read()


def _health_request(service):
    # grpc.health.v1.HealthCheckRequest{service} by hand: one length-delimited field 1. The
    # health stubs are not generated here: Debian has no grpcio-health-checking, and a second
    # copy of grpc/health/v1/health.proto in the process's descriptor pool would clash with it
    # where it is installed.
    data = service.encode()
    length, prefix = len(data), bytearray()
    while True:
        prefix.append((length & 0x7F) | (0x80 if length > 0x7F else 0))
        length >>= 7
        if not length:
            break
    return (b"\x0a" + bytes(prefix) + data) if data else b""


def _health_status(data):
    # HealthCheckResponse{status = 1 (enum)}: 0 UNKNOWN, 1 SERVING, 2 NOT_SERVING, 3 SERVICE_UNKNOWN.
    status, position = 0, 0
    while position < len(data):
        key = data[position]
        position += 1
        value, shift = 0, 0
        while True:
            byte = data[position]
            position += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        if key == 0x08:
            status = value
        elif key & 7 != 0:  # not a varint: this message has no such field
            break
    return ["UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"][status] if status < 4 else "UNKNOWN"


class Client:
    """A connection to attnd.

    target: "host:port" or any gRPC target ("unix:///run/attnd.sock").
    tls: False (plaintext), True (TLS with the system roots) or a Tls.
    token: sent as "authorization: Bearer <token>" on every AttentionService call.
    timeout: deadline of each unary RPC in seconds (None: none).
    max_message_bytes: largest message sent or received (attnd's default limit is 512 MiB).
    keepalive_seconds: ping period (attnd accepts pings every 10 s by default).
    """

    def __init__(self, target="localhost:50051", *, tls=False, token=None, timeout=30.0,
                 max_message_bytes=512 << 20, keepalive_seconds=30.0, options=()):
        self.target = target
        self.timeout = timeout
        self.token = token
        channel_options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.keepalive_time_ms", int(keepalive_seconds * 1000)),
            ("grpc.keepalive_timeout_ms", 10000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
        ]
        if tls:
            settings = tls if isinstance(tls, Tls) else Tls()
            credentials = grpc.ssl_channel_credentials(
                _pem(settings.root_certs), _pem(settings.private_key), _pem(settings.cert_chain))
            if settings.server_name_override:
                channel_options.append(("grpc.ssl_target_name_override",
                                        settings.server_name_override))
            self.channel = grpc.secure_channel(target, credentials, channel_options + list(options))
        else:
            self.channel = grpc.insecure_channel(target, channel_options + list(options))
        self.stub = pb_grpc.AttentionServiceStub(self.channel)
        self._health_check = self.channel.unary_unary(
            "/grpc.health.v1.Health/Check", request_serializer=None, response_deserializer=None)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._configs = {}  # cache name -> CacheConfig, for the wire dtype of tensors

    # --- plumbing ----------------------------------------------------------------------------

    def _call(self, method, request, timeout=None):
        try:
            return getattr(self.stub, method)(
                request, timeout=self.timeout if timeout is None else timeout,
                metadata=self.metadata)
        except grpc.RpcError as error:
            raise AttndError.from_rpc_error(error, method) from None

    def close(self):
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def wait_for_ready(self, timeout=10.0):
        """Waits until the channel connects; AttndError(UNAVAILABLE) after `timeout`."""
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise AttndError(grpc.StatusCode.UNAVAILABLE,
                             f"no connection to {self.target} within {timeout} s") from None

    def health(self, service="", timeout=None):
        """grpc.health.v1 Check: "SERVING", "NOT_SERVING", ... ("" = liveness,
        READINESS_SERVICE = readiness)."""
        try:
            data = self._health_check(_health_request(service),
                                      timeout=self.timeout if timeout is None else timeout)
        except grpc.RpcError as error:
            raise AttndError.from_rpc_error(error, "Health/Check") from None
        return _health_status(data)

    # --- server and caches -------------------------------------------------------------------

    def server_info(self):
        return self._call("GetServerInfo", pb.GetServerInfoRequest())

    def create_cache(self, name, config=None, device=None, **fields):
        """Creates a cache; `config` is a CacheConfig, or give its fields as keywords (see
        attnd.config.cache_config). `device`: the device ordinal to place it on (None: the least
        used; server_info().devices lists them). Returns the CacheInfo with every default
        resolved."""
        request = pb.CreateCacheRequest(name=name, config=cfg.cache_config(config, **fields))
        if device is not None:
            request.device = int(device)
        info = self._call("CreateCache", request).cache
        self._configs[name] = info.config
        return info

    def get_cache(self, name):
        info = self._call("GetCache", pb.GetCacheRequest(name=name)).cache
        self._configs[name] = info.config
        return info

    def list_caches(self):
        """CacheInfo of every cache this tenant sees, sorted by name."""
        return list(self._call("ListCaches", pb.ListCachesRequest()).caches)

    def delete_cache(self, name, force=False):
        self._call("DeleteCache", pb.DeleteCacheRequest(name=name, force=force))
        self._configs.pop(name, None)

    def free_sequences(self, cache, sequence_ids):
        """Frees managed sequences (all or nothing); returns the pages given back."""
        request = pb.FreeSequencesRequest(cache=cache, sequence_ids=[int(i) for i in sequence_ids])
        return self._call("FreeSequences", request).freed_pages

    # --- sequence lifecycle ------------------------------------------------------------------

    def fork_sequence(self, cache, source_id, new_id, num_tokens=0):
        """A new sequence sharing source_id's first num_tokens (0: all) by copy-on-write pages;
        returns ForkSequenceResponse (num_tokens, shared_pages)."""
        request = pb.ForkSequenceRequest(cache=cache, source_id=int(source_id), new_id=int(new_id),
                                         num_tokens=int(num_tokens))
        return self._call("ForkSequence", request)

    def export_sequence(self, cache, sequence_id, max_chunk_bytes=0):
        """Yields the ExportSequenceResponse messages of a sequence: the header, then chunks
        (each with its CRC-32). No deadline: long sequences take a while."""
        request = pb.ExportSequenceRequest(cache=cache, sequence_id=int(sequence_id),
                                           max_chunk_bytes=int(max_chunk_bytes))
        try:
            yield from self.stub.ExportSequence(request, metadata=self.metadata)
        except grpc.RpcError as error:
            raise AttndError.from_rpc_error(error, "ExportSequence") from None

    def import_sequence(self, cache, messages, sequence_id=0):
        """Imports an export's messages (any iterable, e.g. another client's export_sequence)
        into `cache` as `sequence_id` (0: the exported id). All or nothing: the sequence appears
        only when every chunk arrived intact. Returns ImportSequenceResponse."""
        def requests():
            first = True
            for message in messages:
                request = pb.ImportSequenceRequest()
                if first:
                    request.cache = cache
                    request.sequence_id = int(sequence_id)
                    first = False
                if message.HasField("header"):
                    request.header.CopyFrom(message.header)
                else:
                    request.chunk.CopyFrom(message.chunk)
                yield request
        try:
            return self.stub.ImportSequence(requests(), metadata=self.metadata)
        except grpc.RpcError as error:
            raise AttndError.from_rpc_error(error, "ImportSequence") from None

    def stats(self):
        return self._call("GetStats", pb.GetStatsRequest())

    def cache_config(self, name):
        """The cache's config, fetched once and remembered."""
        if name not in self._configs:
            self.get_cache(name)
        return self._configs[name]

    # --- steps -------------------------------------------------------------------------------

    def plan(self, request):
        return self._call("Plan", request)

    def forward(self, request):
        return self._call("Forward", request)

    def forward_async(self, request):
        """A grpc future of one Forward; its exception is an AttndError."""
        return _UnaryFuture(self.stub.Forward.future(request, timeout=self.timeout,
                                                      metadata=self.metadata), "Forward")

    def end_step(self, step_id, abort=False):
        return self._call("EndStep", pb.EndStepRequest(step_id=step_id, abort=abort))

    def step(self, cache, entries, options=None, channel=None, **option_fields):
        """Plans a batch and returns the open Step (a context manager: commits on exit, aborts
        on an exception). entries: (sequence_id, num_new_tokens) pairs, dicts (EXTERNAL caches:
        with page_ids / v_page_ids / kv_len) or PlanEntry. options: AttentionOptions or its
        fields as keywords (causal, sm_scale, return_lse, ...). channel: a Channel of this
        cache to carry the layers' tensors (see Channel)."""
        request = cfg.plan_request(cache, entries, cfg.attention_options(options, **option_fields),
                                   channel)
        plan = self.plan(request)
        return Step(self, plan, self.cache_config(cache), channel, request.options.return_lse)

    def stream(self, window=16):
        """Opens a ForwardStream (several steps and layers in flight on one call)."""
        from attnd.stream import ForwardStream
        return ForwardStream(self, window)

    # --- channels ----------------------------------------------------------------------------

    def open_channel(self, cache, kind="host_shm", max_tokens=256, slots=2, with_lse=False,
                     timeout=None, **kwargs):
        """Opens a channel on `cache`: "host_shm" (numpy views of a shared-memory ring) or
        "cuda_ipc" (torch CUDA tensors aliasing a ring in attnd's GPU memory). The channel lives
        while the returned object is open (close() or the with-block's end closes it).

        cuda_ipc: `device=` (a torch device) maps the ring on another GPU than attnd's; its PCI
        bus id goes to attnd as client_pci_bus_id, so an unreachable GPU is refused at once
        (FAILED_PRECONDITION). `client_pci_bus_id=` sends a bus id of the caller's choosing.

        nccl (attnd.nccl): for a caller on another host or on a GPU that cannot map attnd's:
        joins attnd's 2-rank NCCL communicator from `device=` (a torch CUDA device other than
        attnd's GPU; libnccl.so.2 >= 2.14), and each layer is sent and received on the device's
        current torch stream."""
        from attnd import channel as channels
        return channels.open_channel(self, cache, kind, max_tokens, slots, with_lse,
                                     self.timeout if timeout is None else timeout, **kwargs)

    def close_channel(self, channel_id):
        self._call("CloseChannel", pb.CloseChannelRequest(channel_id=int(channel_id)))


class _UnaryFuture:
    """Adapts a grpc future so that result() raises AttndError and callbacks see it too."""

    def __init__(self, future, method):
        self._future = future
        self._method = method

    def result(self, timeout=None):
        try:
            return self._future.result(timeout)
        except grpc.RpcError as error:
            raise AttndError.from_rpc_error(error, self._method) from None

    def add_done_callback(self, callback):
        self._future.add_done_callback(lambda _: callback(self))

    def done(self):
        return self._future.done()

    def cancel(self):
        return self._future.cancel()
