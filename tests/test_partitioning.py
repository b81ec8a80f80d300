"""Rule sets, presets, divisibility fallback, Adafactor state shardings and `info --show-sharding` (1 CPU device,
abstract meshes); real sharding and FSDP training on 8 CPU devices in one subprocess."""

import functools
import logging
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from optax import FactoredState

from remixer_t5 import info
from remixer_t5.model import models, network
from remixer_t5.training import optim, partitioning

# t5x standard_logical_axis_rules (t5x/partitioning.py) for activation_partitioning_dims=1 and
# parameter_partitioning_dims 1 and 2, copied as the reference.
T5X_1D = [
  ("batch", "data"),
  ("vocab", "model"),
  ("embed", None),
  ("mlp", "model"),
  ("heads", "model"),
  ("kv", None),
  ("joined_kv", "model"),
]
T5X_2D = [
  ("batch", "data"),
  ("vocab", "model"),
  ("mlp", "model"),
  ("heads", "model"),
  ("kv", None),
  ("joined_kv", "model"),
  ("embed", "data"),
]
T5X_REPLICATED = [("relpos_buckets", None), ("length", None)]

# Which mesh axis each rule kind gives a parameter axis (the module docstring's table, written out).
SHARDED = {
  "data": {},
  "data_model": {"vocab": "model", "mlp": "model", "heads": "model", "joined_kv": "model"},
  "fsdp": {"vocab": "model", "mlp": "model", "heads": "model", "joined_kv": "model", "embed": "data"},
}


def tiny(**kw):
  cfg = dict(vocab_size=64, emb_dim=16, num_heads=4, head_dim=8, mlp_dim=32, num_encoder_layers=1, num_decoder_layers=1)
  cfg.update(kw)
  return models.EncoderDecoderModel(network.Transformer(network.T5Config(**cfg)))


def abstract_variables(model):
  shapes = {"encoder_input_tokens": (1, 8), "decoder_input_tokens": (1, 4), "decoder_target_tokens": (1, 4)}
  return jax.eval_shape(lambda r: model.init_variables(r, shapes), jax.random.PRNGKey(0))


@pytest.mark.parametrize("kind,reference", [("data_model", T5X_1D + T5X_REPLICATED), ("fsdp", T5X_2D + T5X_REPLICATED)])
def test_rule_sets_place_t5x_axes_as_t5x_does(kind, reference):
  rules = partitioning.logical_rules(kind)
  for names in [
    ("embed", "mlp"),
    ("mlp", "embed"),
    ("vocab", "embed"),
    ("embed", "joined_kv"),
    ("heads", "relpos_buckets"),
    ("batch", "length", "embed"),
    ("batch", "length", "heads", "kv"),
    ("embed",),
  ]:
    assert flax_spec(names, rules) == flax_spec(names, tuple(reference)), names


def flax_spec(names, rules):
  from flax import linen as nn

  return nn.logical_to_mesh_axes(names, rules)


def test_data_rules_replicate_parameters_and_split_the_batch_everywhere():
  rules = partitioning.logical_rules("data")
  assert flax_spec(("vocab", "embed"), rules) == P(None, None)
  assert flax_spec(("embed", "mlp"), rules) == P(None, None)
  assert flax_spec(("batch", "length"), rules) == P(("data", "model"), None)
  assert partitioning.logical_rules() == partitioning.DEFAULT_RULES == partitioning.logical_rules("data_model")
  with pytest.raises(ValueError, match="fsdp"):
    partitioning.logical_rules("zero3")


