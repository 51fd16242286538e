"""The tiled MLP: its autograd Function, functional entry point, engines (minimal recompute for
recognised structures, generic recompute for the rest), structure recognition, memory model, and
the fused elementwise kernels of gated activations (glu/).
"""
