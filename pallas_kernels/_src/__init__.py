"""What the ops share: implementation choice, jagged containers, shard_map typing, Mosaic GPU helpers, the Triton pallas_call."""
