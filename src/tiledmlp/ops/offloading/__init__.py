"""Activation offloading: checkpointed layers' saved inputs kept in host memory, and the host
memory a step pins.
"""
