"""The process-wide ONNX Runtime thread pool (shared_threads): made only where asked and possible,
used by every session of a process that has it, and producing the same tokens as pools per session.

Each case runs in a fresh interpreter: the pool belongs to a process, and this one (see conftest)
has started ONNX Runtime without it."""

import json
import os
import subprocess
import sys
import time

import pytest

import speccompile
from speccompile.bundle import RACY_NS, open_bundle

PROMPT = [5, 17, 33, 2, 9, 100, 7]


def run_python(code: str, *args, shared: str = "1") -> subprocess.CompletedProcess:
    env = {**os.environ, "SPECCOMPILE_SHARED_THREADS": shared}  # conftest switched it off for this process
    result = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=300,
                            env=env)
    assert result.returncode == 0, result.stderr
    return result


GENERATE = """
import json, sys
import speccompile
{before}
runtime = speccompile.load(sys.argv[1], shared_threads=True)
[result] = runtime.generate([{prompt}], max_new_tokens=16, gamma=4)
again = speccompile.load(sys.argv[1])  # asks for nothing: a process with the pool must use it anyway
twice = speccompile.load(sys.argv[1], shared_threads=True)  # asks again: the pool is there already
print(json.dumps({{"shared": [runtime.target.shared_pool, runtime.draft.shared_pool, again.target.shared_pool,
                             twice.draft.shared_pool],
                  "tokens": result.token_ids}}))
"""


def test_a_fresh_process_gets_the_shared_pool_and_the_same_tokens(bundles):
    bundle = bundles("llama", "copy")
    expected = speccompile.load(bundle).generate([PROMPT], max_new_tokens=16, gamma=4)[0].token_ids  # pools per session
    out = json.loads(run_python(GENERATE.format(before="", prompt=PROMPT), bundle).stdout)
    assert out == {"shared": [True, True, True, True], "tokens": expected}


def test_switched_off_the_pool_is_never_made(bundles):
    result = run_python(GENERATE.format(before="", prompt=PROMPT), bundles("llama", "copy"), shared="0")
    assert json.loads(result.stdout)["shared"] == [False, False, False, False]


def test_a_process_with_the_pool_binds_plain_sessions_too():
    """Why shared_threads is not the API's default: an application's own default session fails."""
    code = """
import onnxruntime
from speccompile.runtime.onnxruntime_engine import shared_thread_pool, _process_has_shared_pool
assert not _process_has_shared_pool()
assert shared_thread_pool()
"""
    run_python(code)


@pytest.mark.slow
@pytest.mark.parametrize("command", [["generate", "--prompt", "import os", "--max-new-tokens", "4"],
                                     ["profile", "--batch-sizes", "1", "--context-lengths", "16", "--repeats", "1",
                                      "--rounds", "1", "--ops"]])
def test_cli_runs_on_the_shared_pool(bundles, tmp_path, command):
    import shutil

    bundle = shutil.copytree(bundles("llama", "copy"), tmp_path / "bundle")  # profile writes into it
    if command[0] == "profile":
        (tmp_path / "prompts.txt").write_text("import os\ndef f(x):\n")
        command = [*command, "--prompts", tmp_path / "prompts.txt"]
    code = ("import sys, onnxruntime; from speccompile.cli import main\n"
            "from speccompile.runtime.onnxruntime_engine import _process_has_shared_pool\n"
            "main(sys.argv[1:], standalone_mode=False)\n"
            "print('shared pool:', _process_has_shared_pool())")
    result = run_python(code, command[0], bundle, *command[1:])
    assert "shared pool: True" in result.stdout
    if command[0] == "profile":
        assert "top ops by share" in result.stdout  # per-op profiling sessions join the shared pool too


DEFAULT = """
import json, sys
import numpy as np, onnxruntime
from onnx import TensorProto, helper
import speccompile
runtime = speccompile.load(sys.argv[1])
[result] = runtime.generate([{prompt}], max_new_tokens=16, gamma=4)
x, y = (helper.make_tensor_value_info(name, TensorProto.FLOAT, [1]) for name in "xy")
model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "app", [x], [y]),
                          opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
own = onnxruntime.InferenceSession(model.SerializeToString())  # the application's own, default options
print(json.dumps({{"shared": runtime.target.shared_pool, "tokens": result.token_ids,
                  "own": own.run(None, {{"x": np.array([-1.0], np.float32)}})[0].tolist()}}))
"""


def test_the_default_binds_nothing_and_releases_its_threads_after_every_run(bundles):
    """load() with no arguments: pools per session (an application's own default session still
    works after it), each releasing its threads when a run ends; the same tokens as the shared pool."""
    from speccompile.runtime.onnxruntime_engine import session_options

    bundle = bundles("llama", "copy")
    shared = json.loads(run_python(GENERATE.format(before="", prompt=PROMPT), bundle).stdout)["tokens"]
    out = json.loads(run_python(DEFAULT.format(prompt=PROMPT), bundle).stdout)
    assert out == {"shared": False, "tokens": shared, "own": [0.0]}
    options = session_options()
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "1"
    assert options.get_session_config_entry("session.force_spinning_stop") == "1"
    assert session_options(spinning=False).get_session_config_entry("session.intra_op.allow_spinning") == "0"
    for options in (session_options(), session_options(shared_pool=True)):  # pre-packing on the threads too
        assert options.get_session_config_entry("session.prepack.enable_parallel") == "1"


def test_the_probe_is_the_model_onnx_makes_and_a_load_imports_no_onnx(bundles):
    """The shared-pool probe is kept as bytes so that load() and a first token never import onnx
    (about 1 s of a real-size model's start): the bytes are onnx.helper's model, and a fresh process
    that loads a bundle and generates has not imported it, nor asyncio (50 ms; async callers only)."""
    from onnx import TensorProto, helper

    from speccompile.runtime.onnxruntime_engine import PROBE_MODEL

    x, y = (helper.make_tensor_value_info(name, TensorProto.FLOAT, [1]) for name in "xy")
    probe = helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    assert probe.SerializeToString() == PROBE_MODEL
    code = ("import sys, speccompile\n"
            "speccompile.load(sys.argv[1]).generate([[5, 6, 7]], max_new_tokens=4)\n"
            "print(sorted(m for m in ('onnx', 'torch', 'transformers', 'asyncio') if m in sys.modules))")
    bundle = bundles("llama", "copy")
    time.sleep(RACY_NS / 1e9)  # a file changed just before its stamp is hashed again at the next open
    open_bundle(bundle)  # vouched for: a bundle's first open after it was copied checks its graphs (with onnx)
    assert run_python(code, bundle).stdout.strip() == "[]"
