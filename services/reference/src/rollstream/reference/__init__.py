"""rollstream reference: adds the frozen reference model's per-token log-probs (for the KL term)."""
