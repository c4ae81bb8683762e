"""Faults injected into FLARE's tensor streaming, for tests/federated/test_simulator.py: this
folder goes first on PYTHONPATH of a federated job (the server and every site's process), and
NVFP4_JAX_TEST_TENSOR_FAULT picks the fault.

- `late`: each streamed model's tensors are handed over 6 s after they arrived, as on a machine
  too busy to run the consumer's thread (FLARE 2.9's own rendezvous gives up after 5 s);
- `lost`: the tensors never arrive in time (the rendezvous fails at once: a fatal system error
  that makes FLARE abort the job).
"""

import os
import time

FAULT = os.environ.get("NVFP4_JAX_TEST_TENSOR_FAULT", "")
if FAULT:
    from nvflare.app_opt.tensor_stream import receiver as _receiver

    if FAULT == "late":
        _on_tensor_received = _receiver.TensorReceiver.on_tensor_received

        def _late(self, task_id, tensor):
            time.sleep(6.0)
            return _on_tensor_received(self, task_id, tensor)

        _receiver.TensorReceiver.on_tensor_received = _late
    elif FAULT == "lost":
        def _lost(self, task_id, peer_name, timeout=5.0):
            raise TimeoutError(f"No tensors received from peer '{peer_name}'. Task ID: '{task_id}'.")

        _receiver.TensorReceiver.wait_for_tensors = _lost
    else:
        raise ValueError(f"NVFP4_JAX_TEST_TENSOR_FAULT={FAULT!r}: late or lost")
