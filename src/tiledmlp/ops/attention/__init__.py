"""The attention core by groups of heads: the op, the fused kernels it calls per group, and the
choice of kernel with its self-check and failover.
"""
