"""The whole-step CUDA graph of the engine: :class:`~nasdiag.cuda_graphs.StepGraph` (a shared foundation, so that
the curvature primitives can replay their computations too), under the name the engine has always used."""

from nasdiag.cuda_graphs import CudaGraphBackend, GraphWarning, StepGraph

__all__ = ["CudaGraphBackend", "GraphWarning", "StepGraph"]
