"""ForwardStream: Plan/Forward/EndStep as tagged messages on one bidirectional call, several in
flight (micro-batch pipelining: plan step N+1 and send its layers while step N's are answered).

Each message gets a fresh tag; the response with that tag resolves its future. At most
`window` messages wait for answers; sends block while the window is full. A per-message error
(StreamResponse.error) fails only that message, as an AttndError; the stream lives on. When the
call itself ends (server gone, cancel(), close()), every waiting message fails with the call's
status and later sends fail at once. Steps still open when the stream ends are aborted by the
server. Thread-safe; one reader thread per stream resolves the futures (callbacks run on it and
must not wait for other messages of the same stream).
"""
import concurrent.futures
import queue
import threading

import grpc

from attnd import config as cfg
from attnd.errors import AttndError
from attnd.step import Step, chain
from attnd.v1 import attnd_pb2 as pb

_METHOD_NAMES = {"plan": "Plan", "forward": "Forward", "end_step": "EndStep"}


class ForwardStream:
    def __init__(self, client, window=16):
        if window < 1:
            raise ValueError(f"window: expected >= 1, got {window}")
        self._client = client
        self._requests = queue.Queue()
        self._window = threading.Semaphore(window)
        self._lock = threading.Lock()
        self._pending = {}  # tag -> (future, method name)
        self._next_tag = 1
        self._failure = None  # AttndError once the call ended
        self._call = client.stub.ForwardStream(self._outgoing(), metadata=client.metadata)
        self._reader = threading.Thread(target=self._read, name="attnd-forward-stream",
                                        daemon=True)
        self._reader.start()

    # --- the call ----------------------------------------------------------------------------

    def _outgoing(self):
        while True:
            request = self._requests.get()
            if request is None:  # close(): half-close the call
                return
            yield request

    def _read(self):
        failure = AttndError(grpc.StatusCode.UNAVAILABLE, "the stream ended", "ForwardStream")
        try:
            for response in self._call:
                with self._lock:
                    entry = self._pending.pop(response.tag, None)
                if entry is None:
                    continue
                self._window.release()
                future, method = entry
                if response.HasField("error"):
                    future.set_exception(AttndError(response.error.code, response.error.message,
                                                    f"ForwardStream/{method}"))
                else:
                    future.set_result(response)
        except grpc.RpcError as error:
            failure = AttndError.from_rpc_error(error, "ForwardStream")
        finally:
            with self._lock:
                self._failure = failure
                pending, self._pending = self._pending, {}
            for future, _ in pending.values():
                self._window.release()
                future.set_exception(failure)

    def send_async(self, request):
        """Sends a StreamRequest (its tag is replaced); a future of the StreamResponse."""
        method = _METHOD_NAMES.get(request.WhichOneof("request"), "?")
        future = concurrent.futures.Future()
        while not self._window.acquire(timeout=0.1):
            if self._failure is not None:
                break
        with self._lock:
            if self._failure is not None:
                self._window.release()
                future.set_exception(AttndError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"the stream is closed ({self._failure})", f"ForwardStream/{method}"))
                return future
            request.tag = self._next_tag
            self._next_tag += 1
            self._pending[request.tag] = (future, method)
            self._requests.put(request)
        return future

    @property
    def in_flight(self):
        with self._lock:
            return len(self._pending)

    def close(self, grace=10.0):
        """Half-closes, waits up to `grace` seconds for the answers still due, then cancels the
        call if the server has not ended it. Idempotent."""
        self._requests.put(None)
        self._reader.join(grace)
        if self._reader.is_alive():
            self.cancel()
            self._reader.join(5.0)

    def cancel(self):
        """Ends the call at once, as a client that disappears would."""
        self._call.cancel()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    # --- typed messages ----------------------------------------------------------------------

    def plan_async(self, request):
        return chain(self.send_async(pb.StreamRequest(plan=request)), lambda r: r.plan)

    def forward_async(self, request):
        return chain(self.send_async(pb.StreamRequest(forward=request)), lambda r: r.forward)

    def end_step_async(self, step_id, abort=False):
        request = pb.StreamRequest(end_step=pb.EndStepRequest(step_id=step_id, abort=abort))
        return chain(self.send_async(request), lambda r: r.end_step)

    def end_step(self, step_id, abort=False):
        return self.end_step_async(step_id, abort).result()

    def step_async(self, cache, entries, options=None, channel=None, **option_fields):
        """Plans a batch on this stream without waiting; a future of the Step, whose forwards
        and end travel on this stream too."""
        config = self._client.cache_config(cache)
        request = cfg.plan_request(cache, entries, cfg.attention_options(options, **option_fields),
                                   channel)
        return chain(self.plan_async(request), lambda plan: Step(self, plan, config, channel,
                                                    request.options.return_lse))

    def step(self, cache, entries, options=None, channel=None, **option_fields):
        """Plans a batch on this stream and returns the open Step (see Client.step)."""
        return self.step_async(cache, entries, options, channel, **option_fields).result()
