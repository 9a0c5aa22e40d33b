"""Two extractions into the same ``--out``: the second stops in one line naming the first (pid, host); the lock
is the OS's (``fcntl.flock``), so a killed run leaves none behind and the next run goes ahead."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import h5py
import pytest

from retr.common.errors import UserError
from retr.manifests.synthetic import generate_synthetic
from retr.pipeline.extract import lock_shards, shard_lock_path
from retr.store.features import shard_name

NAME = "tencrop-resnet152"

#: A first extraction that blocks inside its first batch (after its shard's .partial file is open) until told to go.
HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import numpy as np, torch
    from retr.extractors.base import Extractor
    from retr.pipeline.extract import extract_features

    manifest, out, started, go = sys.argv[1:5]

    class Blocking(Extractor):
        name, kind = "tencrop-resnet152", "tencrop"

        @property
        def feature_shape(self):
            return (10, 2048)

        def attrs(self):
            return dict(kind="tencrop", extractor="blocking", backbone="none", weights="random", image_size=32)

        def load(self, path):
            return torch.zeros(1)

        def extract(self, batch):
            Path(started).touch()
            while not Path(go).exists():
                time.sleep(0.05)
            return {"features": np.zeros((len(batch), 10, 2048), np.float32)}

    extract_features(manifest, "tencrop-resnet152", out, workers=0, quiet=True, build=lambda name, **o: Blocking())
""")


@pytest.fixture
def holder(tmp_path):
    """Start the blocking first extraction; yields (process, manifest, out, go file) once it is inside a batch."""
    generate_synthetic(tmp_path / "data", num_images=3, seed=0)
    manifest, out = tmp_path / "data" / "manifest.jsonl", tmp_path / "features"
    started, go = tmp_path / "started", tmp_path / "go"
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(manifest), str(out), str(started), str(go)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not started.exists():
            assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() < deadline, "the first extraction did not start"
            time.sleep(0.05)
        yield process, manifest, out, go
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()


def test_the_second_extraction_is_refused_in_one_line(holder, run_cli):
    process, manifest, out, go = holder
    assert (out / NAME / (shard_name(0, 1) + ".partial")).exists()
    code, stdout, stderr = run_cli.as_user("pipeline", "extract", "--manifest", manifest, "--extractor", NAME,
                                           "--out", out, "--weights", "random", "--image-size", "32",
                                           "--workers", "0", "--quiet")
    assert code == 1 and stdout == "" and stderr.count("\n") == 1 and "Traceback" not in stderr
    assert stderr.startswith(f"error: another extraction (pid {process.pid} on host {socket.gethostname()}, "
                             f"started ")
    assert stderr.endswith(f") is writing {out / NAME / shard_name(0, 1)}; wait for it to finish (its finished "
                           f"shards are then reused), or give another out folder\n")
    go.touch()
    assert process.wait(timeout=120) == 0
    with h5py.File(out / NAME / shard_name(0, 1), "r") as f:  # the first run's shard, untouched by the second
        assert f.attrs["extractor"] == "blocking" and f["features"].shape[0] == 3


def test_a_killed_extraction_leaves_no_lock_and_the_next_run_goes_ahead(holder, run_cli):
    process, manifest, out, _go = holder
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    assert shard_lock_path(out / NAME, 0, 1).exists()   # the file stays; the lock went with the process
    code, stdout, stderr = run_cli.as_user("pipeline", "extract", "--manifest", manifest, "--extractor", NAME,
                                           "--out", out, "--weights", "random", "--image-size", "32",
                                           "--workers", "0", "--quiet")
    assert code == 0, stderr
    assert "3 images in 1 shard" in stdout and "index written" in stdout
    assert not (out / NAME / (shard_name(0, 1) + ".partial")).exists()


def test_lock_conflicts_inside_one_process_and_an_empty_lock_file(tmp_path):
    folder = tmp_path / NAME
    with contextlib.ExitStack() as first:
        lock_shards(folder, [0, 2], 3, first)
        lock_shards(folder, [1], 3, None)              # another shard: free
        message = rf"another extraction \(pid {os.getpid()} on host .*\) is writing .*shard-00002-of-00003.h5"
        with pytest.raises(UserError, match=message):
            lock_shards(folder, [1, 2], 3, None)       # looking
        with pytest.raises(UserError, match=message), contextlib.ExitStack() as taking:
            lock_shards(folder, [1, 2], 3, taking)     # taking: shard 1's lock goes when the stack closes
    with contextlib.ExitStack() as again:              # released with the first stack
        lock_shards(folder, [0, 1, 2], 3, again)
    assert sorted(p.name for p in folder.iterdir()) == [f".{shard_name(r, 3)}.lock" for r in range(3)]
    # a holder that has the lock but has not written its pid yet
    import fcntl
    path = shard_lock_path(folder, 0, 3)
    path.write_text("")
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        with pytest.raises(UserError, match=r"another extraction \(pid unknown: it has only just started\)"):
            lock_shards(folder, [0], 3, None)
    assert not (tmp_path / "elsewhere").exists()
    lock_shards(tmp_path / "elsewhere", [0], 1, None)  # looking creates nothing
    assert not (tmp_path / "elsewhere").exists()
    assert Path(folder).is_dir()
