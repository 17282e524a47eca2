"""Step: Plan once, Forward every layer, then commit (after the last layer or on end()) or
roll back (abort()).

The same class runs over unary RPCs (Client.step), a ForwardStream (ForwardStream.step) and a
channel (Client.step(..., channel=...)). As a context manager it commits on a clean exit and
aborts when the block raises, so an exception in the orchestrator never leaves half a step on
the server. Several forwards of one step may be in flight (forward_async); end()/abort() must
not race with them.
"""
import concurrent.futures
import threading
from typing import Any, NamedTuple

import grpc

from attnd import tensors
from attnd.errors import AttndError
from attnd.v1 import attnd_pb2 as pb


class ForwardResult(NamedTuple):
    """One layer's answer. o: [num_tokens, num_qo_heads, head_dim] (MLA: kv_lora_rank wide),
    lse: [num_tokens, num_qo_heads] float32 or None, both of the kind q was (numpy or torch on
    q's device). step_committed: this layer was the step's last and the step committed."""
    o: Any
    lse: Any
    step_committed: bool


def chain(source, convert):
    """A concurrent.futures.Future holding convert(source's result), or its AttndError."""
    target = concurrent.futures.Future()

    def done(future):
        try:
            target.set_result(convert(future.result()))
        except BaseException as error:  # handed to the caller through the future
            target.set_exception(error)

    source.add_done_callback(done)
    return target


class Step:
    """An open step. Made by Client.step / ForwardStream.step; see the module comment."""

    def __init__(self, transport, plan, config, channel=None, return_lse=False):
        self._transport = transport
        self.return_lse = return_lse
        self.plan = plan
        self.config = config
        self.channel = channel
        self._finished = threading.Event()
        self.outcome = None  # EndStepResponse once ended

    @property
    def id(self):
        return self.plan.step_id

    @property
    def num_tokens(self):
        return self.plan.num_tokens

    @property
    def entries(self):
        """Per plan entry: start_position (its length before the step) and row_offset."""
        return self.plan.entries

    @property
    def kernel(self):
        return self.plan.kernel

    @property
    def channel_sequence(self):
        return self.plan.channel_sequence

    @property
    def open(self):
        """True until a forward said the step committed, or end()/abort() ran."""
        return not self._finished.is_set()

    def request(self, layer, q=None, k=None, v=None, *, q_pe=None, ckv=None, kpe=None,
                use_channel=False):
        """The ForwardRequest of one layer; tensors are converted to the cache's q_dtype."""
        dtype = self.config.q_dtype or pb.DTYPE_BFLOAT16
        request = pb.ForwardRequest(step_id=self.id, layer=int(layer), use_channel=use_channel)
        for name, value in (("q", q), ("k", k), ("v", v), ("q_pe", q_pe), ("ckv", ckv),
                            ("kpe", kpe)):
            if value is not None:
                getattr(request, name).CopyFrom(tensors.to_proto(value, dtype))
        return request

    def forward(self, layer, q=None, k=None, v=None, *, q_pe=None, ckv=None, kpe=None,
                timeout=None):
        """Runs one layer. MHA/GQA: q [T, Hq, D], k and v [T, Hkv, D]. MLA: q is q_nope
        [T, H, kv_lora_rank] (absorbed), plus q_pe [T, H, rope_dim], ckv [T, kv_lora_rank],
        kpe [T, rope_dim]. numpy arrays or torch tensors (CPU or CUDA), any float dtype (sent
        as the cache's q_dtype). Raises AttndError."""
        return self.forward_async(layer, q, k, v, q_pe=q_pe, ckv=ckv, kpe=kpe).result(timeout)

    def forward_async(self, layer, q=None, k=None, v=None, *, q_pe=None, ckv=None, kpe=None):
        """Sends one layer without waiting; returns a future of its ForwardResult."""
        if self.channel is not None:
            return self.channel.submit(self, layer, q, k, v, q_pe=q_pe, ckv=ckv, kpe=kpe)
        reference = q if q is not None else ckv
        request = self.request(layer, q, k, v, q_pe=q_pe, ckv=ckv, kpe=kpe)
        return chain(self._transport.forward_async(request),
                     lambda response: self._result(response, reference))

    def forward_request_async(self, request):
        """Sends a prepared ForwardRequest (step_id is filled in); a future of the response."""
        request.step_id = self.id
        return chain(self._transport.forward_async(request), self._note_committed)

    def _note_committed(self, response):
        if response.step_committed:
            self._finished.set()
        return response

    def _result(self, response, reference):
        self._note_committed(response)
        lse = tensors.like(response.lse, reference) if response.HasField("lse") else None
        o = tensors.like(response.o, reference) if response.HasField("o") else None
        return ForwardResult(o, lse, response.step_committed)

    def end(self):
        """Commits now (layers not run keep unwritten slots). Returns the EndStepResponse
        (outcome COMMITTED, or ABORTED when the server had rolled the step back)."""
        return self._end(abort=False)

    def abort(self):
        """Rolls the step back: lengths restored, fresh pages freed."""
        return self._end(abort=True)

    def _end(self, abort):
        if not abort and self.channel is not None:
            # Stream-ordered channels (CUDA_IPC, NCCL) finish their enqueued signals first:
            # attnd refuses to commit a step whose layers it has not been handed.
            self.channel.before_commit()
        self.outcome = self._transport.end_step(self.id, abort)
        self._finished.set()
        return self.outcome

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, traceback):
        if exc_type is not None:
            if self.open or self.channel is not None:
                try:
                    self.abort()
                except AttndError:
                    pass  # the original exception matters more; the TTL rolls back anyway
            return False
        if self.open or self.channel is not None:
            # A channel step commits on the server after its last layer without telling the
            # client; EndStep then reports that outcome again.
            outcome = self.end()
            if outcome.outcome == pb.STEP_OUTCOME_ABORTED:
                raise AttndError(grpc.StatusCode.ABORTED, f"step {self.id} was aborted by the server "
                                 f"after {outcome.layers_run} layers", "EndStep")
        return False
