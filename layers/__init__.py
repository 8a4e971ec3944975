"""One file per layer: its weights by checkpoint name, its numpy reference (and later its GPU launches)."""
