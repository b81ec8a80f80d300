"""`remixer-t5 tasks [NAME]`: what is registered, and what a task's preprocessed examples look like."""

from __future__ import annotations

import argparse
from typing import Mapping

import seqio

from remixer_t5.commands import common
from remixer_t5.tasks import sources
from remixer_t5.tasks.lookup import get_mixture_or_task


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("name", nargs="?", help="a task or mixture: show its first examples as text and token ids")
  p.add_argument("--split", default="train")
  p.add_argument("--num", "-n", type=int, default=3, help="examples to show (default 3)")
  p.add_argument("--lengths", help="INPUTS,TARGETS truncation lengths (default: none)")
  p.add_argument("--data_dir", "--data-dir", help="local dataset files (default: $REMIXER_T5_DATA_DIR)")


def main(args: argparse.Namespace) -> int:
  common.load_gin(args)  # a gin file may register tasks of its own
  if args.data_dir:
    sources.set_data_dir(args.data_dir)
  print(
    show(args.name, split=args.split, num=args.num, feature_lengths=common.parse_lengths(args.lengths))
    if args.name
    else list_tasks()
  )
  return 0


def list_tasks() -> str:
  """One line per registered task (its splits) and mixture (its tasks)."""
  lines = ["tasks:"]
  for name in sorted(seqio.TaskRegistry.names()):
    task = seqio.TaskRegistry.get(name)
    lines.append(f"  {name:32s} splits: {', '.join(task.splits)}")
  lines.append("mixtures:")
  for name in sorted(seqio.MixtureRegistry.names()):
    mix = seqio.MixtureRegistry.get(name)
    lines.append(f"  {name:32s} {len(mix.tasks)} tasks: {', '.join(t.name for t in mix.tasks)}")
  return "\n".join(lines)


def _rate(mix: seqio.Mixture, task: seqio.Task) -> str:
  try:
    return f"{mix.get_rate(task):g}"
  except Exception as e:  # noqa: BLE001 - rates may need data that is not here; say why
    return f"unknown ({type(e).__name__}: {str(e)[:120]})"


def show(name: str, *, split: str = "train", num: int = 3, feature_lengths: Mapping[str, int] | None = None) -> str:
  """The task's (or each of a mixture's tasks') first ``num`` preprocessed examples as text and token ids."""
  provider = get_mixture_or_task(name)
  if isinstance(provider, seqio.Mixture):
    parts = [f"mixture {name}: {len(provider.tasks)} tasks"]
    parts += [f"  {task.name}: rate {_rate(provider, task)}" for task in provider.tasks]
    for task in provider.tasks:
      parts += ["", show(task.name, split=split, num=num, feature_lengths=feature_lengths)]
    return "\n".join(parts)
  task = provider
  if split not in task.splits:
    raise ValueError(f"task {name!r} has no split {split!r}; its splits: {', '.join(task.splits)}")
  out = [
    f"task {name} | split {split} | source {task.source!r}",
    f"  metrics: {', '.join(getattr(f, '__name__', repr(f)) for f in task.metric_fns) or 'none'}",
  ]
  ds = task.get_dataset(
    sequence_length=dict(feature_lengths) if feature_lengths else None,
    split=split,
    shuffle=False,
    num_epochs=1,
    use_cached=False,
    try_in_mem_cache=False,
  )
  for i, ex in enumerate(ds.take(num).as_numpy_iterator()):
    out.append(f"-- example {i}")
    for key, feature in task.output_features.items():
      if key not in ex:
        continue
      ids = [int(t) for t in ex[key]]
      out.append(f"  {key} ({len(ids)} tokens): {feature.vocabulary.decode(ids)}")
      out.append(f"  {key} ids: {ids[:64]}{' ...' if len(ids) > 64 else ''}")
      raw = ex.get(f"{key}_pretokenized")
      if raw is not None:
        out.append(f"  {key}_pretokenized: {raw.decode('utf-8') if isinstance(raw, bytes) else raw}")
  return "\n".join(out)
