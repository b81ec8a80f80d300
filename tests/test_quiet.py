"""Start-up output: TensorFlow's native start-up lines are hidden unless $REMIXER_T5_VERBOSE is set."""
import os
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    from remixer_t5 import quiet
    quiet.configure()
    import tensorflow as tf
    print(tf.data.Dataset.range(3).reduce(tf.constant(0, tf.int64), lambda a, b: a + b).numpy())  # TF's devices are set up here
    print("gpus visible to tf:", len(tf.config.get_visible_devices("GPU")))
""")


def _run(code, **env):
  full = {**os.environ, **env}
  full.pop("TF_CPP_MIN_LOG_LEVEL", None) if "TF_CPP_MIN_LOG_LEVEL" not in env else None
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=300)


@pytest.mark.integration
def test_tensorflow_start_up_lines_are_hidden_unless_verbose():
  loud = _run(PROBE, REMIXER_T5_VERBOSE="1")
  quiet = _run(PROBE)
  assert loud.returncode == 0 and quiet.returncode == 0, loud.stderr + quiet.stderr
  assert quiet.stdout == loud.stdout and "3\n" in quiet.stdout  # the same work was done
  assert "gpus visible to tf: 0" in quiet.stdout
  noise = [line for line in loud.stderr.splitlines() if line.strip()]
  if not noise:
    pytest.skip("TensorFlow printed nothing at start-up on this machine; nothing to hide")
  assert quiet.stderr.strip() == "", quiet.stderr


def test_a_failing_tensorflow_import_shows_what_it_printed(tmp_path):
  fake = tmp_path / "tensorflow"
  fake.mkdir()
  (fake / "__init__.py").write_text(
      "import os\nos.write(2, b'native: libfoo.so missing\\n')\nraise ImportError('broken tensorflow')\n")
  code = "from remixer_t5 import quiet\nquiet.configure()\nimport tensorflow\n"
  out = _run(code, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
  assert out.returncode != 0
  assert "native: libfoo.so missing" in out.stderr and "broken tensorflow" in out.stderr


def test_cli_prints_only_its_own_lines_at_start_up():
  out = subprocess.run([sys.executable, "-m", "remixer_t5", "tasks"], capture_output=True, text=True,
                       env={k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}, timeout=300)
  assert out.returncode == 0, out.stderr
  for needle in ("absl::InitializeLog", "oneDNN", "cudart_stub", "cuInit", "libtpu", "TPU accelerator type"):
    assert needle not in out.stderr, out.stderr
