"""`remixer-t5 bench decode`: the time to decode a batch, greedy and beam search, through the evaluator's own
decode function, optionally beside Hugging Face transformers' `T5ForConditionalGeneration.generate` on the same
weights.

Ours is exactly what seqio evaluation calls per batch: `programs.jit_decode(model, beam_size)` (encoder
once, then greedy or beam search over the decoder's cache, length penalty alpha 0.6), then the tokens brought
to the host. Inputs are random ids ending in EOS, no padding; parameters a fresh initialisation of the gin MODEL
(seed 0) or `--checkpoint`'s.

Both sides decode exactly `new_tokens` positions for every row: the evaluator's decode gets an EOS id no token
has (`NO_EOS`), HF's `generate` `eos_token_id=None`. Both then do the same work, and on the same weights give
the same tokens (reported: `*_identical_rows`).

The reference (`--reference hf`, the `.[hf]` extra; T5.1.1 models only) is the same parameters written as an
HF checkpoint (as `export-hf` does) and loaded with `from_pretrained`, float32. Length penalties differ in form:
ours is GNMT's ((5 + L) / 6) ** alpha (T5's), HF's L ** alpha. `early_stopping="never"` is the closest to ours
(both stop when no live beam divided by the penalty at the maximum length can beat the worst kept finished
hypothesis). With EOS disabled every hypothesis has length `new_tokens`, the penalty is a common factor and the
two searches rank alike; with EOS they can keep different finished hypotheses.

Timing (as `bench train`): `rounds` rounds; in each, for each mode, ours then HF: `warmup` untimed batches in
the first round (compilation included), 1 in later ones, then the median of `steps` timed batches. Reported per
mode and side: the median of the per-round medians (s per batch) and tokens/s = batch_size * new_tokens / s per
batch (a beam-search row counts `new_tokens`, not K times it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from remixer_t5.bench import env as bench_env, train as bench_train
from remixer_t5.commands import common
from remixer_t5.interop import hf
from remixer_t5.model import network
from remixer_t5.training import checkpoints, evaluation, programs  # noqa: F401 - evaluation: seqio, hence
# TensorFlow, is loaded before transformers (see bench_decode)

MODES = ("greedy", "beam")
NO_EOS = -1  # an EOS id no token has: the evaluator's decode then runs every position


@dataclasses.dataclass(frozen=True)
class Settings:
  """One measurement: `batch_size` random inputs of `input_length` ids (ending in EOS), `new_tokens` positions
  decoded per `modes` (greedy; beam search with `beam_size` beams), `rounds` of `warmup` untimed then `steps`
  timed batches. Checked when made, before any model is built."""

  batch_size: int = 32
  input_length: int = 128
  new_tokens: int = 64
  beam_size: int = 4
  modes: tuple[str, ...] = MODES
  steps: int = 3
  rounds: int = 3
  warmup: int = 1

  def __post_init__(self):
    object.__setattr__(self, "modes", tuple(self.modes))
    if not self.modes or not set(self.modes) <= set(MODES):
      raise ValueError(f"--modes {','.join(self.modes)}: expected one or both of {', '.join(MODES)}")
    for name, least in (
      ("batch_size", 1),
      ("input_length", 1),
      ("new_tokens", 1),
      ("beam_size", 2),
      ("steps", 1),
      ("rounds", 1),
      ("warmup", 0),
    ):
      value = getattr(self, name)
      if not isinstance(value, int) or value < least:
        raise ValueError(
          f"--{name}={value}: expected an integer >= {least}"
          + (" (greedy is the 'greedy' mode)" if name == "beam_size" else "")
        )


# --- the two decoders -----------------------------------------------------------------------------------
def ours(model, params, enc: np.ndarray, new_tokens: int, beam_size: int = 1) -> Callable[[], np.ndarray]:
  """A zero-argument callable: the evaluator's jitted decode of `enc` (EOS disabled), tokens on the host
  [batch, new_tokens] (the best beam)."""
  predict = programs.jit_decode(model, beam_size, NO_EOS)
  device_enc = jnp.asarray(enc)

  def run():
    return np.asarray(jax.device_get(predict(params, device_enc, new_tokens)))

  return run


def _transformers():
  try:
    import torch
    import transformers
  except ImportError as e:  # pragma: no cover - depends on the optional extra
    raise ValueError(f"--reference hf needs PyTorch and transformers: pip install -e '.[hf]' ({e})") from None
  return torch, transformers


def hf_model(config, params, flush_denormal: bool = True):
  """transformers' T5ForConditionalGeneration holding `params` (float32, eval mode), as `export-hf` writes it.
  ValueError for a model HF's T5 cannot hold, checked before PyTorch is imported. PyTorch's subnormal mode
  (`flush_denormal`, bench_env) is set before the load, PyTorch's first operation: the mode is per thread."""
  need = "--reference hf needs a T5.1.1 model (self-attention and a gated-GELU MLP, e.g. models/t5_1_1/small.gin)"
  if not isinstance(config, network.T5Config):
    raise ValueError(f"{need}; got a {type(config).__name__}")
  try:
    hf.config_to_hf(config)
    hf.params_to_hf_state_dict(params, config)
  except ValueError as e:
    problems = "; ".join(str(e).splitlines()[1:] or str(e).splitlines())
    raise ValueError(f"{need}: {problems[:300]}{'...' if len(problems) > 300 else ''}") from None
  _, transformers = _transformers()
  bench_env.set_torch_flush_denormal(flush_denormal)
  transformers.logging.set_verbosity_error()  # the untied-head notice on every load
  transformers.utils.logging.disable_progress_bar()  # "Loading weights" on every load
  with tempfile.TemporaryDirectory(prefix="bench_decode_hf_") as tmp:
    hf.write_hf_checkpoint(os.path.join(tmp, "model"), config, params)
    model = transformers.T5ForConditionalGeneration.from_pretrained(os.path.join(tmp, "model"))
  return model.float().eval()