def test_presets_give_documented_meshes_and_a_mismatch_names_both_counts():
  plan = lambda s, n=None: partitioning.mesh_plan(1, s, n)
  kind = lambda s, n=None: partitioning.rules_kind(plan(s, n)[1])
  assert plan("tpu_v3_8", 8)[0] == (8, 1) and kind("tpu_v3_8") == "fsdp"
  assert plan("tpu_v3_32", 32)[0] == (32, 1) and kind("tpu_v3_32") == "fsdp"
  assert plan("tpu_v3_128", 128)[0] == (128, 1) and kind("tpu_v3_128") == "fsdp"
  assert plan("tpu_v3_128_xl", 128)[0] == (32, 4) and kind("tpu_v3_128_xl") == "fsdp"
  assert plan("gpu_8", 8)[0] == (8, 1) and kind("gpu_8") == "fsdp"
  assert plan("cpu", 3)[0] == (3, 1) and kind("cpu") == "data"
  assert plan("4x2")[0] == (4, 2) and plan((2, 4))[0] == (2, 4)
  assert partitioning.mesh_plan(2, None, 8)[0] == (4, 2)
  spec = partitioning.mesh_spec(preset="gpu_8", rules="data")
  assert plan(spec, 8)[0] == (8, 1) and kind(spec) == "data"
  with pytest.raises(ValueError) as e:
    partitioning.make_mesh(shape="tpu_v3_32")  # 1 device here
  assert "tpu_v3_32" in str(e.value) and "32 devices" in str(e.value) and "jax.device_count() = 1" in str(e.value)
  for bad in ["tpu_v4_8", "4x", (2, 2, 2)]:
    with pytest.raises(ValueError):
      plan(bad)
  with pytest.raises(ValueError, match="preset"):
    plan(partitioning.mesh_spec(preset="gpu_8", num_partitions=2), 8)
  part = partitioning.partitioner("cpu")
  assert dict(part.mesh.shape) == {"data": 1, "model": 1} and part.rules == partitioning.RULE_SETS["data"]
  fsdp = partitioning.partitioner("cpu", rules="fsdp")  # an equal mesh with other rules: each keeps its own
  assert fsdp.mesh == part.mesh and fsdp.data_sharding().spec == P("data") and fsdp.kind == "fsdp"
  assert part.data_sharding().spec == P(("data", "model")) and part.kind == "data"
  part = partitioning.partitioner(partitioning.mesh_spec(shape="1x1", rules="data"))  # as the trainer builds it
  assert part.data_sharding().spec == P(("data", "model"))
  assert partitioning.data_sharding(part.mesh).spec == P("data")  # the module's functions: DEFAULT_RULES unless given


def test_indivisible_dimensions_fall_back_to_replicated_and_are_logged(caplog):
  model = tiny(vocab_size=66, num_heads=3, emb_dim=9)  # 66 % 4, 3 % 4 and 9 % 2 do not divide
  v = abstract_variables(model)
  part = partitioning.partitioner((2, 4), rules="fsdp", abstract=True)
  mesh = part.mesh
  with caplog.at_level(logging.WARNING, logger="remixer_t5.training.partitioning"):
    sh = part.param_shardings(v["params_axes"], params=v["params"])
  assert sh["token_embedder"]["embedding"].spec == P(None, None)  # (vocab 66, embed 9)
  assert sh["encoder"]["relpos_bias"]["rel_embedding"].spec == P(None, None)  # (heads 3, buckets)
  assert sh["encoder"]["layers_0"]["mlp"]["wi_0"]["kernel"].spec == P(None, "model")  # (9, 32)
  assert sh["encoder"]["layers_0"]["attention"]["query"]["kernel"].spec == P(None, "model")  # (9, 24)
  assert "['token_embedder']['embedding']" in caplog.text and "['encoder']['relpos_bias']" in caplog.text
  for s, p in zip(jax.tree_util.tree_leaves(sh), jax.tree_util.tree_leaves(v["params"])):
    assert all(d % n == 0 for d, n in zip(p.shape, s.shard_shape(p.shape)))
  # Shardings built without the shapes fail with a clear error before jit would.
  raw = part.param_shardings(v["params_axes"])
  tx = optim.adafactor(optim.constant_schedule(1e-2))
  with pytest.raises(ValueError, match="rel_embedding"):
    partitioning.opt_state_shardings(jax.eval_shape(tx.init, v["params"]), v["params"], raw, mesh)


