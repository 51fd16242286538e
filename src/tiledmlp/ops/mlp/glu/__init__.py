"""Fused elementwise kernels of gated MLP activations (h = act(g) * u and its backward): the entry
points with their failover, the Triton kernels, their PyTorch references, operand rules and
ahead-of-time compilation.
"""
