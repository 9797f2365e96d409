"""Replay: a one-GEMM CUDA graph for calls that repeat their stream and pointers.

Outside XLA's command buffers each call of the handler launches ``cublasLtMatmul``, whose
host cost dominates a small layer's call. A call whose stream and pointers a plan has seen
``Policy.replay_after`` times is captured once into a CUDA graph of that one GEMM, and
later calls with the same stream and pointers launch the graph instead. A graph reads its
buffers' contents when it runs, so it writes exactly the call's buffers. At most
``replay_graphs`` graphs per plan (the oldest goes first); a plan that has dropped that many
stops replaying, since a program cycling through more pointer sets would capture at every
call. Under stream capture (XLA recording a command buffer) nothing is replayed.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

import cupy as cp

from .._policy import get_policy
from .tuning import CAPTURE_RELAXED

__all__ = ["Replayer"]

_SEEN_BOUND = 4096  # how many (stream, pointers) keys and streams to remember at most


class Replayer:
    """Graphs of one plan's GEMM, keyed by (stream, pointers)."""

    def __init__(self, device_id: int, issue: Callable[..., None], lock: threading.Lock):
        """``issue(stream, *pointers)`` enqueues the GEMM (the caller holds ``lock``)."""
        policy = get_policy()
        self.enabled = policy.replay
        self._after, self._most = policy.replay_after, policy.replay_graphs
        self._device_id = device_id
        self._issue, self._lock = issue, lock
        self._graphs: dict[tuple[int, ...], cp.cuda.graph.Graph] = {}
        self._seen: dict[tuple[int, ...], int] = {}
        self._streams: dict[int, cp.cuda.ExternalStream] = {}
        self.dropped = 0
        with cp.cuda.Device(device_id):
            self._capture_stream = cp.cuda.Stream(non_blocking=True)

    def launch(self, key: tuple[int, ...]) -> bool:
        """Launch the graph for ``key`` = (stream, *pointers) if there is (or now is) one;
        False where the caller must issue the GEMM itself."""
        graph = self._graphs.get(key)
        if graph is None and not self.enabled:
            return False
        stream = self._streams.get(key[0]) or self._external(key[0])
        if stream.is_capturing():
            return False
        if graph is None:
            graph = self._seen_again(key)
            if graph is None:
                return False
        graph.launch(stream)
        return True

    def _external(self, stream: int) -> cp.cuda.ExternalStream:
        if len(self._streams) >= _SEEN_BOUND:
            self._streams.clear()
        with warnings.catch_warnings():
            # Newer CuPy deprecates ExternalStream for Stream.from_external, which wants an
            # object speaking the CUDA stream protocol; XLA hands the handler a bare handle.
            warnings.simplefilter("ignore", DeprecationWarning)
            ext = cp.cuda.ExternalStream(stream, self._device_id)
        self._streams[stream] = ext
        return ext

    def _seen_again(self, key: tuple[int, ...]) -> cp.cuda.graph.Graph | None:
        """Count a call's key; on the ``replay_after``-th, capture and keep its graph."""
        with self._lock:
            graph = self._graphs.get(key)
            if graph is not None or not self.enabled:
                return graph
            seen = self._seen.get(key, 0) + 1
            if seen < self._after:
                if len(self._seen) >= _SEEN_BOUND:
                    self._seen.clear()
                self._seen[key] = seen
                return None
            self._seen.pop(key, None)
            try:
                graph = self._capture(key)
            except Exception:  # noqa: BLE001 -- an optimisation must never fail a call
                self.enabled = False  # (the call goes on without it)
                return None
            return self._keep(key, graph)

    def _keep(self, key, graph) -> cp.cuda.graph.Graph | None:
        if len(self._graphs) >= self._most:  # (an in-flight launch still completes)
            del self._graphs[next(iter(self._graphs))]
            self.dropped += 1
            if self.dropped >= self._most:  # thrashing: back to cublasLtMatmul
                self.enabled = False
                self._graphs.clear()
                return None
        self._graphs[key] = graph
        return graph

    def _capture(self, key: tuple[int, ...]) -> cp.cuda.graph.Graph:
        capture = self._capture_stream  # captured work does not run: any stream will do
        capture.begin_capture(CAPTURE_RELAXED)
        try:
            self._issue(capture.ptr, *key[1:])
        finally:
            graph = capture.end_capture()
        return graph

    @property
    def stats(self) -> tuple[int, int, bool]:
        """(graphs kept, graphs dropped to make room, whether it still replays)."""
        return len(self._graphs), self.dropped, self.enabled
