"""Fine-tuning at long context with tiled MLPs: data, presets and the training loop behind
`tiledmlp train`."""
