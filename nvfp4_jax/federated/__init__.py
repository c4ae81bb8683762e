"""Federated training on NVIDIA FLARE: FedAvg over this project's Llama, sites running its
trainer, adaptive per-site sample budgets, a declared update contract (full / diff / subset,
optionally FP8- or NVFP4-compressed with error feedback) and FLARE's privacy filters.

Needs the `federated` extra (`pip install 'nvfp4_jax[federated]'`, NVIDIA FLARE) for the job,
server and client; `budget`, `contract` and `split` are plain numpy.
"""
