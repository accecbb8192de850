"""slurm-grpo trainer: TRL GRPOTrainer with FSDP2, node-local generation and per-node weight push."""
