"""Builds that cannot leave a half-bundle: killed at any point, out of disk, or racing another build
into the same directory, the output appears whole by one rename or not at all, the next build cleans
what a killed one left, and a damaged demo cache entry is rebuilt."""

import errno
import logging
import signal
import subprocess
import sys
import time

import pytest

from speccompile.bundle import verify_bundle
from speccompile.errors import SpecCompileError


def build_command(checkpoints, out) -> list[str]:
    target = checkpoints("llama")
    return [sys.executable, "-m", "speccompile", "build", "--target", str(target), "--draft", str(target),
            "--out", str(out), "--gamma", "1", "--max-seq", "32", "--max-batch", "1"]


def leftovers(out) -> list[str]:
    return sorted(p.name for p in out.parent.glob(f".{out.name}.*"))


def staged(out, earlier: tuple[str, ...] = ()) -> list:
    """The files a running build has written so far into its staging directory (not those of the
    `earlier` staging directories, which killed builds left)."""
    return [f for d in out.parent.glob(f".{out.name}.build-*") if d.name not in earlier for f in d.rglob("*")]


# the points a build is killed at: its staging directory made, its first graph written, its tokenizer
# written (after every graph was checked, before the manifest)
KILL_POINTS = {"staging": lambda files: True, "a graph": lambda files: any(f.suffix == ".onnx" for f in files),
               "the tokenizer": lambda files: any(f.name == "tokenizer" for f in files)}


@pytest.mark.slow
def test_a_build_killed_at_any_point_leaves_no_bundle_and_the_next_one_cleans_up(checkpoints, tmp_path):
    """Killed at each point in turn: no bundle, only its staging directory (the build after it, killed
    at the next point, has removed the one before); then a build that finishes leaves the bundle alone."""
    out = tmp_path / "bundle"
    for point, reached in KILL_POINTS.items():
        before = tuple(leftovers(out))
        build = subprocess.Popen(build_command(checkpoints, out), stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        while build.poll() is None and not (set(leftovers(out)) - set(before) and reached(staged(out, before))):
            time.sleep(0.001)
        build.send_signal(signal.SIGKILL)
        build.wait(30)
        if out.exists():  # it finished in the moment before the kill: a whole bundle
            assert verify_bundle(out)
            pytest.skip(f"the build finished before it could be killed at {point}")
        left = leftovers(out)
        assert len(left) == 1 and left[0] not in before, (point, before, left)  # its own staging directory
    finished = subprocess.run(build_command(checkpoints, out), capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert verify_bundle(out) and leftovers(out) == []


def test_a_full_disk_fails_with_one_line_and_leaves_nothing(checkpoints, tmp_path, monkeypatch):
    from speccompile.compiler import build
    from speccompile.compiler.onnx_graph import WeightFile

    def no_space(self, path):
        path.write_bytes(b"\0" * 1024)  # some of it written, as a full disk leaves it
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(WeightFile, "write", no_space)
    out = tmp_path / "bundle"
    target = checkpoints("llama")
    with pytest.raises(SpecCompileError, match=r"no space left on .* what the build wrote is removed"):
        build.build_bundle(target, target, out, gammas=[1], max_seq=32, max_batch=1)
    assert not out.exists() and leftovers(out) == []


@pytest.mark.slow
def test_two_builds_into_one_directory_end_with_one_valid_bundle(checkpoints, tmp_path):
    out = tmp_path / "bundle"
    builds = [subprocess.Popen(build_command(checkpoints, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True) for _ in range(2)]
    results = [(b.wait(300), b.stderr.read()) for b in builds]
    assert verify_bundle(out) and leftovers(out) == []
    assert any(code == 0 for code, _ in results)
    for code, err in results:
        if code != 0:  # it says why, in one line
            [line] = [line for line in err.splitlines() if line.startswith("Error:")]
            assert "another build" in line or "already exists" in line


def test_a_damaged_demo_cache_entry_is_rebuilt(checkpoints, tmp_path, caplog, monkeypatch):
    from speccompile import demo
    from speccompile.demo import _built

    monkeypatch.setattr(demo, "DEMO_MAX_SEQ", 64)  # the tiny checkpoint's positions
    target = checkpoints("llama")
    bundle = tmp_path / "demo-cached"
    _built(bundle, "the test bundle", target, target)
    weights = bundle / "target.weights"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a crash truncated it
    with caplog.at_level(logging.WARNING, logger="speccompile"):
        assert _built(bundle, "the test bundle", target, target) == bundle
    assert "the test bundle in the cache is damaged" in caplog.text
    assert verify_bundle(bundle)
