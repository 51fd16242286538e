"""The tiled LM-head loss: the public losses, the tile loop over the LM head, and the per-tile
math of each loss.
"""
