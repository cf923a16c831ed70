"""rollstream trainer: feeds prompts, trains GRPO on scored rollouts, publishes weight deltas."""
