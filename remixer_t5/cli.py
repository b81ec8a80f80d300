"""`remixer-t5 <command>`: train, eval, infer, compare, compile, tasks, info, import-hf, export-hf, plot, bench,
repro, with t5x-style gin flags.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import sys
import traceback
from pathlib import Path
from typing import Sequence

from remixer_t5 import quiet

quiet.configure()  # before anything imports JAX or TensorFlow: their native start-up lines hidden (quiet.py)
from remixer_t5 import runtime  # noqa: E402 - imports nothing heavy

try:  # $REMIXER_T5_CPUS: before any thread pool starts (numpy's, XLA's, TensorFlow's)
  _PINNED, _PIN_ERROR = runtime.pin_from_env(), None
except ValueError as _e:  # reported by main() like any bad input
  _PINNED, _PIN_ERROR = None, _e

from remixer_t5.storage import StorageError  # noqa: E402 - after quiet.configure()
from remixer_t5.training import best  # noqa: E402
from remixer_t5 import sweep  # noqa: E402
from remixer_t5.gin_utils import GinError, gin_dir, parse_gin, split_flags  # noqa: E402
from remixer_t5.gin_utils import macro as _macro  # noqa: E402

GIN_FLAGS = """gin flags (t5x's; any number, anywhere on the line):
  --gin_file=F          repeatable; looked up as given, then in --gin_search_paths, then in the package's gin/
                        (a model, e.g. models/t5_1_1/small.gin, then a run, e.g. runs/pretrain.gin)
  --gin.NAME=VALUE      a binding applied after the files (`--gin.MODEL_DIR="'/tmp/run'"`, `--gin.BATCH_SIZE=8`)
  --gin_search_paths=A,B
"""
__doc__ += "\n" + GIN_FLAGS


# --- commands ------------------------------------------------------------------------------------------
def _stderr(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def _run():
  """The run the gin files configure (run_config.from_gin: a GinError naming the run files when none is loaded;
  any other error raised while the run is built, e.g. a bad value or a schedule's own check, as it was raised)."""
  from remixer_t5.training import run_config
  return run_config.from_gin()


def _check_model_dir() -> None:
  """A local MODEL_DIR that exists must be a folder (checked before anything is built or compiled)."""
  from remixer_t5 import storage
  model_dir = _macro("MODEL_DIR")
  if isinstance(model_dir, (str, os.PathLike)) and model_dir and not storage.is_bucket(model_dir):
    path = Path(model_dir).expanduser()
    if path.exists() and not path.is_dir():
      raise NotADirectoryError(f"MODEL_DIR {model_dir} is a file; expected a folder (a new one, or a run's)")


def _configured(fn):
  """`fn` with the gin config's bindings of its own options (e.g. trainer.evaluate_checkpoint.infer_split)."""
  import gin
  try:
    return gin.get_configurable(fn)
  except ValueError:  # nothing binds it
    return fn


def _start_line(command: str) -> None:
  """One line at the start of a run: the devices, and the kernel choices the config makes (kernels/)."""
  import gin
  import jax
  devices = jax.devices()
  kinds = sorted({d.device_kind for d in devices})
  chosen = [line.strip() for line in gin.config_str().splitlines()
            if any(k in line for k in ("attention_impl", "dropout_impl", "HyperMixing.impl")) and "'auto'" not in line]
  try:
    out = f"; output: {_macro('MODEL_DIR')}"
  except Exception:  # noqa: BLE001 - a config without MODEL_DIR: nothing to name
    out = ""
  _stderr(f"remixer-t5 {command}: {len(devices)} {devices[0].platform} device(s) ({', '.join(kinds)}) in "
          f"{jax.process_count()} process(es); kernels: {'; '.join(chosen) or 'auto (by platform)'}{out}")


def _check_checkpoint_source(path, what: str) -> None:
  """A local checkpoint source (eval's MODEL_DIR, infer's --checkpoint or MODEL_DIR) that does not exist or is an
  empty folder is reported here, before the model is built (a bucket's is checked where it is read)."""
  from remixer_t5 import storage
  if not path or storage.is_bucket(path):
    return
  folder = Path(path).expanduser()
  if not folder.exists() or (folder.is_dir() and not any(folder.iterdir())):
    raise FileNotFoundError(f"no checkpoint in {path} ({what} {'is empty' if folder.exists() else 'does not exist'}):"
                            " expected a training run's MODEL_DIR (checkpoints/), an import-hf output, a t5x "
                            "checkpoint or a params checkpoint")


def cmd_train(_: argparse.Namespace) -> int:
  import gin
  from remixer_t5.training import trainer
  run = _run()
  _start_line("train")
  trainer.train(run, config_text=gin.config_str())
  return 0


def cmd_infer(args: argparse.Namespace) -> int:
  from remixer_t5.model import decoding
  from remixer_t5.training import inference
  from remixer_t5 import storage
  run = _run()
  if args.checkpoint in ("best", "latest") or str(args.checkpoint).isdigit():  # a step of MODEL_DIR
    args.checkpoint = str(best.checkpoint_dir(run.model_dir, args.checkpoint))
  _check_checkpoint_source(args.checkpoint or run.model_dir, "--checkpoint" if args.checkpoint else "MODEL_DIR")
  if args.inputs and not storage.run_path(args.inputs).is_file():
    raise FileNotFoundError(f"--inputs {args.inputs}: no such file")
  _start_line("infer")
  sampling = None
  if args.temperature is not None or args.top_k or args.top_p is not None:
    sampling = decoding.Sampling(temperature=1.0 if args.temperature is None else args.temperature,
                                 top_k=args.top_k or 0, top_p=1.0 if args.top_p is None else args.top_p,
                                 seed=args.seed)
  request = inference.Request(inputs=args.inputs, output=args.output, split=args.split, checkpoint=args.checkpoint,
                              beam_size=args.beam_size, sampling=sampling, max_examples=args.max_examples)
  print(json.dumps(inference.infer(run, request, progress=_stderr)))
  return 0


def cmd_eval(args: argparse.Namespace) -> int:
  from remixer_t5.training import trainer
  run = _run()
  _check_checkpoint_source(run.model_dir, "MODEL_DIR")
  step = {}
  if args.checkpoint not in (None, "latest"):  # 'best' or a step number
    step = {"checkpoint_step": int(best.checkpoint_dir(run.model_dir, args.checkpoint).name)}
  _start_line("eval")
  print(json.dumps(_configured(trainer.evaluate_checkpoint)(run, **step)))
  return 0


BENCH_MIXING_LENGTHS = "128,256,...,4096"  # `bench mixing` without --lengths (bench.DEFAULT_LENGTHS)


def _parse_lengths(text: str | None) -> dict[str, int] | None:
  """--lengths INPUTS[,TARGETS] -> feature lengths (TARGETS defaults to INPUTS); None when not given."""
  if not text:
    return None
  inputs, _, targets = text.partition(",")
  try:
    lengths = {"inputs": int(inputs), "targets": int(targets or inputs)}
  except ValueError:
    lengths = None
  if lengths is None or min(lengths.values()) < 1:
    raise ValueError(f"--lengths {text}: expected INPUTS[,TARGETS], positive integers (e.g. 512,114)")
  return lengths


def cmd_tasks(args: argparse.Namespace) -> int:
  from remixer_t5.data import inspect
  if args.data_dir:
    from remixer_t5.tasks import sources
    sources.set_data_dir(args.data_dir)
  print(inspect.show(args.name, split=args.split, num=args.num, feature_lengths=_parse_lengths(args.lengths))
        if args.name else inspect.list_tasks())
  return 0


def cmd_info(args: argparse.Namespace) -> int:
  from remixer_t5 import info
  model = _model()
  lengths = _parse_lengths(args.lengths) or _macro("TASK_FEATURE_LENGTHS") or {"inputs": 512, "targets": 114}
  report = info.model_info(model, lengths)
  print(info.format_report(report))
  if args.show_sharding:
    print(info.format_sharding(model, lengths, mesh=args.mesh, rules=args.rules))
  if args.json:
    print(json.dumps(report))
  return 0


def cmd_import_hf(args: argparse.Namespace) -> int:
  from remixer_t5.training import checkpoints
  from remixer_t5.interop import hf
  from remixer_t5 import storage
  out = storage.run_path(args.out_dir)
  storage.check_bucket(out, "OUT_DIR")
  if out.exists() and not out.is_dir():
    raise NotADirectoryError(f"OUT_DIR {out} is a file; expected a new folder")
  if out.exists() and any(out.iterdir()):
    unfinished = storage.is_bucket(out) and not (out / "model.gin").exists()
    raise FileExistsError(f"{out} exists and is not empty" + (" (an unfinished import: no model.gin; delete it)"
                                                             if unfinished else "") + "; choose a new OUT_DIR")
  module, params = hf.load_hf_t5(args.hf_dir)
  gin_text = model_gin(module.config, source=str(args.hf_dir))
  if storage.is_bucket(out):  # no folder rename: orbax's commit marker, then model.gin, written last, whole
    try:
      checkpoints.save_params(out / "checkpoint", params)
      storage.write_text(out / "model.gin", gin_text)
    except BaseException:
      storage.remove_tree(out)  # nothing half-written is left behind
      raise
  else:
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    checkpoints.save_params(tmp / "checkpoint", params)
    (tmp / "model.gin").write_text(gin_text)
    tmp.replace(out)  # onto an empty OUT_DIR too
  n = sum(int(p.size) for p in __import__("jax").tree_util.tree_leaves(params))
  print(f"wrote {out}/checkpoint ({n:,} params) and {out}/model.gin")
  return 0


def cmd_export_hf(args: argparse.Namespace) -> int:
  from remixer_t5.training import checkpoints
  from remixer_t5.interop import hf
  ckpt = _checkpoint_arg(args.checkpoint)
  model = _model_for_checkpoint(ckpt)
  params = checkpoints.restore_any_params(best.checkpoint_dir(ckpt, args.step))
  vocabulary, source = _run_vocabulary(args.vocabulary)
  tokenizer = None
  if vocabulary is not None:
    if vocabulary.vocab_size > model.module.config.vocab_size:
      raise ValueError(f"the vocabulary ({source}) has {vocabulary.vocab_size} ids but the model's vocab_size "
                       f"is {model.module.config.vocab_size}; pass the run's own --vocabulary")
    tokenizer = hf.vocabulary_tokenizer_files(vocabulary)
  hf.write_hf_checkpoint(args.out_dir, model.module.config, params, tokenizer=tokenizer)
  print(f"wrote Hugging Face T5 v1.1 checkpoint to {args.out_dir}")
  if hf.is_scanned(params):  # write_hf_checkpoint unstacks them: one HF block per layer
    print("the checkpoint's layers were scanned (T5Config.scan_layers): exported unstacked, one block per layer")
  if tokenizer:
    print(f"with its tokenizer ({', '.join(tokenizer)}; {vocabulary.vocab_size} ids, {vocabulary.extra_ids} "
          f"sentinels) from {source}")
  else:
    print("no tokenizer written: no vocabulary is known for this checkpoint (no VOCABULARY or "
          "MIXTURE_OR_TASK_NAME in its gin); pass --vocabulary=PATH/TO/sentencepiece.model", file=sys.stderr)
  return 0


def _run_vocabulary(path: str | None):
  """(the run's seqio vocabulary, where it came from): --vocabulary, else the gin VOCABULARY, else the
  vocabulary of the gin's MIXTURE_OR_TASK_NAME; (None, None) when none of them is there."""
  from remixer_t5.data import vocab as vocab_lib
  if path:
    return vocab_lib.get_vocabulary(path), path
  vocabulary = _macro("VOCABULARY")
  if vocabulary is not None:
    return vocabulary, "the gin VOCABULARY"
  task = _macro("MIXTURE_OR_TASK_NAME")
  if task:
    from remixer_t5.data import task_lookup
    provider = task_lookup.get_mixture_or_task(task)
    return provider.output_features["targets"].vocabulary, f"task {task}"
  return None, None


def _checkpoint_arg(text: str):
  """A checkpoint argument (a local path or gs://) as the run-path type, its bucket checked before any work."""
  from remixer_t5 import storage
  path = storage.run_path(text)
  storage.check_bucket(path, "checkpoint")
  return path


def _model():
  """MODEL from the gin flags (GinError when they bind none: every model file does)."""
  model = _macro("MODEL")
  if model is None:
    raise GinError("the gin files define no MODEL; pass a model config, e.g. --gin_file=models/t5_1_1/small.gin")
  return model


def _model_for_checkpoint(ckpt):
  """MODEL from the gin flags, else from the checkpoint's model.gin (import-hf) or config.gin (MODEL_DIR)."""
  model = _macro("MODEL")
  if model is None:
    gin_file = ckpt / "model.gin" if (ckpt / "model.gin").exists() else ckpt / "config.gin"
    if not gin_file.exists():
      raise GinError(f"no model config: pass --gin_file=... or a directory holding model.gin "
                     f"(import-hf output) or config.gin (a train MODEL_DIR); looked for {gin_file}")
    parse_gin([str(gin_file)], ["MODEL_DIR=None"] if gin_file.name == "config.gin" else [])
    model = _macro("MODEL")
  return model


def _plot_tokens(args: argparse.Namespace, vocab_size: int):
  """(ids, labels): --text through a vocabulary if one is available, else --input_ids, else seeded random ids."""
  import numpy as np
  if args.text is not None:
    try:
      from remixer_t5.data import vocab as vocab_lib
      vocab = (vocab_lib.get_vocabulary(args.vocabulary) if args.vocabulary
               else _macro("VOCABULARY") or vocab_lib.get_vocabulary())
      ids = list(vocab.encode(args.text)) + [1]  # EOS, as encoder inputs end
      piece = getattr(getattr(vocab, "tokenizer", None), "id_to_piece", None)
      labels = [piece(i) if piece and i < vocab.tokenizer.get_piece_size() else str(i) for i in ids]
    except Exception as e:  # noqa: BLE001 - no usable vocabulary: say so and fall back
      _stderr(f"remixer-t5 plot: no vocabulary for --text ({type(e).__name__}: {e}); using "
              f"{'--input_ids' if args.input_ids else f'{args.length} random ids (seed {args.seed})'}")
    else:
      return ids, labels
  ids = ([int(t) for t in args.input_ids.replace(" ", ",").split(",") if t] if args.input_ids
         else np.random.default_rng(args.seed).integers(3, vocab_size, args.length).tolist())
  return ids, [str(i) for i in ids]


def cmd_plot(args: argparse.Namespace) -> int:
  from remixer_t5.training import checkpoints, plots
  ckpt = _checkpoint_arg(args.checkpoint)
  module = _model_for_checkpoint(ckpt).module
  params = checkpoints.restore_any_params(best.checkpoint_dir(ckpt, args.step))
  ids, labels = _plot_tokens(args, module.config.vocab_size)
  if not ids or min(ids) < 0 or max(ids) >= module.config.vocab_size:
    raise ValueError(f"input ids must lie in [0, {module.config.vocab_size}) for this model; got {ids}")
  log = lambda msg: _stderr(f"remixer-t5 plot: {msg}")
  log(f"{len(ids)} input tokens: {ids}")
  for path in plots.plot_mixing(module, params, [ids], args.out, labels, args.pseudo_samples, log=log):
    print(path)
  return 0


def cmd_sweep(args: argparse.Namespace) -> int:
  files, bindings, paths, _ = split_flags(args.argv)
  train_argv = ([f"--gin_file={f}" for f in files] + [f"--gin.{b}" for b in bindings]
                + ([f"--gin_search_paths={','.join(paths)}"] if paths else []))
  return sweep.main(args, train_argv)


def cmd_repro(args: argparse.Namespace) -> int:
  from remixer_t5.repro import cogs, cogs_curve, hypermixer_synthetic
  return {"hypermixer-synthetic": hypermixer_synthetic, "cogs": cogs, "cogs-curve": cogs_curve}[args.experiment].main(
      args)


def cmd_bench_mixing(args: argparse.Namespace) -> int:
  from remixer_t5.bench import mixing as bench
  mixers = [m for m in args.mixers.split(",") if m]
  unknown = [m for m in mixers if m not in bench.MIXERS]
  if unknown:
    raise ValueError(f"unknown mixer(s) {', '.join(unknown)}; choose from {', '.join(bench.MIXERS)}")
  config = bench.default_config(args.d_model, args.hidden, args.num_heads, args.head_dim)
  lengths = bench.parse_lengths(args.lengths or BENCH_MIXING_LENGTHS)
  rows = bench.bench_mixing(lengths, mixers, config=config, batch=args.batch, repeats=args.repeats, log=_stderr)
  print("\n".join(json.dumps(row) for row in rows) if args.json else bench.format_table(rows), flush=True)
  path = bench.plot_bench(rows, Path(args.out) / "mixing_bench.png")
  print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
  return 0


def cmd_bench_input(args: argparse.Namespace) -> int:
  from remixer_t5.bench import input as bench_input
  hosts = args.hosts or bench_input.PAPER_HOSTS
  report = bench_input.bench_input(
      **bench_input.from_gin(), batches=args.batches,
      warmup=5 if args.warmup is None else args.warmup, position=args.position,
      process_index=args.process_index, process_count=args.process_count or hosts, hosts=hosts,
      steps_per_s=args.steps_per_s or bench_input.PAPER_STEPS_PER_S, log=lambda m: _stderr(f"bench input: {m}"))
  print(json.dumps(report) if args.json else bench_input.format_report(report), flush=True)
  return 0


def _bench_reference(args: argparse.Namespace) -> tuple[str | None, bool]:
  """(--reference: None or 'hf'; whether the HF reference's PyTorch flushes subnormal floats: --hf_denormals
  'flush', the default, as XLA:CPU does, or 'keep', PyTorch's own default), checked before the model is built."""
  reference = None if args.reference in (None, "none") else args.reference
  if reference not in (None, "hf"):
    raise ValueError(f"unknown --reference {args.reference!r}; expected 'hf' or 'none'")
  if args.hf_denormals is not None and reference != "hf":
    raise ValueError(f"--hf_denormals={args.hf_denormals!r} sets the HF reference's PyTorch; it needs --reference hf")
  if args.hf_process is not None and reference != "hf":
    raise ValueError(f"--hf_process={args.hf_process} places the HF reference; it needs --reference hf")
  value = "flush" if args.hf_denormals is None else args.hf_denormals
  if value not in ("flush", "keep"):
    raise ValueError(f"--hf_denormals={value!r}: expected 'flush' (the default: PyTorch flushes subnormal floats "
                     "to zero, as XLA:CPU does) or 'keep' (PyTorch's own default)")
  return reference, value == "flush"


def cmd_bench_train(args: argparse.Namespace) -> int:
  from remixer_t5.bench import env as bench_env, train as bench_train
  if args.against:
    return _bench_against(args)
  reference, flush = _bench_reference(args)
  setup = bench_train.from_gin(args.batch_size, _parse_lengths(args.lengths))
  load_start = bench_env.loadavg()
  row = bench_train.bench_train(**setup, steps=20 if args.steps is None else args.steps,
                                warmup=5 if args.warmup is None else args.warmup,
                                rounds=3 if args.rounds is None else args.rounds, reference=reference,
                                hf_flush_denormal=flush, hf_process=args.hf_process or "own", log=_stderr)
  # PyTorch's settings come from the process the reference ran in: the child's, already in the row, when its own
  row.update(bench_env.environment(with_torch=reference == "hf" and args.hf_process == "shared"),
             load_average_start=load_start, load_average_end=bench_env.loadavg())
  bench_train.add_mfu(row, setup["model"], args.peak_flops)
  print(json.dumps(row) if args.json else bench_train.format_row(row), flush=True)
  return 0


def _bench_against(args: argparse.Namespace) -> int:
  """`bench train|decode --against COMMIT`: the same measurement at COMMIT and here, alternating."""
  from remixer_t5.bench import env as bench_env, train as bench_train
  if args.reference not in (None, "none"):
    raise ValueError("--against compares this tree with another commit; it takes no --reference")
  argv, tokens = [], iter(args.argv)
  for token in tokens:  # the command line as given, less the command and what `against` sets itself
    if token in ("--against", "--rounds"):
      next(tokens, None)  # and its value
    elif token not in ("bench", args.what, "--json") and not token.startswith(("--against=", "--rounds=")):
      argv.append(token)
  row = bench_train.against(args.against, args.what, argv, rounds=3 if args.rounds is None else args.rounds,
                            log=_stderr)
  row.update(bench_env.environment(with_torch=False), load_average_end=bench_env.loadavg())
  timings = "; ".join(f"{k}: {v['base'] * 1e3:.1f} ms at {row['against']}, {v['here'] * 1e3:.1f} ms here, here / "
                      f"base {v['here_over_base']:.3f}" for k, v in row.items() if isinstance(v, dict) and "base" in v)
  print(json.dumps(row) if args.json else f"bench {args.what} (medians of {row['rounds']} alternating rounds, "
        f"{row['cpu_model']}, load {row['load_average_end']}): {timings}", flush=True)
  return 0


def cmd_bench_decode(args: argparse.Namespace) -> int:
  from remixer_t5.bench import decode as bench_decode
  if args.against:
    return _bench_against(args)
  reference, flush = _bench_reference(args)
  modes = tuple(m.strip() for m in (args.modes or ",".join(bench_decode.MODES)).split(",") if m.strip())
  given = {k: getattr(args, k) for k in ("batch_size", "input_length", "new_tokens", "beam_size", "steps", "rounds",
                                         "warmup") if getattr(args, k) is not None}
  settings = bench_decode.Settings(modes=modes, **given)  # checked before the model is built
  model = _model()
  params = None
  if args.checkpoint:
    from remixer_t5.training import checkpoints
    params = checkpoints.restore_any_params(_checkpoint_arg(args.checkpoint))
  row = bench_decode.bench_decode(model, params, settings, reference=reference, log=_stderr, hf_flush_denormal=flush)
  print(json.dumps(row) if args.json else bench_decode.format_row(row), flush=True)
  return 0


BENCH_WORKLOADS = "cogs:t5_1_1,cogs:remixer,cogs:mixer_encdec,cogs:hypermixer,A,B"  # bench kernels' default

# Which `bench` kinds read each of its flags (argparse's dest); a flag given to a kind that would ignore it is
# an error naming the kinds that take it (check_bench_flags).
BENCH_FLAGS = {
    "json": ("mixing", "input", "train", "decode", "kernels", "drift"), "lengths": ("mixing", "train"),
    "warmup": ("input", "train", "decode", "kernels"), "workloads": ("kernels", "drift"), "field": ("drift",),
    **dict.fromkeys(("mixers", "out", "repeats", "batch", "d_model", "hidden", "num_heads", "head_dim"), ("mixing",)),
    **dict.fromkeys(("batches", "position", "hosts", "steps_per_s", "process_index", "process_count"), ("input",)),
    "steps": ("train", "decode", "kernels", "drift"), "rounds": ("train", "decode", "kernels"),
    **dict.fromkeys(("reference", "hf_denormals", "batch_size"), ("train", "decode")),
    "peak_flops": ("train",), "hf_process": ("train",), "against": ("train", "decode"),
    **dict.fromkeys(("input_length", "new_tokens", "beam_size", "modes", "checkpoint"), ("decode",)),
}


def check_bench_flags(what: str, argv: Sequence[str]) -> None:
  """ValueError for a flag in `argv` (the command line after the gin flags) that `bench what` does not read,
  e.g. `bench mixing --reference hf`, which would otherwise time ours alone without a word."""
  for token in argv:
    if not token.startswith("--"):
      continue
    dest = token[2:].split("=", 1)[0].replace("-", "_")
    kinds = BENCH_FLAGS.get(dest)
    if kinds is not None and what not in kinds:
      if what == "decode" and dest == "lengths":
        raise ValueError("bench decode takes --input_length and --new_tokens, not --lengths")
      raise ValueError(f"bench {what} does not take {token.split('=', 1)[0]} (it is for bench {' and '.join(kinds)})")


def cmd_bench_kernels(args: argparse.Namespace) -> int:
  from remixer_t5.bench import kernels as bench_kernels
  rows = bench_kernels.run(args.workloads.split(","), rounds=3 if args.rounds is None else args.rounds,
                           steps=10 if args.steps is None else args.steps,
                           warmup=2 if args.warmup is None else args.warmup, log=_stderr)
  for row in rows:
    print(json.dumps(row) if args.json else f"{row['workload']} {row['variant']} round {row['round']}: "
          f"{row['s_per_step'] * 1e3:.1f} ms/step", flush=True)
  return 0


def cmd_bench_drift(args: argparse.Namespace) -> int:
  from remixer_t5.bench import drift, env as bench_env
  rows = drift.run(args.workloads, args.field, steps=40 if args.steps is None else args.steps, log=_stderr)
  if args.json:
    rows[0]["env"] = bench_env.environment()
    print("".join(json.dumps(row) + "\n" for row in rows), end="", flush=True)
  return 0


def cmd_bench(args: argparse.Namespace) -> int:
  if args.what == "drift" and args.workloads == BENCH_WORKLOADS:
    args.workloads = "cogs:hypermixer"
  return {"mixing": cmd_bench_mixing, "input": cmd_bench_input, "train": cmd_bench_train,
          "decode": cmd_bench_decode, "kernels": cmd_bench_kernels, "drift": cmd_bench_drift}[args.what](args)


def cmd_compile(args: argparse.Namespace) -> int:
  from remixer_t5 import aot_compile
  steps = ["train"] + (["eval", "decode"] if args.all_steps else [])
  try:
    return aot_compile.main(args.topology, num_slices=args.num_slices, mesh=args.mesh, rules=args.rules,
                            steps=steps, as_json=args.json)
  except aot_compile.CompilerMissing as e:
    print(f"remixer-t5 compile: {e}", file=sys.stderr)
    return 2


def cmd_compare(args: argparse.Namespace) -> int:
  from remixer_t5 import compare
  names = [n.strip() for n in args.names.split(",")] if args.names else None
  runs, written = compare.compare(args.model_dirs, args.out, names, group_by_seed=args.group_by_seed)
  print(compare.markdown_table(runs), end="")
  paths = list(written.values())
  if args.group_by_seed:
    from remixer_t5 import study
    summary, written_study = study.report(compare.seed_points(runs), ["group"], args.out,
                                          title="runs grouped over seeds")
    print("\n" + study.markdown_table(summary, "runs grouped over seeds"), end="")
    paths += written_study
  for path in paths:
    print(f"wrote {path}", file=sys.stderr)
  return 0


def model_gin(cfg, source: str = "") -> str:
  """A standalone model gin file for a T5Config (written by import-hf)."""
  lines = [f"# T5.1.1 model imported from {source}" if source else "# T5.1.1 model",
           "from __gin__ import dynamic_registration", "from remixer_t5.model import models",
           "from remixer_t5.model import network", "",
           "MODEL = @models.EncoderDecoderModel()",
           "models.EncoderDecoderModel.module = @network.Transformer()",
           "network.Transformer.config = @network.T5Config()"]
  lines += [f"network.T5Config.{f.name} = {getattr(cfg, f.name)!r}" for f in dataclasses.fields(cfg)]
  return "\n".join(lines) + "\n"


CUSTOM_GIN = "runs/custom.gin"  # MIXTURE_OR_TASK_NAME = @custom.register(); tasks/custom.py


def _custom_data(args: argparse.Namespace, files: list[str], bindings: list[str]) -> tuple[list[str], list[str]]:
  """--train_file/--validation_file/--objective as gin: runs/custom.gin after the user's files, and bindings of
  custom.register (paths made absolute, so MODEL_DIR/config.gin reads the same files from anywhere)."""
  train, validation = getattr(args, "train_file", None), getattr(args, "validation_file", None)
  if not (train or validation):
    if getattr(args, "objective", None):
      raise GinError("--objective applies to --train_file / --validation_file; pass them too")
    return files, bindings
  if any(b.partition("=")[0].strip() == "MIXTURE_OR_TASK_NAME" for b in bindings):
    raise GinError("--train_file/--validation_file set MIXTURE_OR_TASK_NAME (the task 'custom'); drop "
                   "--gin.MIXTURE_OR_TASK_NAME")
  if args.command == "train" and train and not validation and not any(
      b.startswith("custom.register.validation") for b in bindings):
    raise GinError("train evaluates on a validation split: pass --validation_file too")
  from remixer_t5 import storage
  paths = lambda values: [p.as_posix() if storage.is_bucket(p) else str(p) for p in map(storage.run_path, values)]
  added = [f"custom.register.{split}={paths(values)!r}" for split, values in (("train", train),
                                                                           ("validation", validation)) if values]
  if args.objective:
    added.append(f"custom.register.objective={args.objective!r}")
  return files + [str(gin_dir() / CUSTOM_GIN)], added + bindings


class _Parser(argparse.ArgumentParser):
  """argparse's parser whose usage errors are one line, as every other error of the CLI (exit 2, its code)."""

  def error(self, message: str):
    self.exit(2, f"remixer-t5: error: {message} (`{self.prog} --help` lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
  p = _Parser(prog="remixer-t5", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="command", required=True)
  gin_help = dict(epilog=GIN_FLAGS, formatter_class=argparse.RawDescriptionHelpFormatter)
  tr = sub.add_parser("train", help="train (resumes from MODEL_DIR)", **gin_help)
  tr.add_argument("--profile_steps", "--profile-steps", metavar="FIRST:LAST",
                  help="a profiler trace of these train steps under MODEL_DIR/profile/ (run_config.Schedule."
                  "profile_steps; a running train also reads MODEL_DIR/PROFILE at its log steps)")
  ev = sub.add_parser("eval", help="evaluate the latest checkpoint in MODEL_DIR (a training run, an import-hf output "
                      "or a t5x checkpoint): validation loss, and the task's metrics on decoded outputs (seqio "
                      "Evaluator; JSON + TensorBoard in MODEL_DIR/inference_eval)", **gin_help)
  ev.add_argument("--checkpoint", metavar="best|latest|STEP", help="which step of MODEL_DIR (default latest; "
                  "best: the KEEP_BEST_BY step)")
  inf = sub.add_parser("infer", help="predictions of a checkpoint (MODEL_DIR or --checkpoint: a training run, an "
                       "import-hf output or a t5x checkpoint) for a task's split or a file of inputs, as JSONL",
                       **gin_help)
  inf.add_argument("--inputs", help="a file of inputs: one text a line, or JSONL rows with an 'inputs' field "
                   "(default: the run's task, --split)")
  inf.add_argument("--output", help="the JSONL to write (default: MODEL_DIR/infer/<inputs stem or task-split>.jsonl)")
  inf.add_argument("--split", default="validation", help="the task's split, labelled or not (default validation)")
  inf.add_argument("--checkpoint", help="where the parameters come from: a path, or best|latest|STEP of MODEL_DIR "
                   "(default: MODEL_DIR's latest)")
  inf.add_argument("--beam_size", "--beam-size", type=int, default=1, help="beams (default 1: greedy)")
  inf.add_argument("--temperature", type=float, help="sample at this temperature (0: greedy)")
  inf.add_argument("--top_k", "--top-k", type=int, help="sample from the k most likely tokens")
  inf.add_argument("--top_p", "--top-p", type=float, help="sample from the nucleus of probability p")
  inf.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")
  inf.add_argument("--max_examples", "--max-examples", type=int, help="predict only the first N inputs")
  for cmd in (tr, ev, inf):
    cmd.add_argument("--train_file", "--train-file", action="append", metavar="PATH",
                     help="your own data: a TSV or JSONL file (or glob; local or gs://; repeatable) as the train "
                     "split of the run's task (gin/runs/custom.gin; docs/data.md, \"Your own data\")")
    cmd.add_argument("--validation_file", "--validation-file", action="append", metavar="PATH",
                     help="the validation split of that task, as --train_file")
    cmd.add_argument("--objective", choices=("inputs_targets", "span_corruption"),
                     help="with --train_file/--validation_file: inputs/targets rows (default) or span corruption "
                     "of a text field")
    cmd.add_argument("--coordinator_address", "--coordinator-address",
                     help="HOST:PORT of process 0 for a multi-process run (or $REMIXER_T5_COORDINATOR)")
    cmd.add_argument("--num_processes", "--num-processes", type=int, help="(or $REMIXER_T5_NUM_PROCESSES)")
    cmd.add_argument("--process_id", "--process-id", type=int, help="(or $REMIXER_T5_PROCESS_ID)")
    cmd.add_argument("--distributed", action="store_true",
                     help="let JAX detect the cluster (TPU VM slice, SLURM, Open MPI); or $REMIXER_T5_DISTRIBUTED=auto")
    cmd.add_argument("--verbose", "-v", action="store_true",
                     help="say how the process was set up (host allocator, ...) besides the one start line")
  t = sub.add_parser("tasks", help="list registered tasks and mixtures, or show NAME's preprocessed examples")
  t.add_argument("name", nargs="?", help="a task or mixture: show its first examples as text and token ids")
  t.add_argument("--split", default="train")
  t.add_argument("--num", "-n", type=int, default=3, help="examples to show (default 3)")
  t.add_argument("--lengths", help="INPUTS,TARGETS truncation lengths (default: none)")
  t.add_argument("--data_dir", "--data-dir", help="local dataset files (default: $REMIXER_T5_DATA_DIR)")
  i = sub.add_parser("info", help="parameter count, per-module breakdown, FLOPs per token", **gin_help)
  i.add_argument("--json", action="store_true", help="end with one JSON line")
  i.add_argument("--show-sharding", action="store_true",
                 help="each parameter's shape, logical axes, partition spec and per-device shard, and bytes per device")
  i.add_argument("--mesh", help="for --show-sharding: a preset (cpu, tpu_v3_8, tpu_v3_32, tpu_v3_128, gpu_8) or "
                 "DATAxMODEL, e.g. 4x2; no devices needed (default: the host's devices, data-parallel)")
  i.add_argument("--rules", choices=["data", "data_model", "fsdp"], help="logical axis rules for --show-sharding")
  i.add_argument("--lengths", help="INPUTS,TARGETS lengths for FLOPs (default: TASK_FEATURE_LENGTHS or 512,114)")
  imp = sub.add_parser("import-hf", help="Hugging Face T5 v1.1 dir -> orbax checkpoint + model.gin")
  imp.add_argument("hf_dir")
  imp.add_argument("out_dir")
  exp = sub.add_parser("export-hf", help="checkpoint (import-hf output or MODEL_DIR) -> Hugging Face dir")
  exp.add_argument("checkpoint")
  exp.add_argument("--checkpoint", dest="step", metavar="best|latest|STEP",
                   help="which step of a training MODEL_DIR (default latest; best: the KEEP_BEST_BY step)")
  exp.add_argument("out_dir")
  exp.add_argument("--vocabulary", help="SentencePiece model written as the tokenizer (default: the run's gin "
                   "VOCABULARY, else its task's vocabulary)")
  plo = sub.add_parser("plot", help="PNG maps of softmax(H), self-attention and HyperMixing pseudo-attention")
  plo.add_argument("checkpoint", help="MODEL_DIR, import-hf output or params checkpoint")
  plo.add_argument("--checkpoint", dest="step", metavar="best|latest|STEP",
                   help="which step of a training MODEL_DIR (default latest; best: the KEEP_BEST_BY step)")
  plo.add_argument("--out", default=".", help="directory for the PNG files (default: current)")
  plo.add_argument("--text", help="input text, tokenised with the vocabulary (ends with EOS)")
  plo.add_argument("--vocabulary", help="SentencePiece model for --text (default: gin VOCABULARY or embedded)")
  plo.add_argument("--input_ids", "--input-ids", help="comma-separated token ids instead of --text")
  plo.add_argument("--length", type=int, default=32, help="random input length without --text/--input_ids")
  plo.add_argument("--seed", type=int, default=0, help="seed of the random input ids")
  plo.add_argument("--pseudo_samples", "--pseudo-samples", type=int, default=0,
                   help="0: exact pseudo-attention (n*d gradients); S: estimate from S random probes per token")
  cmp = sub.add_parser("compare", help="several runs side by side: loss against step and tokens seen, best "
                       "validation loss, parameters, tokens/s, task metrics (compare.png, .md, .csv under --out)")
  cmp.add_argument("model_dirs", nargs="+", metavar="MODEL_DIR", help="train MODEL_DIRs (each with metrics.jsonl)")
  cmp.add_argument("--out", default=".", help="directory for compare.png, compare.md, compare.csv (default: current)")
  cmp.add_argument("--names", help="comma-separated run names, one per MODEL_DIR (default: the directories' names)")
  cmp.add_argument("--group_by_seed", "--group-by-seed", action="store_true",
                   help="also group runs whose config.gin differ only in the seed: per group the mean, standard "
                        "deviation and t interval of each metric, Welch's t-test between the best two "
                        "(sweep.csv, sweep.md, sweep.png under --out)")
  ben = sub.add_parser("bench", allow_abbrev=False,  # check_bench_flags reads the flags' full names
                       help="bench mixing: fwd+bwd time and FLOPs of one token-mixing layer against length; bench "
                       "input: the training input pipeline's throughput and restore time; bench train: the train "
                       "step's time (optionally beside HF transformers' PyTorch T5); bench decode: greedy and "
                       "beam-search decoding of a batch through the evaluator's decode (optionally beside HF's "
                       "generate on the same weights); bench kernels: each kernel against plain JAX; bench drift: a kernel's "
                       "training against plain JAX's, step by step")
  ben.add_argument("what", choices=["mixing", "input", "train", "decode", "kernels", "drift"],
                   help="mixing: one token-mixing layer against length; input: the training input pipeline "
                        "(same gin flags as train) per process, restore time, and whether a host keeps up; train: "
                        "the jitted train step on random tokens (same gin flags as train); decode: the evaluator's "
                        "jitted greedy and beam decode of random inputs, every position (same gin flags as train); "
                        "kernels: each kernel against plain JAX in the train steps it exists for (the 1.2x rule); "
                        "drift: one workload's steps with a field at auto and at xla, from the same state: rounding "
                        "or a fault (docs/benchmarks.md)")
  ben.add_argument("--workloads", default=BENCH_WORKLOADS,
                   help="kernels: comma-separated, of cogs:<model>, cogs:hypermixer:packed and the T5.1.1 configs "
                   "A and B; drift: one of them (default cogs:hypermixer)")
  ben.add_argument("--field", default="hypermixing", help="drift: the implementation field (attention, dropout, "
                   "hypermixing) set to xla in the reference (default hypermixing)")
  ben.add_argument("--lengths", help="mixing: e.g. 128,256,...,4096 (default) or 256,1024; train: INPUTS,TARGETS "
                   "(default: TASK_FEATURE_LENGTHS)")
  ben.add_argument("--mixers", default="attention,hypermixer,linear_attention,fnet,mlp_mixer,gmlp,remixer",
                   help="comma-separated, from: attention, attention_norelpos, hypermixer, linear_attention, "
                        "fnet, mlp_mixer, gmlp, amlp, remixer")
  ben.add_argument("--json", action="store_true", help="one JSON object per measurement on stdout")
  ben.add_argument("--out", default=".", help="directory for mixing_bench.png (default: current)")
  ben.add_argument("--repeats", type=int, default=5, help="timed calls per measurement (median reported)")
  ben.add_argument("--batch", type=int, default=1)
  ben.add_argument("--d_model", "--d-model", type=int, default=256)
  ben.add_argument("--hidden", type=int, default=512, help="d' (HyperMixing) and the MLP widths")
  ben.add_argument("--num_heads", "--num-heads", type=int, default=4)
  ben.add_argument("--head_dim", "--head-dim", type=int, default=64)
  ben.add_argument("--batches", type=int, default=50, help="input: batches timed (after --warmup)")
  ben.add_argument("--warmup", type=int, help="input/train/decode: untimed batches/steps first (default 5; decode 1, "
                   "compilation included)")
  ben.add_argument("--steps", type=int, help="train/decode: timed steps/batches per round, median reported "
                   "(default: train 20, decode 3); drift: steps (default 40)")
  ben.add_argument("--rounds", type=int, help="train/decode: rounds, alternating with --reference or --against "
                   "(default 3)")
  ben.add_argument("--against", metavar="COMMIT", help="train/decode: time this tree against COMMIT on this "
                   "machine, each in fresh processes of its own tree's code, the two alternating --rounds times "
                   "(medians, here / base)")
  ben.add_argument("--reference", help="train/decode: 'hf' also times transformers' PyTorch T5 (train step; "
                   "decode: generate on the same weights, T5.1.1 only) on the same shapes (pip install -e '.[hf]'); "
                   "'none' (default) times ours only")
  ben.add_argument("--hf_denormals", "--hf-denormals",
                   help="train/decode with --reference hf: 'flush' (default) runs PyTorch with subnormal floats "
                   "flushed to zero, as XLA:CPU always does; 'keep' leaves PyTorch's default (on Intel CPUs its "
                   "train step then runs several times slower once subnormals appear)")
  ben.add_argument("--hf_process", "--hf-process", choices=("own", "shared"),
                   help="train with --reference hf: 'own' (default) runs the reference in a process of its own, "
                   "so the two share no heap or threads; 'shared' runs it in this one")
  ben.add_argument("--batch_size", "--batch-size", type=int,
                   help="train: override BATCH_SIZE; decode: examples per batch (default 32)")
  ben.add_argument("--input_length", "--input-length", type=int, help="decode: input tokens per example (default 128)")
  ben.add_argument("--new_tokens", "--new-tokens", type=int,
                   help="decode: tokens generated per example, every one decoded (default 64)")
  ben.add_argument("--beam_size", "--beam-size", type=int, help="decode: beams of the beam mode (default 4)")
  ben.add_argument("--modes", help="decode: greedy, beam or greedy,beam (default)")
  ben.add_argument("--checkpoint", help="decode: params to decode with (a MODEL_DIR, import-hf output or params "
                   "checkpoint; default: the model freshly initialised, seed 0)")
  ben.add_argument("--peak_flops", "--peak-flops", type=float,
                   help="train: peak FLOP/s per device for MFU (default: known accelerators only)")
  ben.add_argument("--position", type=int, default=0,
                   help="input: also reach batch N once, save the iterator state and time a fresh restore to N")
  ben.add_argument("--hosts", type=int, help="input: hosts sharing the batch (default 4: a v3-32)")
  ben.add_argument("--steps_per_s", "--steps-per-s", type=float,
                   help="input: the step rate to feed (default 9: T5.1.1-base, Remixer paper Table 1)")
  ben.add_argument("--process_index", "--process-index", type=int, default=0, help="input: which shard to read")
  ben.add_argument("--process_count", "--process-count", type=int, help="input: shards (default: --hosts)")
  com = sub.add_parser("compile", help="compile the train step (same gin flags as train) for a TPU slice or GPUs "
                       "on this host, no TPU or GPU needed: memory per device against HBM, FLOPs, estimated "
                       "step time", **gin_help)
  com.add_argument("--topology", required=True, help="a Cloud TPU slice: v3-8, v3-32, v3-128, ..., v2-8.., "
                   "v4-8.., v5p-8.., v5e-1.., v6e-1.. (v2/v3/v4/v5p count cores, v5e/v6e chips); or one "
                   "process's GPUs: h100, h100x8, h200, a100x8, ... (needs `make gpu-compile-env`)")
  com.add_argument("--num_slices", "--num-slices", type=int, default=1, help="slices joined over the data axis")
  com.add_argument("--mesh", help="override the run's mesh: a preset (tpu_v3_32, ...) or DATAxMODEL")
  com.add_argument("--rules", choices=["data", "data_model", "fsdp"], help="override the run's rule set")
  com.add_argument("--all_steps", "--all-steps", action="store_true", help="also compile the eval and decode steps")
  com.add_argument("--json", action="store_true", help="print the report as one JSON object")
  swp = sub.add_parser("sweep", help="train every point of a grid of gin settings at each seed (a folder per "
                       "point, resumable), then tabulate the metrics over seeds: mean, std, 95% interval, Welch's "
                       "t-test (sweep.csv, sweep.md, sweep.png)", **gin_help)
  sweep.add_arguments(swp)
  rep = sub.add_parser("repro", help="reproduce a paper experiment on a CPU (hypermixer-synthetic: HyperMixer "
                       "§4.7, Fig. 5; cogs: COGS from scratch, Remixer paper §3.4)")
  rep_sub = rep.add_subparsers(dest="experiment", required=True)
  from remixer_t5.repro import cogs, cogs_curve, hypermixer_synthetic
  hypermixer_synthetic.add_arguments(rep_sub.add_parser(
      "hypermixer-synthetic", help="test MSE against training-set size and pseudo-attention maps"))
  cogs.add_arguments(rep_sub.add_parser(
      "cogs", help="train each model from scratch on COGS, exact match on dev, test and every gen category"))
  cogs_curve.add_arguments(rep_sub.add_parser(
      "cogs-curve", help="one COGS run with a checkpoint every --every steps, each decoded: exact match against steps"))
  return p


# --- errors: one line and an exit code ------------------------------------------------------------------
# docs/cli.md, "Exit codes". An exception class of the project may carry its own code (`exit_code`).
EXIT_BAD_INPUT, EXIT_NON_FINITE, EXIT_STORAGE, EXIT_OUT_OF_MEMORY, EXIT_INTERRUPTED = 2, 3, 4, 5, 130
TRACEBACK_ENV = "REMIXER_T5_TRACEBACK"
# Status codes (absl's, as XLA, TensorFlow and tensorstore spell them) of a store that did not answer or refused.
_STORAGE_STATUS = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "PERMISSION_DENIED", "UNAUTHENTICATED", "ABORTED")
# TensorFlow's errors that are about what was read (a missing file, a malformed row), not about reading it.
_TF_INPUT_ERRORS = ("NotFoundError", "InvalidArgumentError", "DataLossError", "OutOfRangeError", "UnimplementedError")
# Clients of remote storage whose exceptions are not OSErrors.
_STORAGE_CLIENTS = ("gcsfs", "fsspec", "aiohttp", "google.auth", "google.api_core", "google.cloud", "requests")


def _traceback_wanted() -> bool:
  return os.environ.get(TRACEBACK_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def _message(e: BaseException) -> str:
  """The exception's own text (TensorFlow's errors keep theirs in `.message`, without the op's context)."""
  message = getattr(e, "message", None)
  return message if isinstance(message, str) and message else str(e)


def exit_code(e: BaseException) -> int | None:
  """The exit code of an error the CLI reports in one line (docs/cli.md, "Exit codes"); None for anything else
  (a bug), which keeps its traceback."""
  code = getattr(e, "exit_code", None)
  if isinstance(code, int) and not isinstance(code, bool):
    return code
  if isinstance(e, KeyboardInterrupt):
    return EXIT_INTERRUPTED
  if isinstance(e, FloatingPointError):
    return EXIT_NON_FINITE
  name, module = type(e).__name__, type(e).__module__ or ""
  status = _message(e).lstrip().split(":", 1)[0]
  if isinstance(e, MemoryError) or status == "RESOURCE_EXHAUSTED" or name == "ResourceExhaustedError":
    return EXIT_OUT_OF_MEMORY
  if isinstance(e, StorageError) or status in _STORAGE_STATUS or module.startswith(_STORAGE_CLIENTS):
    return EXIT_STORAGE
  if module.startswith("tensorflow"):
    return EXIT_BAD_INPUT if name in _TF_INPUT_ERRORS else EXIT_STORAGE
  if isinstance(e, (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError)):
    return EXIT_BAD_INPUT  # a path given that is not what it should be
  if isinstance(e, OSError):  # a full disk, a refused write, an I/O error
    return EXIT_STORAGE
  if isinstance(e, (ValueError, ImportError)):  # GinError and IncompatibleModelDirError are ValueErrors
    return EXIT_BAD_INPUT
  if isinstance(e, TypeError) and _configurable(e):  # a value of the wrong type where gin builds an object
    return EXIT_BAD_INPUT
  return None


def _configurable(e: BaseException) -> str | None:
  """The configurable gin was calling when `e` was raised (gin appends "In call to configurable 'X'")."""
  found = re.search(r"In call to configurable '([\w.]+)'", str(e))
  return found.group(1) if found else None


def error_line(e: BaseException) -> str:
  """What `remixer-t5: error:` is followed by: the message as its raiser wrote it, on one line (quiet.one_line);
  a foreign storage client's error and a message-less one are named by their type."""
  if isinstance(e, KeyboardInterrupt):
    return "interrupted"
  text = quiet.one_line(_message(e))
  if not text:
    return type(e).__name__
  if isinstance(e, TypeError) and _configurable(e):  # the message alone does not say where
    return f"{text} (in {_configurable(e)}: a binding of the wrong type?)"
  return f"{type(e).__name__}: {text}" if (type(e).__module__ or "").startswith(_STORAGE_CLIENTS) else text


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  try:
    files, bindings, paths, rest = split_flags(argv)
    args = build_parser().parse_args(rest)
    args.argv = argv
    if args.command == "bench":
      check_bench_flags(args.what, rest)
    if _PIN_ERROR is not None:
      raise _PIN_ERROR
    if _PINNED:
      _stderr(f"cores: this process runs on {','.join(map(str, _PINNED))} (${runtime.CPUS_ENV})")
    runtime.pin_cpu_without_tpu_chips()  # libtpu without TPU chips (the .[tpu] extra): no TPU runtime start
    if args.command in ("train", "eval", "infer", "plot", "bench", "repro"):
      # before JAX starts its threads: see runtime's docstring
      runtime.configure(log=_stderr, verbose=getattr(args, "verbose", False))
    if args.command in ("train", "eval", "infer"):
      from remixer_t5.training import distributed
      distributed.maybe_initialize(args.coordinator_address, args.num_processes, args.process_id, args.distributed)
    files, bindings = _custom_data(args, files, bindings)
    if getattr(args, "profile_steps", None):
      bindings = [*bindings, f"run_config.Schedule.profile_steps={args.profile_steps!r}"]
    if files or bindings:
      # Only train and eval read or write MODEL_DIR; the others (info, tasks, ...) take a run's gin files as
      # they are, with its `MODEL_DIR = %gin.REQUIRED` left unset.
      parse_gin(files, bindings, paths,
                macro_defaults=None if args.command in ("train", "eval") else {"MODEL_DIR": "None"})
      if args.command in ("train", "eval", "infer"):
        _check_model_dir()
    elif args.command in ("train", "eval", "infer", "info", "compile", "sweep"):
      raise GinError(f"`{args.command}` needs a config: --gin_file=... (see gin/ for models and runs)")
    else:  # export-hf/plot then read the checkpoint's own gin, never a config left by an earlier main() call
      import gin
      gin.clear_config()
    return {"train": cmd_train, "eval": cmd_eval, "infer": cmd_infer, "tasks": cmd_tasks, "info": cmd_info, "import-hf": cmd_import_hf,
            "export-hf": cmd_export_hf, "plot": cmd_plot, "bench": cmd_bench, "compare": cmd_compare,
            "compile": cmd_compile, "repro": cmd_repro, "sweep": cmd_sweep}[args.command](args)
  except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - mapped below; anything else keeps its traceback
    code = exit_code(e)
    if code is None:  # not a cause the user can act on: a bug, shown whole
      raise
    if _traceback_wanted():
      traceback.print_exception(e)
    print(f"remixer-t5: error: {error_line(e)}", file=sys.stderr, flush=True)
    return code


def console_main() -> int:
  """The `remixer-t5` command: `main`, then the process's exit. After a wait on storage was given up (its
  client's threads still blocked: storage.bounded) the interpreter would wait for them at exit, so the process
  ends at once with the code instead."""
  code = main()
  from remixer_t5 import storage
  if storage.ABANDONED:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  return code


if __name__ == "__main__":
  sys.exit(console_main())
