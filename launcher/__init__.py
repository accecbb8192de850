"""slurm-grpo launcher: config -> plan -> sbatch / local bootstrap. Imports neither torch nor vLLM."""