def hf_reference(
  model, enc: np.ndarray, new_tokens: int, beam_size: int = 1, alpha: float = 0.6
) -> Callable[[], np.ndarray]:
  """A zero-argument callable: `model.generate` of `enc` for exactly `new_tokens` tokens (no EOS stop), the
  tokens after the decoder start [batch, new_tokens]. PyTorch's subnormal mode is bench_decode's to set, once,
  before the model's load (bench_env.set_torch_flush_denormal)."""
  torch, _ = _transformers()
  input_ids = torch.from_numpy(enc.astype(np.int64))
  mask = (input_ids > 0).long()
  kwargs = dict(
    max_new_tokens=new_tokens,
    do_sample=False,
    num_beams=beam_size,
    eos_token_id=None,
    pad_token_id=0,
    decoder_start_token_id=0,
  )
  if beam_size > 1:
    kwargs.update(length_penalty=alpha, early_stopping="never")

  def run():
    with torch.inference_mode():
      out = model.generate(input_ids=input_ids, attention_mask=mask, **kwargs)
    if tuple(out.shape) != (enc.shape[0], new_tokens + 1):  # the decoder start, then new_tokens
      raise RuntimeError(
        f"HF generate returned {tuple(out.shape)}, not {(enc.shape[0], new_tokens + 1)}: it "
        "did not decode every position (did this transformers version ignore eos_token_id=None?)"
      )
    return out[:, 1:].numpy().astype(np.int32)

  return run


