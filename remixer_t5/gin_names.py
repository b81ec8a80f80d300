"""A run's gin names that the CLI's errors name: its macros, and the names that moved. Below gin_utils (which adds
MOVED's line to gin's error) and training/run_config; tests/test_gin_names.py holds both to run_config's fields."""

# The macros users know, by the run_config field each is bound to once (gin/runs/*.gin).
MACROS = {"model_dir": "MODEL_DIR", "model": "MODEL", "random_seed": "RANDOM_SEED",
          "init_checkpoint": "INIT_CHECKPOINT", "task": "MIXTURE_OR_TASK_NAME",
          "feature_lengths": "TASK_FEATURE_LENGTHS", "batch_size": "BATCH_SIZE", "vocabulary": "VOCABULARY",
          "data_dir": "DATA_DIR", "train_steps": "TRAIN_STEPS", "checkpoint_period": "CHECKPOINT_PERIOD",
          "eval_period": "EVAL_PERIOD", "log_period": "LOG_PERIOD", "eval_steps": "EVAL_STEPS",
          "infer_eval_task": "INFER_EVAL_TASK", "keep_best_by": "KEEP_BEST_BY",
          "early_stop_patience": "EARLY_STOP_PATIENCE", "early_stop_min_delta": "EARLY_STOP_MIN_DELTA"}

# An old name -> the one to write now. `remixer_t5.<module>`: a module once at the package's top level (a gin
# file's `from remixer_t5 import network`) -> its place. `trainer.<name>`: a run's setting once bound as a
# parameter of trainer.train or trainer.evaluate_checkpoint -> the binding that sets it.
MOVED = {
    "remixer_t5.config": "remixer_t5.model.config", "remixer_t5.layers": "remixer_t5.model.layers",
    "remixer_t5.network": "remixer_t5.model.network", "remixer_t5.models": "remixer_t5.model.models",
    "remixer_t5.decoding": "remixer_t5.model.decoding", "remixer_t5.projection": "remixer_t5.model.projection",
    "remixer_t5.fixed_length": "remixer_t5.model.fixed_length", "remixer_t5.mixers": "remixer_t5.model.mixers",
    "remixer_t5.trainer": "remixer_t5.training.trainer", "remixer_t5.checkpoints": "remixer_t5.training.checkpoints",
    "remixer_t5.optim": "remixer_t5.training.optim", "remixer_t5.partitioning": "remixer_t5.training.partitioning",
    "remixer_t5.accumulate": "remixer_t5.training.accumulate",
    "remixer_t5.metrics_log": "remixer_t5.training.metrics_log", "remixer_t5.plots": "remixer_t5.training.plots",
    "remixer_t5.mfu": "remixer_t5.training.mfu", "remixer_t5.evaluation": "remixer_t5.training.evaluation",
    "remixer_t5.distributed": "remixer_t5.training.distributed", "remixer_t5.bench_train": "remixer_t5.bench.train",
    "remixer_t5.bench_decode": "remixer_t5.bench.decode", "remixer_t5.bench_input": "remixer_t5.bench.input",
    "remixer_t5.bench_env": "remixer_t5.bench.env", "remixer_t5.hf": "remixer_t5.interop.hf",
    "remixer_t5.t5x_compat": "remixer_t5.interop.t5x", "trainer.model_dir": "run_config.Run.model_dir",
    "trainer.model": "run_config.Training.model", "trainer.optimizer": "run_config.Training.optimizer",
    "trainer.random_seed": "run_config.Training.random_seed",
    "trainer.learning_rate": "run_config.Training.learning_rate",
    "trainer.init_checkpoint": "run_config.Training.init_checkpoint",
    "trainer.num_microbatches": "run_config.Training.num_microbatches", "trainer.mesh": "run_config.Training.mesh",
    "trainer.peak_flops_per_device": "run_config.Training.peak_flops_per_device",
    "trainer.task": "run_config.Data.task", "trainer.feature_lengths": "run_config.Data.feature_lengths",
    "trainer.batch_size": "run_config.Data.batch_size", "trainer.vocabulary": "run_config.Data.vocabulary",
    "trainer.data_dir": "run_config.Data.data_dir", "trainer.pack": "run_config.Data.pack",
    "trainer.shuffle": "run_config.Data.shuffle", "trainer.train_steps": "run_config.Schedule.train_steps",
    "trainer.checkpoint_period": "run_config.Schedule.checkpoint_period",
    "trainer.keep_checkpoints": "run_config.Schedule.keep_checkpoints",
    "trainer.log_period": "run_config.Schedule.log_period", "trainer.eval_period": "run_config.Schedule.eval_period",
    "trainer.eval_steps": "run_config.Schedule.eval_steps",
    "trainer.num_decoded_examples": "run_config.Schedule.num_decoded_examples",
    "trainer.infer_eval_period": "run_config.Schedule.infer_eval_period",
    "trainer.infer_eval_task": "run_config.Schedule.infer_eval_task",
    "trainer.infer_examples": "run_config.Schedule.infer_examples",
    "trainer.profile_steps": "run_config.Schedule.profile_steps",
    "trainer.keep_best_by": "run_config.Schedule.keep_best_by",
    "trainer.early_stop_patience": "run_config.Schedule.early_stop_patience",
    "trainer.early_stop_min_delta": "run_config.Schedule.early_stop_min_delta",
    "trainer.task_name": "run_config.Data.task", "trainer.infer_task": "run_config.Schedule.infer_eval_task",
    "trainer.mesh_shape": "run_config.Training.mesh (= @partitioning.mesh_spec())",
    "trainer.num_partitions": "partitioning.mesh_spec.num_partitions (with run_config.Training.mesh = "
                              "@partitioning.mesh_spec())"}
