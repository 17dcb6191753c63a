"""Side-by-side benchmarks of Conduit-JAX against NumPy, cpprb, Flashbax and TorchRL (``python -m benchmarks.run``)."""