# --- the benchmark --------------------------------------------------------------------------------------
def bench_decode(
  model,
  params=None,
  settings: Settings = Settings(),
  *,
  reference: str | None = None,
  seed: int = 0,
  hf_flush_denormal: bool = True,
  log: Callable[[str], None] = lambda s: None,
  outputs: dict[str, np.ndarray] | None = None,
) -> dict[str, Any]:
  """Median s per batch and tokens/s of our decode (and the reference's) per mode, alternated over rounds.

  `params`: None initialises the model (seed `seed`). `outputs`, when given, receives each side's tokens per
  mode (`ours_greedy`, `hf_beam`, ...: [batch, new_tokens]) and the inputs (`inputs`)."""
  if reference not in bench_train.REFERENCES:
    raise ValueError(f"unknown reference {reference!r}; expected one of {bench_train.REFERENCES}")
  batch_size, input_length, new_tokens, beam_size = (
    settings.batch_size,
    settings.input_length,
    settings.new_tokens,
    settings.beam_size,
  )
  modes, steps, rounds, warmup = settings.modes, settings.steps, settings.rounds, settings.warmup
  cfg = model.module.config
  if params is None:
    shapes = {
      "encoder_input_tokens": (1, input_length),
      "decoder_input_tokens": (1, new_tokens),
      "decoder_target_tokens": (1, new_tokens),
    }
    params = model.init_variables(jax.random.PRNGKey(seed), shapes)["params"]
  enc = np.random.default_rng(seed).integers(2, cfg.vocab_size, size=(batch_size, input_length), dtype=np.int32)
  enc[:, -1] = 1  # random ids ending in EOS, every position real
  beams = {"greedy": 1, "beam": beam_size}
  runners: dict[str, dict[str, Callable[[], np.ndarray]]] = {m: {} for m in modes}
  # Built before any timing, so that a model HF cannot hold fails fast. transformers probes for TensorFlow
  # (importlib find_spec), which would use up quiet.py's one-shot import hook before seqio's real import and
  # let TensorFlow's native start-up lines through: hence evaluation (seqio) is imported first, above.
  # PyTorch flushes subnormals as XLA:CPU does (bench_env), set in hf_model before its first operation.
  reference_model = hf_model(cfg, params, hf_flush_denormal) if reference == "hf" else None
  for mode in modes:
    runners[mode]["ours"] = ours(model, params, enc, new_tokens, beams[mode])
    if reference_model is not None:
      runners[mode]["hf"] = hf_reference(reference_model, enc, new_tokens, beams[mode])
  load_start = bench_env.loadavg()
  medians: dict[str, list[float]] = {f"{side}_{m}": [] for m in modes for side in runners[m]}
  last: dict[str, np.ndarray] = {}
  for r in range(rounds):
    for mode in modes:
      for side, run in runners[mode].items():
        key = f"{side}_{mode}"
        times, last[key] = bench_train.time_calls(run, steps, warmup if r == 0 else 1)
        medians[key].append(statistics.median(times))
        log(
          f"round {r + 1}/{rounds} {mode} {side}: median {medians[key][-1]:.3f} s/batch "
          f"(min {min(times):.3f}, max {max(times):.3f})"
        )
  row: dict[str, Any] = {
    "batch_size": batch_size,
    "input_length": input_length,
    "new_tokens": new_tokens,
    "beam_size": beam_size,
    "modes": list(modes),
    "steps": steps,
    "rounds": rounds,
    "warmup": warmup,
    "reference": reference,
    "eos": "disabled on both sides: every row decodes new_tokens positions",
    "length_penalty_alpha": 0.6,
    "activation_dtype": str(jnp.dtype(cfg.for_target().dtype)),
    "vocab_size": cfg.vocab_size,
    "backend": jax.default_backend(),
    "devices": jax.device_count(),
  }
  for key, per_round in medians.items():
    s = statistics.median(per_round)
    row.update(
      {f"{key}_s_per_batch": s, f"{key}_tokens_per_s": batch_size * new_tokens / s, f"{key}_round_medians": per_round}
    )
  for mode in modes:
    if f"hf_{mode}" in last:
      row[f"ratio_ours_to_hf_{mode}"] = row[f"ours_{mode}_s_per_batch"] / row[f"hf_{mode}_s_per_batch"]
      a, b = last[f"ours_{mode}"], last[f"hf_{mode}"]
      same = (a == b).all(axis=1)
      row[f"{mode}_identical_rows"] = int(same.sum())
      row[f"{mode}_tokens_identical"] = bool(same.all())
      if not same.all():
        first_row = int(np.argmin(same))
        row[f"{mode}_first_mismatch"] = {"row": first_row, "position": int(np.argmax(a[first_row] != b[first_row]))}
  row.update(bench_env.environment(reference_model is not None))
  row["load_average_start"], row["load_average_end"] = load_start, bench_env.loadavg()
  if outputs is not None:
    outputs.update(last)
    outputs["inputs"] = enc
  return row


