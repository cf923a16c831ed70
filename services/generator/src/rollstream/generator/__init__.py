"""rollstream generator: samples groups of completions and applies the trainer's weight deltas."""
