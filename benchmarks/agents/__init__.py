"""A miniature of the paper's experiment: RL agents of a small Llama, merged with mergekit.

``python -m benchmarks.agents.run --out benchmarks/agents/results --doc docs/quality.md``
trains a base model on three synthetic tasks, one GRPO agent per task, merges them with
every method of the grid through ``mergekit-yaml``, and evaluates everything.
"""
