from setuptools import find_packages, setup

setup(
    name="reno_jax",
    version="0.1.0",
    description="Agentic RL post-training of Ling-3.0 (bailing_hybrid) on tool-calling tic-tac-toe, in JAX.",
    packages=find_packages(include=["reno_jax", "reno_jax.*", "experiments", "configs"]),
    package_data={"reno_jax": ["assets/*.json", "assets/*.jinja", "assets/*.npz"]},
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.7",
        "flax>=0.10",
        "optax>=0.2.4",
        "orbax-checkpoint>=0.11",
        "chex>=0.1.89",
        "absl-py>=2.1",
        "ml_collections>=1.0",
        "safetensors>=0.4",
        "transformers>=4.50",
        "tokenizers>=0.20",
        "jinja2>=3.1",
        "numpy>=1.26",
        "tensorboardX>=2.6",
        "matplotlib>=3.8",
        "tqdm>=4.66",
    ],
    extras_require={
        "test": ["pytest>=8", "hypothesis>=6.100"],
        "gpu": ["jax[cuda12]"],
        "bench": ["pgx>=2.0", "torch==2.13.0"],
    },
)
