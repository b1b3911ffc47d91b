"""The runtime loads a bundle and generates with torch and transformers impossible to import."""

import json
import subprocess
import sys

SCRIPT = """
import sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "safetensors"):
            raise ImportError(f"{name} is blocked in this test")

sys.meta_path.insert(0, Block())
import speccompile
runtime = speccompile.load(sys.argv[1])
[spec] = runtime.generate([[5, 6, 7]], max_new_tokens=6)
[base] = runtime.generate([[5, 6, 7]], max_new_tokens=6, mode="autoregressive")
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
print(json.dumps({"spec": spec.token_ids, "base": base.token_ids, "loaded": loaded}))
"""


def test_runtime_runs_without_torch_or_transformers(bundles):
    bundle = bundles("llama", "random")
    proc = subprocess.run([sys.executable, "-c", "import json\n" + SCRIPT, str(bundle)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["loaded"] == []
    assert result["spec"] == result["base"] and len(result["spec"]) > 0


def test_cli_generate_runs_without_torch(bundles):
    bundle = bundles("gpt2", "copy")
    code = SCRIPT.split("import speccompile")[0] + "from speccompile.cli import main\nmain()"
    args = ["generate", str(bundle), "--prompt", "def f(x):", "--max-new-tokens", "5", "--json"]
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    [result] = json.loads(proc.stdout)
    assert set(result) == {"prompt", "text", "token_ids", "finish_reason", "stats"}
