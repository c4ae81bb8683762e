"""FLARE's tensor streamers (`--stream-tensors`) with a rendezvous that waits for a busy peer.

FLARE streams a model's tensors ahead of the task message that refers to them; the receiving side
(the site for the global model, the server for a site's update) then waits for the last tensor to
be consumed before it hands the task on. FLARE 2.9 waits 5 seconds there and then raises a fatal
system error, which aborts the whole job. On a loaded machine (sites compiling JAX programs on
the same cores) consuming the last chunk can take longer than that, so a job that would have
finished stopped after its first round. These subclasses wait up to `TENSOR_WAIT_S` instead
(a peer that never sends still fails, only later). jax-free: the FLARE server imports it.
"""

from __future__ import annotations

import functools

# optional dependency (NVFLARE): this module is imported only for --stream-tensors
from nvflare.app_opt.tensor_stream.client import TensorClientStreamer
from nvflare.app_opt.tensor_stream.server import TensorServerStreamer

TENSOR_WAIT_S = 120.0  # FLARE's own: 5 s


class _PatientRendezvous:
    """Gives the streamer's receiver (built by FLARE at START_RUN) the longer wait."""

    tensor_wait_s = TENSOR_WAIT_S

    def initialize(self, fl_ctx):
        super().initialize(fl_ctx)
        receiver = getattr(self, "receiver", None)  # None: FLARE's initialize failed and said why
        if receiver is not None:
            receiver.wait_for_tensors = functools.partial(receiver.wait_for_tensors, timeout=self.tensor_wait_s)


class PatientTensorServerStreamer(_PatientRendezvous, TensorServerStreamer):
    """The server's streamer: waits for each site's update."""


class PatientTensorClientStreamer(_PatientRendezvous, TensorClientStreamer):
    """A site's streamer: waits for the global model."""