def test_adafactor_factored_statistics_shard_like_their_parameter():
  v = abstract_variables(tiny())
  part = partitioning.partitioner((2, 4), rules="fsdp", abstract=True)
  tx = optim.adafactor(optim.constant_schedule(1e-2), min_dim_size_to_factor=4)
  sh = part.param_shardings(v["params_axes"], params=v["params"])
  state = jax.eval_shape(tx.init, v["params"])
  opt = part.opt_state_shardings(state, v["params"], sh)
  factored = lambda t: [
    x
    for x in jax.tree_util.tree_leaves(t, is_leaf=lambda x: isinstance(x, FactoredState))
    if isinstance(x, FactoredState)
  ]
  (fstate,), (fsh,) = factored(state), factored(opt)
  get = lambda t, *path: functools.reduce(lambda a, k: a[k], path, t)
  # Reference: optax averages v_row over the parameter's largest axis, v_col over the other one.
  cases = {
    ("encoder", "layers_0", "mlp", "wi_0", "kernel"): ((16,), P("data"), (32,), P("model")),  # (16, 32)
    ("encoder", "layers_0", "mlp", "wo", "kernel"): ((16,), P("data"), (32,), P("model")),  # (32, 16)
    ("token_embedder", "embedding"): ((16,), P("data"), (64,), P("model")),
  }  # (64, 16)
  for path, (row_shape, row_spec, col_shape, col_spec) in cases.items():
    assert get(fstate.v_row, *path).shape == row_shape and get(fsh.v_row, *path).spec == row_spec, path
    assert get(fstate.v_col, *path).shape == col_shape and get(fsh.v_col, *path).spec == col_spec, path
    assert get(fsh.v_row, *path).shard_shape(row_shape) == (row_shape[0] // 2,)
  # Unfactored parameters keep the full second moment, sharded like the parameter.
  scale = ("encoder", "encoder_norm", "scale")
  assert get(fstate.v, *scale).shape == (16,) and get(fsh.v, *scale).spec == P("data")
  assert get(fsh.v_row, *scale).spec == P()


def test_layerwise_adafactor_statistics_of_a_scanned_stack_shard_like_their_parameter():
  v = abstract_variables(tiny(num_encoder_layers=2, num_decoder_layers=2, scan_layers=True))
  part = partitioning.partitioner((2, 4), rules="fsdp", abstract=True)
  tx = optim.layerwise(optim.adafactor(optim.constant_schedule(1e-2), min_dim_size_to_factor=4))
  sh = part.param_shardings(v["params_axes"], params=v["params"])
  state = jax.eval_shape(tx.init, v["params"])
  opt = part.opt_state_shardings(state, v["params"], sh)
  is_factored = lambda x: isinstance(x, FactoredState)
  pick = lambda t: [x for x in jax.tree_util.tree_leaves(t["layers"], is_leaf=is_factored) if is_factored(x)][0]
  fstate, fsh = pick(state.inner_states), pick(opt.inner_states)
  get = lambda t, *path: functools.reduce(lambda a, k: a[k], path, t)
  # Per layer slice (16, 32): v_row averages the 32 axis away, v_col the 16 one; 'layers' stays unsplit.
  wi = ("encoder", "layers", "mlp", "wi_0", "kernel")
  assert get(sh, *wi).spec == P(None, "data", "model")
  assert get(fstate.v_row, *wi).shape == (2, 16) and get(fsh.v_row, *wi).spec == P(None, "data")
  assert get(fstate.v_col, *wi).shape == (2, 32) and get(fsh.v_col, *wi).spec == P(None, "model")
  # Leaves owned by the other branch stay masked in both trees.
  assert isinstance(
    get(fsh.v_row, "token_embedder", "embedding"), type(get(fstate.v_row, "token_embedder", "embedding"))
  )
  assert jax.tree_util.tree_structure(opt) == jax.tree_util.tree_structure(state)


def test_show_sharding_for_tpu_v3_32_needs_no_devices():
  assert jax.device_count() == 1
  model = tiny(vocab_size=2176, emb_dim=128, num_heads=4, head_dim=32, mlp_dim=256)
  lengths = {"inputs": 16, "targets": 8}
  out = info.format_sharding(model, lengths, mesh="tpu_v3_32", rules="data_model")
  assert "'data': 32, 'model': 1" in out and "32 devices" in out and "rules data_model" in out
  out = info.format_sharding(model, lengths, mesh="tpu_v3_32")  # the preset's rules: fsdp
  line = next(l for l in out.splitlines() if "['encoder']['layers_0']['mlp']['wi_0']['kernel']" in l)
  assert "(128, 256)" in line and "('embed', 'mlp')" in line and "P('data', 'model')" in line
  assert line.rstrip().endswith("(4, 256)")
  # Independent reference: fsdp on (32, 1) splits every parameter with an 'embed' axis 32 ways.
  v = abstract_variables(model)
  names = partitioning.logical_axes(v["params_axes"])
  total = per_device = 0
  for p, n in zip(
    jax.tree_util.tree_leaves(v["params"]), jax.tree_util.tree_leaves(names, is_leaf=lambda x: isinstance(x, P))
  ):
    total += 4 * int(np.prod(p.shape))
    per_device += 4 * int(np.prod(p.shape)) // (32 if "embed" in tuple(n) else 1)
  assert (
    f"params: {total / 2**20:,.2f} MiB ({total:,} bytes) in all, {per_device / 2**20:,.2f} MiB "
    f"({per_device:,} bytes) per device" in out
  )
  assert "optimizer state:" in out


def test_partitioning_gin_files_bind_the_trainer_mesh():
  import gin
  from remixer_t5 import gin_utils

  expect = {
    "data_parallel": (None, "data"),
    "data_model": (None, "data_model"),
    "fsdp": (None, "fsdp"),
    "tpu_v3_8": ((8, 1), "fsdp"),
    "tpu_v3_8_large": ((8, 1), "fsdp"),
    "tpu_v3_32": ((32, 1), "fsdp"),
    "tpu_v3_128": ((128, 1), "fsdp"),
    "tpu_v3_128_xl": ((32, 4), "fsdp"),
    "gpu_8": ((8, 1), "fsdp"),
  }
  for name, (shape, kind) in expect.items():
    gin_utils.parse_gin(
      ["models/t5_1_1/tiny.gin", "runs/pretrain.gin", f"partitioning/{name}.gin"], ["MODEL_DIR='/tmp/unused'"]
    )
    spec = gin.query_parameter("run_config.Training.mesh").scoped_configurable_fn()
    plan, rules = partitioning.mesh_plan(1, spec, None)
    assert (shape is None or plan == shape) and partitioning.rules_kind(rules) == kind, name
    # Only the large-model file turns rematerialisation on (it does not fit a v3-8 core without it).
    remat = gin.query_parameter("network.T5Config.remat_policy") if name == "tpu_v3_8_large" else None
    assert remat == ("full" if name == "tpu_v3_8_large" else None), name
  gin_utils.parse_gin(
    ["models/t5_1_1/tiny.gin", "runs/pretrain.gin", "partitioning/tpu_v3_128.gin", "partitioning/data_parallel.gin"],
    ["MODEL_DIR='/tmp/unused'"],
  )
  plan, rules = partitioning.mesh_plan(1, gin.query_parameter("run_config.Training.mesh").scoped_configurable_fn())
  assert plan == (128, 1) and partitioning.rules_kind(rules) == "data"
  gin.clear_config()


SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax, numpy as np
    from jax.sharding import PartitionSpec as P
    from remixer_t5.model import models, network
    from remixer_t5.training import optim, partitioning, programs, train_state
    from remixer_t5.training import batches as batch_io

    def tiny(**kw):
      cfg = dict(vocab_size=64, emb_dim=16, num_heads=4, head_dim=8, mlp_dim=32, num_encoder_layers=1,
                 num_decoder_layers=1)
      cfg.update(kw)
      return models.EncoderDecoderModel(network.Transformer(network.T5Config(**cfg)))

    model = tiny()
    tx = optim.adafactor(optim.constant_schedule(1e-2), min_dim_size_to_factor=4)
    shapes = train_state.input_shapes({"inputs": 12, "targets": 6})
    SHARDED = %(sharded)r
    # (path, logical axes, shape); the expected shard divides each dim by its mesh axis under the kind.
    PARAMS = [(("encoder", "layers_0", "mlp", "wi_0", "kernel"), ("embed", "mlp"), (16, 32)),
              (("decoder", "layers_0", "mlp", "wo", "kernel"), ("mlp", "embed"), (32, 16)),
              (("token_embedder", "embedding"), ("vocab", "embed"), (64, 16)),
              (("encoder", "layers_0", "attention", "query", "kernel"), ("embed", "joined_kv"), (16, 32)),
              (("encoder", "relpos_bias", "rel_embedding"), ("heads", "relpos_buckets"), (4, 32)),
              (("encoder", "encoder_norm", "scale"), ("embed",), (16,))]
    get = lambda t, path: t[path[0]] if len(path) == 1 else get(t[path[0]], path[1:])
    factored = lambda s: [x for x in jax.tree_util.tree_leaves(s, is_leaf=lambda x: hasattr(x, "v_row"))
                          if hasattr(x, "v_row")][0]

    # One host copy of the state, placed by each mesh's shardings (what the initialiser's jit outputs use).
    lengths = {"inputs": 12, "targets": 6}
    host_state = programs.build(model, tx, lengths, partitioning.partitioner(None, jax.devices()[:1])).init_state(0)
    for shape in [(8, 1), (4, 2), (2, 4)]:
      for kind in ["data", "data_model", "fsdp"]:
        part = partitioning.partitioner(shape, rules=kind)
        mesh, size = part.mesh, dict(part.mesh.shape)
        _, shardings = train_state.abstract_state(model, tx, shapes, part)
        state = jax.device_put(host_state, shardings)
        fs = factored(state.opt_state)
        for path, names, full in PARAMS:
          want = tuple(d // size[SHARDED[kind][n]] if n in SHARDED[kind] else d for n, d in zip(names, full))
          got = get(state.params, path).addressable_shards[0].data.shape
          assert got == want, (shape, kind, path, got, want)
          if len(full) == 2:  # v_row drops the largest axis, v_col the other (optax)
            big = int(np.argmax(full))
            for stat, drop in (("v_row", big), ("v_col", 1 - big)):
              got = getattr(fs, stat)
              got = get(got, path).addressable_shards[0].data.shape
              assert got == want[:drop] + want[drop + 1:], (shape, kind, path, stat, got)
        batch = part.data_sharding()
        rows = batch.shard_shape((8, 12))[0]
        assert rows == (8 // (shape[0] * shape[1]) if kind == "data" else 8 // shape[0]), (kind, rows)
    print("sharded ok")

    # A mesh that does not divide the vocabulary (66) or the heads (3): replicated there, and it runs.
    odd = tiny(vocab_size=66, num_heads=3)
    part = partitioning.partitioner((2, 4), rules="fsdp")
    v = jax.eval_shape(lambda r: odd.init_variables(r, shapes), jax.random.PRNGKey(0))
    sh = part.param_shardings(v["params_axes"], params=v["params"])
    params = jax.device_put(jax.tree_util.tree_map(lambda p: np.zeros(p.shape, p.dtype), v["params"]), sh)
    assert params["token_embedder"]["embedding"].addressable_shards[0].data.shape == (66, 8)
    assert params["encoder"]["relpos_bias"]["rel_embedding"].addressable_shards[0].data.shape == (3, 32)
    print("fallback ok")

    rng = np.random.RandomState(0)
    batches = []
    for _ in range(5):
      tgt = rng.randint(1, 64, (8, 6)).astype(np.int32)
      batches.append({"encoder_input_tokens": rng.randint(1, 64, (8, 12)).astype(np.int32),
                      "decoder_input_tokens": np.concatenate([np.zeros((8, 1), np.int32), tgt[:, :-1]], 1),
                      "decoder_target_tokens": tgt})

    def run(part, constrained=False):
      _, sh = train_state.abstract_state(model, tx, shapes, part)
      state = jax.device_put(host_state, sh)
      bsh = part.data_sharding()
      step = jax.jit(programs.make_train_step(model, tx, None), in_shardings=(sh, bsh), out_shardings=(sh, None))
      ctx = part.activation_sharding() if constrained else __import__("contextlib").nullcontext()
      losses = []
      with ctx:
        n_constraints = step.lower(state, batch_io.global_batch(batches[0], bsh)).as_text().count("sdy.sharding_constraint")
        for b in batches:
          state, m = step(state, batch_io.global_batch(b, bsh))
          losses.append(float(m["loss_sum"] / m["weight_sum"]))
      return losses, n_constraints

    ref, _ = run(partitioning.partitioner(None, jax.devices()[:1]))  # host_state: the one-device initialiser's
    fsdp, plain = run(partitioning.partitioner((2, 4), rules="fsdp"))
    np.testing.assert_allclose(fsdp, ref, rtol=1e-5, atol=1e-5)
    act, pinned = run(partitioning.partitioner((2, 4), rules="fsdp"), constrained=True)
    np.testing.assert_allclose(act, ref, rtol=1e-5, atol=1e-5)
    assert pinned > plain, (pinned, plain)  # the activation constraints really were applied
    print("OK", ref, plain, pinned)
""") % {"sharded": SHARDED}


def test_meshes_rule_kinds_and_fsdp_training_on_8_devices():
  out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-4000:]
  assert "OK" in out.stdout, out.stdout


def test_batch_shards_follow_the_rules_and_bad_batches_are_named():
  from jax.sharding import AbstractMesh, AxisType

  mesh = AbstractMesh((32, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  assert partitioning.batch_shards(mesh, "fsdp") == 32  # batch over 'data' only
  assert partitioning.batch_shards(mesh, "data_model") == 32
  assert partitioning.batch_shards(mesh, "data") == 128  # batch over every device
  partitioning.check_batch_size(128, mesh, "data")
  partitioning.check_batch_size(96, mesh, "fsdp")
  with pytest.raises(
    ValueError,
    match=r"BATCH_SIZE=96 does not split .*'data' rules place the batch on 128 "
    r"devices.*multiple of 128",
  ):
    partitioning.check_batch_size(96, mesh, "data")