def format_row(row: Mapping[str, Any]) -> str:
  lines = [
    f"batch {row['batch_size']} x {row['input_length']} input tokens, {row['new_tokens']} new tokens "
    f"(EOS disabled) on {row['backend']} ({row['devices']} device(s)), median of {row['steps']} "
    f"batches x {row['rounds']} rounds"
  ]
  labels = {"ours": "ours (evaluator's jitted decode)", "hf": "HF generate (PyTorch)"}
  for mode in row["modes"]:
    title = "greedy" if mode == "greedy" else f"beam {row['beam_size']}"
    for side in ("ours", "hf"):
      key = f"{side}_{mode}"
      if f"{key}_s_per_batch" in row:
        lines.append(
          f"  {title:8s} {labels[side]}: {row[f'{key}_s_per_batch']:.4f} s/batch, "
          f"{row[f'{key}_tokens_per_s']:,.0f} tokens/s"
        )
    if f"ratio_ours_to_hf_{mode}" in row:
      lines.append(
        f"  {title:8s} ours / HF: {row[f'ratio_ours_to_hf_{mode}']:.3f}; identical outputs: "
        f"{row[f'{mode}_identical_rows']}/{row['batch_size']} rows"
      )
  lines.append(
    f"  {row['cpu_model']} [{row.get('cpu_id')}], {row['cpus_usable']}/{row['cpu_count']} cores, load "
    f"{row['load_average_start']} -> {row['load_average_end']}, XLA flags "
    f"{row['xla_flags'] or '(none)'}, host malloc policy {'on' if row['host_malloc_policy'] else 'off'}"
    + (f", torch threads {row['torch_num_threads']}" if "torch_num_threads" in row else "")
    + f", commit {row['git_commit']}"
  )
  return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--batch_size", "--batch-size", type=int, default=32, help="examples per batch (default 32)")
  p.add_argument(
    "--input_length", "--input-length", type=int, default=128, help="input tokens per example (default 128)"
  )
  p.add_argument(
    "--new_tokens",
    "--new-tokens",
    type=int,
    default=64,
    help="tokens generated per example, every one decoded (default 64)",
  )
  p.add_argument("--beam_size", "--beam-size", type=int, default=4, help="beams of the beam mode (default 4)")
  p.add_argument("--modes", default=",".join(MODES), help="greedy, beam or greedy,beam (default)")
  p.add_argument(
    "--checkpoint",
    help="params to decode with (a MODEL_DIR, import-hf output or params checkpoint; "
    "default: the model freshly initialised, seed 0)",
  )
  p.add_argument("--warmup", type=int, default=1, help="untimed batches first, compilation included (default 1)")
  bench_train.add_comparison_arguments(p, 3, "batches")


def main(args: argparse.Namespace) -> int:
  common.load_gin(args, required=True)
  if args.against:
    return bench_train.main_against(args)
  reference, flush = bench_train.reference_of(args)
  modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
  settings = Settings(
    modes=modes,
    **{
      k: getattr(args, k)
      for k in ("batch_size", "input_length", "new_tokens", "beam_size", "steps", "rounds", "warmup")
    },
  )
  model = common.model()  # after the settings' checks
  params = checkpoints.restore_any_params(common.checkpoint_arg(args.checkpoint)) if args.checkpoint else None
  row = bench_decode(model, params, settings, reference=reference, log=common.stderr, hf_flush_denormal=flush)
  print(json.dumps(row) if args.json else format_row(row), flush=True)
  return 0
